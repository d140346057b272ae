"""The recurrent layers' Triton kernels (models/scan_kernels.py) against their torch references (deltanet.py,
mamba2.py), same inputs, same GPU, one run: each line times a kernel and the reference it replaces and reports their
largest difference. Decode lines also give the state traffic's bandwidth against the device-to-device copy
bandwidth measured in the same run (a decode step reads and writes every sequence's float32 state once: that is its
roofline).

Shapes (defaults): Qwen3.5-35B-A3B's linear-attention layers (32 value heads, 16 key heads, d_k = d_v = 128) and
Nemotron-H's Mamba-2 layers (128 heads of head_dim 64, state 128, 8 groups); decode batch 64, prefill one sequence
of 4096 tokens; activations bf16, the state float32. Prints one JSON line per result:

    python benchmarks/bench_scan_kernels.py                       # everything
    python benchmarks/bench_scan_kernels.py --only gdn_prefill --precisions ieee,tf32x3 --blocks 16,32,64
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from miles_hpc.models import deltanet, mamba2

KINDS = ("gdn_decode", "gdn_prefill", "ssd_decode", "ssd_prefill")


def cuda_time(fn: Callable[[], object], reps: int) -> float:
    """Mean seconds per call (CUDA events, after 3 warm-ups)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src), reps=20)


def bf16(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)


