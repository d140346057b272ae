"""Where a decode step's time goes on GPU: the paged-decode kernel's bandwidth (over its tuning knobs) and one
engine decode step taken apart (wall time, graph replay, eager fused forward, per-kernel device time).

Prints one JSON line per result (``kernel`` per config, then ``step``) and a profiler table of the eager step.

    python benchmarks/bench_decode_kernels.py                 # Qwen3-0.6B shapes, batch 64, context 768, bf16
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import uuid

import torch

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.models import ModelConfig, build_model

SHAPE = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    eos_token_id=151645,
)


SPLITS = [1, 2]


def cuda_time(fn, reps: int = 20) -> float:  # noqa: ANN001
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
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src))


def bench_kernel(batch: int, ctx: int, bw: float) -> None:
    from miles_hpc.engine.decode_ops import paged_decode_reference
    from miles_hpc.engine.triton_decode import paged_decode

    hq, hkv, d, page, dtype = 16, 8, 128, 16, torch.bfloat16
    blocks_per = -(-ctx // page)
    n_blocks = batch * blocks_per + 1
    k = torch.randn(n_blocks * page, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    tables = torch.randperm(n_blocks - 1, device="cuda")[: batch * blocks_per].view(batch, blocks_per).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    kv_bytes = 2 * batch * ctx * hkv * d * k.element_size()
    kw = dict(block_size=page, scale=d**-0.5)
    t = cuda_time(lambda: paged_decode_reference(q, k, v, tables, lens, **kw), reps=5)
    print(
        json.dumps(
            {
                "bench": "decode_kernels",
                "result": "kernel",
                "impl": "torch_gather",
                "ms": round(t * 1e3, 4),
                "GBps": round(kv_bytes / t / 1e9, 1),
            }
        ),
        flush=True,
    )
    configs = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (64, 2, 3), (32, 2, 2), (128, 4, 2), (128, 8, 3)]
    configs += [(64, 8, 3), (32, 2, 4), (16, 1, 4), (128, 4, 3)]
    for splits in SPLITS:
        for block_n, warps, stages in configs:
            fn = functools.partial(
                paged_decode,
                q,
                k,
                v,
                tables,
                lens,
                num_splits=splits,
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
                **kw,
            )
            try:
                t = cuda_time(fn)
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                print(
                    json.dumps(
                        {
                            "result": "kernel",
                            "error": f"{type(e).__name__}: {str(e)[:200]}",
                            "cfg": [splits, block_n, warps, stages],
                        }
                    ),
                    flush=True,
                )
                continue
            print(
                json.dumps(
                    {
                        "bench": "decode_kernels",
                        "result": "kernel",
                        "batch": batch,
                        "ctx": ctx,
                        "splits": splits,
                        "block_n": block_n,
                        "warps": warps,
                        "stages": stages,
                        "us": round(t * 1e6, 1),
                        "GBps": round(kv_bytes / t / 1e9, 1),
                        "frac_copy_bw": round(kv_bytes / t / bw, 3),
                    }
                ),
                flush=True,
            )


@torch.inference_mode()
def bench_step(batch: int, prompt_len: int, bw: float, cuda_graphs: bool) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf_dict(dict(SHAPE)), dtype=torch.bfloat16)
    engine = Engine(model, EngineConfig(device="cuda", dtype="bfloat16", cuda_graphs=cuda_graphs))
    params = SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        ids = torch.randint(0, SHAPE["vocab_size"], (prompt_len,), generator=g).tolist()  # type: ignore[call-overload]
        engine.submit(GenerateRequest(rid=uuid.uuid4().hex, input_ids=tuple(ids), sampling=params), lambda r: None)
    for _ in range(4):  # prefill, then decode-only steps
        engine.step()
    torch.cuda.synchronize()
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / n
    # The same steps with a device sync after each phase: where the wall time goes.
    phases = {"schedule": 0.0, "run": 0.0, "postprocess": 0.0}
    sched, runner = engine.scheduler, engine.runner
    originals = {"schedule": sched.schedule, "run": runner.run, "postprocess": sched.postprocess}

    def timed(name: str):  # noqa: ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            out = originals[name](*a, **k)
            torch.cuda.synchronize()
            phases[name] += time.perf_counter() - t
            return out

        return call

    sched.schedule, runner.run, sched.postprocess = timed("schedule"), timed("run"), timed("postprocess")
    for _ in range(n):
        engine.step()
    sched.schedule, runner.run, sched.postprocess = originals["schedule"], originals["run"], originals["postprocess"]
    ctx = prompt_len + 4 + 2 * n
    line: dict[str, object] = {
        "bench": "decode_kernels",
        "result": "step",
        "batch": batch,
        "ctx": ctx,
        "cuda_graphs": cuda_graphs,
        "step_ms": round(step_s * 1e3, 3),
        "tok_s": round(batch / step_s, 1),
        **{f"{k}_ms": round(v / n * 1e3, 3) for k, v in phases.items()},
    }
    dec = engine.runner.decode
    assert dec is not None
    bs = dec.padded(batch)
    if bs in dec.graphs:
        line["graph_replay_ms"] = round(cuda_time(dec.graphs[bs].replay) * 1e3, 3)
    args = dec._args(bs)
    line["eager_fused_ms"] = round(cuda_time(lambda: dec.forward(*args), reps=5) * 1e3, 3)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    kv = batch * ctx * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    line["roofline_step_ms"] = round((weights + kv) / bw * 1e3, 3)
    print(json.dumps(line), flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--batches", default=None, help="kernel sweep at these batch sizes (default: --batch)")
    ap.add_argument("--splits", default="1,2")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(json.dumps({"bench": "decode_kernels", "result": "copy", "GBps": round(bw / 1e9, 1)}), flush=True)
    SPLITS[:] = [int(x) for x in args.splits.split(",")]
    if not args.skip_kernel:
        for b in [int(x) for x in args.batches.split(",")] if args.batches else [args.batch]:
            bench_kernel(b, args.ctx, bw)
    if not args.skip_step:
        bench_step(args.batch, args.prompt_len, bw, args.cuda_graphs)


if __name__ == "__main__":
    main()
