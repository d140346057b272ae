"""Zero-KL's batch-invariant GEMM (`models/triton_invariant.py` `_linear_kernel`) at the engine's decode batch and
the trainer's micro-batch, for several fixed tile shapes, against cuBLAS (`F.linear`) on the same operands in the
same run.

A tile shape is a mode-wide constant (the engine and the trainer must run the same one for the bits to agree), so
one shape has to serve both a 64-row decode step and an 8k-row micro-batch. Prints one JSON line per (projection,
rows, implementation): microseconds per GEMM (median of CUDA-event timings after warm-up), TFLOP/s, and the time
relative to cuBLAS.

    python benchmarks/bench_invariant_gemm.py --rows 64,8192
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from miles_hpc.models import triton_invariant as ti

# Qwen3-0.6B linears as the zero-KL model runs them (unfused): (in, out).
SHAPES = {
    "q": (1024, 2048),
    "kv": (1024, 1024),
    "o": (2048, 1024),
    "gate_up": (1024, 3072),
    "down": (3072, 1024),
    "lm_head": (1024, 151936),
}
TILES = {  # (BM, BN, BK, warps, stages)
    "32x64x32": (32, 64, 32, 4, 3),
    "64x64x32": (64, 64, 32, 4, 3),
    "64x64x64": (64, 64, 64, 4, 3),
    "64x128x64": (64, 128, 64, 4, 3),
    "128x64x64": (128, 64, 64, 4, 3),
    "128x128x64w8": (128, 128, 64, 8, 3),
}


def timed(fn, reps: int) -> float:  # noqa: ANN001
    """Median seconds per call of `fn` over `reps` CUDA-event-timed calls, after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int, int, int]) -> None:
    bm, bn, bk, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    ti._linear_kernel[grid](x, w, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), HAS_BIAS=False,
                            PREC=ti._precision(x), BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,8192")
    ap.add_argument("--tiles", default=",".join(TILES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    g = torch.Generator(device=dev).manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for proj, (k, n) in SHAPES.items():
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * k**-0.5
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            flops = 2 * rows * k * n
            base = timed(lambda: F.linear(x, w), args.reps)  # noqa: B023
            common = {"bench": "invariant_gemm", "proj": proj, "rows": rows, "k": k, "n": n, "device": name}
            line = {**common, "impl": "cublas", "us": round(base * 1e6, 2), "tflops": round(flops / base / 1e12, 1)}
            print(json.dumps(line), flush=True)
            want = F.linear(x.float(), w.float())
            for label in args.tiles.split(","):
                tile = TILES[label]
                launch(x, w, out, tile)
                err = ((out.float() - want).norm() / want.norm()).item()
                t = timed(lambda: launch(x, w, out, tile), args.reps)  # noqa: B023
                print(
                    json.dumps(
                        {
                            **common,
                            "impl": f"invariant:{label}",
                            "us": round(t * 1e6, 2),
                            "tflops": round(flops / t / 1e12, 1),
                            "vs_cublas_x": round(t / base, 2),
                            "rel_err": float(f"{err:.2e}"),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