def gdn_inputs(bsz: int, t: int, n_k: int, n_v: int, d: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = bf16(gen, bsz, t, n_k, d), bf16(gen, bsz, t, n_k, d), bf16(gen, bsz, t, n_v, d)
    g = -torch.rand(bsz, t, n_v, device="cuda", generator=gen) * 0.5  # log-decay as the layer makes it (float32)
    beta = torch.rand(bsz, t, n_v, device="cuda", generator=gen).to(torch.bfloat16)  # sigmoid(b) in bf16
    state = torch.randn(bsz, n_v, d, d, device="cuda", generator=gen) * 0.1
    return [q, k, v, g, beta, state]


def ssd_inputs(bsz: int, t: int, heads: int, p: int, groups: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = bf16(gen, bsz, t, heads, p)
    dt = torch.rand(bsz, t, heads, device="cuda", generator=gen) * 0.1 + 1e-3
    a = -torch.rand(heads, device="cuda", generator=gen) * 8
    b, c = bf16(gen, bsz, t, groups, n), bf16(gen, bsz, t, groups, n)
    state = torch.randn(bsz, heads, p, n, device="cuda", generator=gen) * 0.1
    return [x, dt, a, b, c, state]


def emit(line: dict[str, Any], got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    line["max_abs_err_out"] = float((got[0].float() - want[0].float()).abs().max())
    line["max_abs_err_state"] = float((got[1] - want[1]).abs().max())
    line["out_scale"] = float(want[0].float().abs().max())
    print(json.dumps(line), flush=True)


def bench(kind: str, args: argparse.Namespace, bw: float) -> None:
    """One kind's lines: the reference timed once, then each kernel setting against it."""
    from miles_hpc.models import scan_kernels as sk

    decode = kind.endswith("decode")
    t = 1 if decode else args.prefill_tokens
    bsz = args.decode_batch if decode else 1
    if kind.startswith("gdn"):
        ins = gdn_inputs(bsz, t, args.key_heads, args.value_heads, args.head_dim)
        ref: Callable[[], Any] = (
            (lambda: deltanet.gated_delta_recurrent(*ins)) if decode else (lambda: deltanet.gated_delta_chunked(*ins))
        )
        shape = {"batch": bsz, "tokens": t, "value_heads": args.value_heads, "key_heads": args.key_heads,
                 "d_k": args.head_dim, "d_v": args.head_dim}  # fmt: skip
        state_bytes = 4 * bsz * args.value_heads * args.head_dim**2
    else:
        ins = ssd_inputs(bsz, t, args.mamba_heads, args.mamba_head_dim, args.groups, args.state)
        ref = (lambda: mamba2.ssd_recurrent(*ins)) if decode else (lambda: mamba2.ssd_chunked(*ins, mamba2.CHUNK))
        shape = {"batch": bsz, "tokens": t, "heads": args.mamba_heads, "head_dim": args.mamba_head_dim,
                 "groups": args.groups, "state": args.state}  # fmt: skip
        state_bytes = 4 * bsz * args.mamba_heads * args.mamba_head_dim * args.state
    with torch.no_grad():
        want = ref()
        torch_s = cuda_time(ref, reps=args.reps if decode else max(1, args.reps // 10))
        settings = [(b, None, None) for b in args.blocks] if decode else [
            (b, p, st) for b in args.blocks for p in args.precisions for st in args.stages
        ]  # fmt: skip
        for block, precision, stages in settings:
            line: dict[str, Any] = {"bench": "scan_kernels", "result": kind, **shape, "block": block}
            if precision is not None:
                line |= {"precision": precision, "stages": stages}
            fn = _kernel(sk, kind, ins, block, precision, stages)
            try:
                got = fn()
            except Exception as e:  # a setting the GPU cannot hold (shared memory): say so, go on with the rest
                print(json.dumps({**line, "error": f"{type(e).__name__}: {str(e)[:160]}"}), flush=True)
                continue
            s = cuda_time(fn, reps=args.reps)
            line |= {"triton_ms": round(s * 1e3, 4), "torch_ms": round(torch_s * 1e3, 4),
                     "speedup": round(torch_s / s, 2)}  # fmt: skip
            if decode:  # the state read and written once: the step's compulsory traffic
                line["state_GBps"] = round(2 * state_bytes / s / 1e9, 1)
                line["frac_copy_bw"] = round(2 * state_bytes / s / bw, 3)
            else:
                line["tokens_per_s"] = round(t * bsz / s)
            emit(line, got, want)


def _kernel(
    sk: Any, kind: str, ins: list[torch.Tensor], block: int, precision: str | None, stages: int | None
) -> Callable[[], Any]:
    if kind == "gdn_decode":
        return lambda: sk.gated_delta_recurrent_triton(*ins, block_v=block)
    if kind == "gdn_prefill":
        return lambda: sk.gated_delta_chunked_triton(*ins, block_v=block, precision=precision, stages=stages)
    if kind == "ssd_decode":
        return lambda: sk.ssd_recurrent_triton(*ins, block_p=block)
    return lambda: sk.ssd_chunked_triton(*ins, block_p=block, precision=precision, stages=stages)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128, help="d_k = d_v of the delta rule")
    ap.add_argument("--mamba-heads", type=int, default=128)
    ap.add_argument("--mamba-head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--state", type=int, default=128, help="Mamba-2's ssm_state_size")
    ap.add_argument("--blocks", default="32", help="state columns (rows for SSD) per program, comma-separated")
    ap.add_argument("--precisions", default="ieee", help="tl.dot input precisions of the chunked kernels")
    ap.add_argument("--stages", default="1", help="software-pipelining stages of the chunked kernels' loops")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_scan_kernels: needs a CUDA GPU (the kernels are Triton's; on CPU the torch references run)")
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_scan_kernels: needs triton (the dev extra)")
        return 2
    kinds = [k for k in args.only.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown --only {sorted(unknown)}; choose from {KINDS}")
    args.blocks = [int(b) for b in args.blocks.split(",")]
    args.precisions = args.precisions.split(",")
    args.stages = [int(s) for s in args.stages.split(",")]
    bw = copy_bandwidth()
    print(json.dumps({"bench": "scan_kernels", "result": "copy", "GBps": round(bw / 1e9, 1),
                      "device": torch.cuda.get_device_name()}), flush=True)  # fmt: skip
    for kind in kinds:
        bench(kind, args, bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
