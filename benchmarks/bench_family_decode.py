"""What the decode states of DeepSeek-V4 and Inkling (engine/family_states.py, issue 30) buy: the embedded engine
generating with each sequence's cached state, beside the same engine recomputing every sequence from its first
token each step (the path a family without `new_state` takes: engine/runner.py `recomputes`), the peer, in the
same run on the same machine. Both give the model's own tokens (tests/test_engine_families.py); this measures time.

Prints one JSON line per (model, path): ``{"model", "path", "device", "sequences", "prompt_tokens", "new_tokens",
"wall_s", "new_tokens_per_s"}`` and one per model comparing the two: ``{"model", "cached_over_recomputed"}``.

    python benchmarks/bench_family_decode.py                          # CPU, tiny presets, 8 x (64 + 128) tokens
    python benchmarks/bench_family_decode.py --sequences 16 --prompt 256 --new 256
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


def generate(path: Path, path_kind: str, args: argparse.Namespace) -> dict[str, object]:
    engine = Engine.from_pretrained(str(path), EngineConfig(device=args.device, block_size=16, max_total_tokens=65536))
    if path_kind == "recomputed":
        engine.runner.executor.family, engine.runner.executor.recompute = None, True
    sp = SamplingParams(max_new_tokens=args.new, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, 256, (args.prompt,), generator=gen).tolist()) for _ in range(args.sequences)]
    results: dict[str, GenerateResult] = {}
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(GenerateRequest(rid=str(i), input_ids=ids, sampling=sp), lambda r: results.__setitem__(r.rid, r))
    while engine.step():
        pass
    wall = time.perf_counter() - start
    new = sum(r.completion_tokens for r in results.values())
    assert len(results) == args.sequences and new == args.sequences * args.new
    retracted = sum(r.num_retractions for r in results.values())  # a cache too small would time re-prefills
    assert retracted == 0, f"{retracted} retractions: the engine's cache is too small for this run"
    return dict(
        path=path_kind,
        device=args.device,
        sequences=args.sequences,
        prompt_tokens=args.prompt,
        new_tokens=args.new,
        wall_s=round(wall, 3),
        new_tokens_per_s=round(new / wall, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deepseek_v4,inkling_text")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            path = init_model(model, "tiny", Path(tmp) / model, seed=0)
            rows = {kind: generate(path, kind, args) for kind in ("cached", "recomputed")}
            for row in rows.values():
                print(json.dumps({"model": model, **row}), flush=True)
            ratio = float(rows["cached"]["new_tokens_per_s"]) / float(rows["recomputed"]["new_tokens_per_s"])  # type: ignore[arg-type]
            print(json.dumps({"model": model, "cached_over_recomputed": round(ratio, 2)}), flush=True)


if __name__ == "__main__":
    main()
