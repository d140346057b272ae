"""The decode step's projections at decode batch sizes: cuBLAS (`F.linear`) versus the skinny Triton GEMM, as the
step runs them (cold weights: a chain over enough weight copies to leave the L2, captured in a CUDA graph).

Prints one JSON line per (shape, batch, implementation) with the time per GEMM, the weight bytes over it, and the
fraction of the device-to-device copy bandwidth measured in the same run.

    python benchmarks/bench_decode_gemm.py --batches 1,8,64,256
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

# Qwen3-0.6B decode projections: (K, N).
SHAPES = {"qkv": (1024, 4096), "o_proj": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}
VARIANTS = {  # (block_n, block_k, split_k, warps, stages)
    "t64x128": (64, 128, 1, 4, 4),
    "t32x128": (32, 128, 1, 4, 4),
    "t32x256": (32, 256, 1, 4, 3),
    "t64x128s2": (64, 128, 2, 4, 4),
    "t32x128s2": (32, 128, 2, 4, 4),
    "t64x256s4": (64, 256, 4, 4, 3),
    "t16x256": (16, 256, 1, 4, 3),
    "t32x128s4": (32, 128, 4, 4, 4),
    "t32x128s8": (32, 128, 8, 4, 3),
    "t16x128s8": (16, 128, 8, 4, 3),
    "t64x128s8": (64, 128, 8, 4, 3),
    "t64x64st6": (64, 64, 1, 4, 6),
    "t128x64w8": (128, 64, 1, 8, 4),
}


def graph_time(fn, reps: int = 20) -> float:  # noqa: ANN001
    """Seconds per replay of a graph of `fn` (median of `reps`, CUDA events)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_time(lambda: dst.copy_(src))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    from miles_hpc.engine.triton_gemm import skinny_linear

    bw = copy_bandwidth()
    print(json.dumps({"bench": "decode_gemm", "result": "copy", "GBps": round(bw / 1e9, 1)}), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        copies = max(8, (256 << 20) // (2 * n * k))  # > 4x the L2 in weights per chain
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            ref = F.linear(x, ws[0])
            impls = {"cublas": lambda w, o: torch.mm(x, w.t(), out=o)}
            for v in args.variants.split(","):
                bn, bk, sk, wp, st = VARIANTS[v]
                if k % (bk * sk):
                    continue
                impls[v] = lambda w, o, c=(bn, bk, sk, wp, st): skinny_linear(
                    x, w, block_n=c[0], block_k=c[1], split_k=c[2], num_warps=c[3], num_stages=c[4], out=o
                )
            for impl, f in impls.items():
                try:
                    got = f(ws[0], outs[0]).float()
                    err = ((got - ref.float()).norm() / ref.float().norm()).item()
                    t = graph_time(lambda f=f: [f(w, outs[i % 2]) for i, w in enumerate(ws)]) / copies
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    print(json.dumps({"shape": name, "batch": m, "impl": impl, "error": str(e)[:200]}), flush=True)
                    continue
                line = {
                    "bench": "decode_gemm",
                    "result": "gemm",
                    "shape": name,
                    "K": k,
                    "N": n,
                    "batch": m,
                    "impl": impl,
                    "us": round(t * 1e6, 2),
                    "GBps": round(2 * n * k / t / 1e9, 1),
                    "frac_copy_bw": round(2 * n * k / t / bw, 3),
                    "rel_err": float(f"{err:.2e}"),
                }
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
