"""What "no prefix reuse for hybrid layers" costs (issue 29; docs/engine.md): a GRPO group, `--group` samples of
one `--prompt`-token prompt submitted together, on the embedded engine, for a hybrid preset (its recurrent state
lives per sequence: no cached prefix) beside a dense preset of the same size whose prefix cache is on: the peer,
measured in the same run on the same machine.

Prints one JSON line per model: ``{"model", "device", "group", "prompt_tokens", "new_tokens", "computed_prompt_tokens"
(prompt tokens the engine ran: all of them minus what the cache served), "cached_prompt_tokens", "reused_fraction",
"wall_s", "prompt_tokens_per_s"}`` and a last line comparing the two: ``{"hybrid_over_dense_computed", ...}``.

    python benchmarks/bench_hybrid_prefix.py                       # CPU, tiny presets, group 8, 512-token prompt
    python benchmarks/bench_hybrid_prefix.py --device cuda --size small --group 16 --prompt 4096
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams
from miles_hpc.models.presets import init_model


def run_group(path: Path, device: str, group: int, prompt: int, new: int) -> dict[str, object]:
    engine = Engine.from_pretrained(str(path), EngineConfig(device=device, block_size=16, max_total_tokens=65536))
    ids = tuple(torch.randint(0, 256, (prompt,), generator=torch.Generator().manual_seed(0)).tolist())
    sp = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
    results: dict[str, GenerateResult] = {}
    # Warm-up (allocations, first-call overheads), then a flush so the timed group starts from an empty cache.
    engine.submit(GenerateRequest(rid="warm", input_ids=ids[:32], sampling=sp), lambda r: None)
    while engine.step():
        pass
    engine.flush_cache()
    start = time.perf_counter()
    for i in range(group):
        engine.submit(GenerateRequest(rid=str(i), input_ids=ids, sampling=sp), lambda r: results.__setitem__(r.rid, r))
    while engine.step():
        pass
    wall = time.perf_counter() - start
    cached = sum(r.cached_tokens for r in results.values())
    total = group * prompt
    return {
        "model": engine.model.config.model_type,
        "device": device,
        "group": group,
        "prompt_tokens": total,
        "new_tokens": group * new,
        "computed_prompt_tokens": total - cached,
        "cached_prompt_tokens": cached,
        "reused_fraction": round(cached / total, 4),
        "wall_s": round(wall, 4),
        "prompt_tokens_per_s": round(total / wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--hybrid", default="qwen3_5_moe_text", help="hybrid preset (qwen3_next, qwen3_5_moe_text, nemotron_h)"
    )
    ap.add_argument("--dense", default="qwen3_moe", help="the peer: a preset whose prefix cache is on")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO's group)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="tokens generated per sample")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in (args.dense, args.hybrid):
            path = init_model(arch, args.size, Path(tmp) / arch, seed=0)
            rows.append(run_group(path, args.device, args.group, args.prompt, args.new))
            print(json.dumps(rows[-1]), flush=True)
    dense, hybrid = rows
    print(
        json.dumps(
            {
                "hybrid_over_dense_computed": round(
                    hybrid["computed_prompt_tokens"] / dense["computed_prompt_tokens"], 2
                ),  # type: ignore[operator]
                "hybrid_over_dense_wall": round(hybrid["wall_s"] / dense["wall_s"], 2),  # type: ignore[operator]
                "note": "the models differ (layers, widths): wall time compares engines, computed tokens the cache",
            }
        )
    )


if __name__ == "__main__":
    main()
