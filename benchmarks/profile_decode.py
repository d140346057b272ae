"""Profile of steady decode steps of the engine (Qwen3-0.6B shapes, random weights, bf16): where the wall time goes.

Prints one JSON line per batch size (``result: profile``): wall time per step, GPU busy time per step (the union of
kernel intervals from torch.profiler), the GPU's idle share, and the kernels' device time by kind; with
``--trace-dir`` also writes each profile as a Chrome trace, and the profiler's kernel table for the eager fused
forward (the graph's kernels one by one).

    python benchmarks/profile_decode.py --batches 64 --prompt-len 448 --trace-dir /tmp/traces
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections import defaultdict
from pathlib import Path

import torch
from bench_decode_kernels import SHAPE  # benchmarks/ is the script's directory
from torch.profiler import ProfilerActivity, profile

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.models import ModelConfig, build_model


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (
        ("decode_stage", "attention"),
        ("gemm", "gemm"),
        ("gemv", "gemm"),
        ("cutlass", "gemm"),
        ("nvjet", "gemm"),
        ("sm90", "gemm"),
        ("skinny", "gemm"),
        ("rms_norm", "norm"),
        ("rope", "rope_store"),
        ("silu", "silu_mul"),
        ("softmax", "sampling"),
        ("argmax", "sampling"),
        ("reduce", "reduce"),
        ("memcpy", "memcpy"),
        ("copy", "copy"),
    ):
        if key in n:
            return label
    return "other"


def gpu_busy(events: list[dict]) -> tuple[float, dict[str, float]]:
    """Union of kernel/memcpy intervals (us) and the device time by kind."""
    spans, by_kind = [], defaultdict(float)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        spans.append((e["ts"], e["ts"] + e["dur"]))
        by_kind[kind(e["name"]) if e["cat"] == "kernel" else e["cat"]] += e["dur"]
    spans.sort()
    busy, end = 0.0, -1.0
    for a, b in spans:
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, dict(by_kind)


@torch.inference_mode()
def profile_batch(engine: Engine, batch: int, prompt_len: int, steps: int, trace_dir: Path | None) -> dict:
    params = SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    rids = []
    for _ in range(batch):
        ids = torch.randint(0, SHAPE["vocab_size"], (prompt_len,), generator=g).tolist()  # type: ignore[call-overload]
        rids.append(uuid.uuid4().hex)
        engine.submit(GenerateRequest(rid=rids[-1], input_ids=tuple(ids), sampling=params), lambda r: None)
    for _ in range(6):  # prefill, then decode-only steps
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_unprofiled = (time.perf_counter() - t0) / steps
    trace = (trace_dir or Path("/tmp")) / f"decode_trace_b{batch}.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    busy, by_kind = gpu_busy(events)
    if trace_dir is None:
        trace.unlink()
    engine.abort(None)
    return {
        "bench": "profile_decode",
        "result": "profile",
        "batch": batch,
        "ctx": prompt_len + 6 + steps,
        "step_wall_ms": round(wall_unprofiled * 1e3, 3),
        "step_wall_profiled_ms": round(wall * 1e3, 3),
        "gpu_busy_ms": round(busy / steps / 1e3, 3),
        "gpu_idle_frac": round(1 - busy / 1e3 / (wall * 1e3 * steps), 3),
        "device_ms_by_kind": {k: round(v / steps / 1e3, 4) for k, v in sorted(by_kind.items(), key=lambda x: -x[1])},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64")
    ap.add_argument("--prompt-len", type=int, default=448)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trace-dir", type=Path, default=None)
    ap.add_argument("--kernel-table", action="store_true", help="print the eager fused forward's kernel table")
    ap.add_argument("--prefill-table", action="store_true", help="profile one prefill step of 32 x 256 tokens")
    args = ap.parse_args()
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf_dict(dict(SHAPE)), dtype=torch.bfloat16)
    engine = Engine(model, EngineConfig(device="cuda", dtype="bfloat16"))
    for b in (int(x) for x in args.batches.split(",")):
        print(json.dumps(profile_batch(engine, b, args.prompt_len, args.steps, args.trace_dir)), flush=True)
    if args.kernel_table:
        dec = engine.runner.decode
        assert dec is not None
        fwd_args = dec._args(dec.padded(64))
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dec.forward(*fwd_args)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    if args.prefill_table:
        prefill_table(engine)
    engine.shutdown()


@torch.inference_mode()
def prefill_table(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(7)
    for warm in (True, False):
        for _ in range(32):
            ids = torch.randint(0, SHAPE["vocab_size"], (256,), generator=g).tolist()  # type: ignore[call-overload]
            engine.submit(GenerateRequest(rid=uuid.uuid4().hex, input_ids=tuple(ids), sampling=params), lambda r: 0)
        torch.cuda.synchronize()
        if warm:
            while engine.step():
                pass
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        print(
            json.dumps({"bench": "profile_decode", "result": "prefill_step", "tokens": 32 * 256, "wall_ms": wall * 1e3})
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        while engine.step():
            pass


if __name__ == "__main__":
    main()
