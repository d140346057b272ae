"""The paged-decode attention kernel and the greedy sampler as a decode step runs them: replayed from a CUDA graph
over one KV cache per layer (cold data, no host launch cost in the timing), over the kernel's knobs.

Prints one JSON line per (batch, config) with the time per call, the K/V bytes over it and the fraction of the
device-to-device copy bandwidth measured in the same run; then per batch the greedy sampler (torch ops against the
Triton pass) with its tokens compared.

    python benchmarks/bench_decode_attn.py --batches 1,8,64,256 --ctx 512
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_decode_gemm import graph_time  # benchmarks/ is the script's directory
from bench_rollout import copy_bandwidth

CONFIGS = [  # (splits, block_n, warps, stages); splits 0 = the engine's default for the batch
    (0, 64, 4, 2),
    (0, 32, 2, 2),
    (0, 64, 2, 3),
    (0, 128, 4, 2),
    (0, 128, 4, 3),
    (0, 64, 4, 3),
    (1, 32, 2, 2),
    (1, 64, 4, 2),
    (2, 32, 2, 2),
    (2, 64, 4, 2),
    (4, 32, 2, 2),
    (4, 64, 4, 2),
    (8, 32, 2, 2),
]


def bench_attention(batch: int, ctx: int, layers: int, bw: float) -> None:
    from miles_hpc.engine.triton_decode import default_splits, paged_decode

    hq, hkv, d, page = 16, 8, 128, 16
    per = -(-ctx // page)
    n_blocks = batch * per + 1
    caches = []
    for _ in range(layers):
        k = torch.randn(n_blocks * page, hkv, d, device="cuda", dtype=torch.bfloat16)
        caches.append((k, torch.randn_like(k)))
    tables = torch.arange(batch * per, device="cuda", dtype=torch.int32).view(batch, per)  # the engine's order
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    for splits, block_n, warps, stages in CONFIGS:
        sp = splits or default_splits(batch, hkv, q.device)
        kw = dict(block_size=page, scale=d**-0.5, num_splits=sp, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            t = graph_time(lambda kw=kw: [paged_decode(q, k, v, tables, lens, **kw) for k, v in caches]) / layers
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(json.dumps({"batch": batch, "cfg": [sp, block_n, warps, stages], "error": str(e)[:200]}))
            continue
        line = {
            "bench": "decode_attn",
            "result": "attention",
            "batch": batch,
            "ctx": ctx,
            "default_splits": splits == 0,
            "splits": sp,
            "block_n": block_n,
            "warps": warps,
            "stages": stages,
            "us": round(t * 1e6, 2),
            "frac_copy_bw": round(kv_bytes / t / bw, 3),
        }
        print(json.dumps(line), flush=True)


def bench_sampler(batch: int, vocab: int) -> None:
    from miles_hpc.engine.decode_ops import greedy_sample_reference
    from miles_hpc.engine.triton_ops import greedy_sample

    logits = [torch.randn(batch, vocab, device="cuda").mul(3).to(torch.bfloat16) for _ in range(8)]
    out = [(torch.empty(batch, dtype=torch.int64, device="cuda"), torch.empty(batch, device="cuda")) for _ in "ab"]
    line: dict[str, object] = {"bench": "decode_attn", "result": "greedy_sampler", "batch": batch, "vocab": vocab}
    for name, fn, (tok, lp) in (("torch", greedy_sample_reference, out[0]), ("triton", greedy_sample, out[1])):
        line[f"{name}_us"] = round(
            graph_time(lambda fn=fn, tok=tok, lp=lp: [fn(x, tok, lp) for x in logits]) / 8 * 1e6, 2
        )
    greedy_sample_reference(logits[0], *out[0])
    greedy_sample(logits[0], *out[1])
    line["tokens_equal"] = bool(torch.equal(out[0][0], out[1][0]))
    line["max_abs_logprob_diff"] = float((out[0][1] - out[1][1]).abs().max())
    print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    bw = copy_bandwidth("cuda")
    assert bw is not None
    print(json.dumps({"bench": "decode_attn", "result": "copy", "GBps": round(bw / 1e9, 1)}), flush=True)
    for b in (int(x) for x in args.batches.split(",")):
        bench_attention(b, args.ctx, args.layers, bw)
        bench_sampler(b, 151936)


if __name__ == "__main__":
    main()
