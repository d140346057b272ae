"""Rollout throughput of the embedded engine versus `transformers` generate on the same weights, and the HBM roofline.

Prints one JSON line per result:
- ``decode``: tokens/s of our engine and of HF `generate` (same weights, batch, prompt and output lengths, greedy,
  EOS ignored so every sample runs to the length), and on GPU the fraction of the decode roofline: the bytes one
  decode step must read (all weights + the KV of every sequence at the mean context) over the device-to-device copy
  bandwidth measured in the same run.
- ``prefix_cache``: prefill time of a request whose long prefix is cached versus one with a fresh prompt of the same
  length (max_new_tokens=1 each, median of 5 fresh prefixes), and the ratio.

    python benchmarks/bench_rollout.py                       # CPU: the tiny preset
    python benchmarks/bench_rollout.py --device cuda --shape qwen3-0.6b --batch 64 --prompt-len 256 --new-tokens 512
    python benchmarks/bench_rollout.py --device cuda --shape qwen3-30b-a3b-12l --skip-hf --batches 1,8,64

MoE shapes: the roofline's weight bytes are the dense weights plus the routed experts each step's tokens chose
(distinct (layer, expert) pairs, read from the results' routed experts, averaged over the steps).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams
from miles_hpc.models import ModelConfig, build_model, save_pretrained
from miles_hpc.models.moe import Experts
from miles_hpc.models.presets import preset_config

# Real shapes of public models (random weights): what matters for throughput is the shape, not the values.
SHAPES: dict[str, dict[str, object]] = {
    "qwen3-0.6b": dict(
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
    ),
    # Qwen3-30B-A3B's widths (128 experts, 8 per token, expert width 768) with 12 of its 48 layers: MoE decode at
    # real widths in ~8 GB of bf16 weights.
    "qwen3-30b-a3b-12l": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        eos_token_id=151645,
    ),
}


def make_checkpoint(shape: str, dtype: torch.dtype, out: Path) -> Path:
    """`shape`: a key of SHAPES, a qwen3 preset size, or ARCH:SIZE of the presets (qwen3_moe:tiny, ...)."""
    if shape in SHAPES:
        return write_checkpoint(dict(SHAPES[shape]), dtype, out)
    arch, _, size = shape.rpartition(":")
    return write_checkpoint(preset_config(arch or "qwen3", size), dtype, out)


def write_checkpoint(hf: dict[str, object], dtype: torch.dtype, out: Path) -> Path:
    """A random-init (seed 0) HF checkpoint of config `hf` in `dtype` at `out`. Initialised on the GPU where there
    is one: with the CPU init, the reduced 30B MoE (7B parameters) printed nothing within 95 s."""
    hf = {**hf, "torch_dtype": str(dtype).removeprefix("torch.")}
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else None
    save_pretrained(build_model(ModelConfig.from_hf_dict(hf), dtype=dtype, device=device), out)
    if device is not None:
        torch.cuda.empty_cache()  # the engine sizes its KV pool from the free memory
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy, bytes read + written per second (the practical HBM limit)."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 20
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * reps / (start.elapsed_time(end) / 1e3)


def run_engine(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    step_times: list[float] | None = None,
    routed: bool = False,
) -> tuple[float, list[GenerateResult]]:
    """Wall time to run `prompts` to completion; `step_times` (if given) gets each step's wall time; `routed`: the
    results carry the experts of each output token's step (MoE)."""
    results: list[GenerateResult] = []
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        req = GenerateRequest(
            rid=f"{i:06d}-{uuid.uuid4().hex}",
            input_ids=tuple(p),
            sampling=params,
            return_routed_experts=routed,
            routed_experts_start_len=len(p) if routed else 0,
        )
        engine.submit(req, results.append)
    runner = engine.runner
    wrapped = {name: getattr(runner, name) for name in ("run", "launch", "collect") if hasattr(runner, name)}
    run_s = [0.0]

    def timed(fn):  # noqa: ANN001, ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            tr = time.perf_counter()
            out = fn(*a, **k)
            run_s[0] += time.perf_counter() - tr
            return out

        return call

    if step_times is not None:
        for name, fn in wrapped.items():
            setattr(runner, name, timed(fn))
    while len(results) < len(prompts):
        ts = time.perf_counter()
        engine.step()
        if step_times is not None:
            step_times.append(time.perf_counter() - ts)
    sync(str(engine.device))
    elapsed = time.perf_counter() - t0
    if step_times is not None:
        for name in wrapped:
            delattr(runner, name)  # the class's methods again
        step_times.append(run_s[0])  # last entry: total time inside the runner (launch, collect, run)
    return elapsed, results


def step_summary(times: list[float]) -> dict[str, object]:
    """Where the engine's wall time went: the first steps (prefill), the per-step distribution after them, and the
    share of the time spent inside `runner.run` (the forward and sampling) rather than in scheduling."""
    times, run_s = times[:-1], times[-1]
    rest = sorted(times[3:]) or [0.0]
    slow = sorted(range(len(times)), key=lambda i: -times[i])[:5]
    return {
        "steps": len(times),
        "first3_steps_s": round(sum(times[:3]), 4),
        "rest_s": round(sum(rest), 4),
        "runner_s": round(run_s, 4),
        "step_median_ms": round(rest[len(rest) // 2] * 1e3, 3),
        "step_p90_ms": round(rest[9 * len(rest) // 10] * 1e3, 3),
        "slowest_steps_ms": {i: round(times[i] * 1e3, 2) for i in slow},
    }


def run_hf(
    model_dir: Path, prompts: list[list[int]], warm: list[list[int]], new_tokens: int, device: str, dtype: torch.dtype
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(torch.tensor(warm, device=device), max_new_tokens=4, do_sample=False, pad_token_id=0)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def expert_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of every weight outside the routed experts, bytes of one routed expert of one layer)."""
    experts = [m for m in engine.model.modules() if isinstance(m, Experts)]
    total = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    if not experts:
        return total, 0
    e = experts[0]
    one = (e.gate_up_proj[0].numel() + e.down_proj[0].numel()) * e.gate_up_proj.element_size()
    return total - one * sum(m.num_experts for m in experts), one


def touched_experts(results: list[GenerateResult]) -> float:
    """Mean over decode steps of the distinct (layer, expert) pairs the batch's tokens route to in that step: the
    expert weights the step must read. Row j of each result is its output token j's input (decode step j + 1)."""
    rows = [r.routed_experts for r in results]
    assert all(x is not None for x in rows)
    steps = min(x.shape[0] for x in rows)  # type: ignore[union-attr]
    counts = []
    for j in range(steps):
        step = np.stack([x[j] for x in rows])  # type: ignore[index]  # [batch, layers, top_k]
        counts.append(sum(len(np.unique(step[:, layer])) for layer in range(step.shape[1])))
    return float(np.mean(counts))


def decode_bytes_per_step(engine: Engine, batch: int, mean_context: float, experts_touched: float = 0.0) -> float:
    """Bytes one decode step must read: every weight once (MoE: the routed experts the step's tokens chose, mean
    `experts_touched` (layer, expert) pairs) + the K and V of each sequence's context."""
    dense, one_expert = expert_bytes(engine)
    weights = dense + experts_touched * one_expert
    c = engine.model.config
    kv_per_token = (
        2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * engine.model.lm_head.weight.element_size()
    )
    return weights + batch * mean_context * kv_per_token


def bench_prefix(engine: Engine, vocab: int, prefix_len: int, device: str, reps: int = 5) -> dict[str, object]:
    """Median over `reps` fresh prefixes of: the prefill (max_new_tokens=1) of a request whose first `prefix_len`
    tokens an earlier request left in the cache, and of a request of the same length with nothing cached."""
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    # Warm both paths once with other tokens (first-call costs such as attention-kernel plans are not caching).
    warm = rand(prefix_len)
    run_engine(engine, [warm + rand(16)], 1)
    run_engine(engine, [warm + rand(16)], 1)
    run_engine(engine, [rand(prefix_len + 16)], 1)
    cached_s, fresh_s, hits, misses = [], [], [], []
    for _ in range(reps):
        prefix = rand(prefix_len)
        run_engine(engine, [prefix + rand(16)], 1)  # fills the cache with the prefix
        t, (hit,) = run_engine(engine, [prefix + rand(16)], 1)
        cached_s.append(t)
        hits.append(hit.cached_tokens)
        t, (miss,) = run_engine(engine, [rand(prefix_len + 16)], 1)
        fresh_s.append(t)
        misses.append(miss.cached_tokens)
    t_cached, t_fresh = statistics.median(cached_s), statistics.median(fresh_s)
    return {
        "bench": "rollout",
        "result": "prefix_cache",
        "device": device,
        "prefix_tokens": prefix_len,
        "new_tokens": 16,
        "reps": reps,
        "cached_tokens": min(hits),
        "fresh_cached_tokens": max(misses),
        "prefill_cached_s": round(t_cached, 5),
        "prefill_fresh_s": round(t_fresh, 5),
        "prefill_cached_all_s": [round(t, 5) for t in cached_s],
        "prefill_fresh_all_s": [round(t, 5) for t in fresh_s],
        "speedup": round(t_fresh / t_cached, 2),
    }


def bench_decode(
    engine: Engine, batch: int, prompt_len: int, new_tokens: int, bw: float | None, meta: dict[str, object]
) -> dict[str, object]:
    """One `decode` line: `batch` random prompts of `prompt_len` tokens run to `new_tokens` each, after a warm-up
    batch of the same shape (other tokens, 4 new tokens), against the roofline at the mean context."""
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    # Warm-up, as HF gets: a batch of the same shape with other tokens (no prefix-cache hits), 4 new tokens,
    # so one-time costs (lazy kernel loading, allocator growth, kernel compilation) stay out of both timings.
    warm = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    moe = engine.model.num_moe_layers > 0
    run_engine(engine, warm, 4, routed=moe)
    step_times: list[float] = []
    t_ours, results = run_engine(engine, prompts, new_tokens, step_times, routed=moe)
    assert all(r.completion_tokens == new_tokens for r in results)
    tokens = batch * new_tokens
    line: dict[str, object] = {
        "bench": "rollout",
        "result": "decode",
        **meta,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "engine_tok_s": round(tokens / t_ours, 1),
        "engine_s": round(t_ours, 3),
        "step_summary": step_summary(step_times),
        "_prompts": prompts,
        "_warm": warm,
        "_outputs": [(r.output_ids, r.output_logprobs) for r in sorted(results, key=lambda r: r.rid)],
    }
    touched = 0.0
    if moe:  # the roofline reads the experts this run's steps touched (all of them: every step reads the rest)
        touched = touched_experts(results)
        total = engine.model.num_moe_layers * engine.model.config.num_experts
        line.update(experts_touched_per_step=round(touched, 1), experts_total=total)
    if bw is not None:
        step_bytes = decode_bytes_per_step(engine, batch, prompt_len + new_tokens / 2, touched)
        roofline = batch / (step_bytes / bw)
        line.update(
            copy_GBps=round(bw / 1e9, 1),
            roofline_tok_s=round(roofline, 1),
            roofline_step_ms=round(step_bytes / bw * 1e3, 3),
            roofline_frac=round(tokens / t_ours / roofline, 4),
        )
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, help=f"{', '.join(SHAPES)}, a qwen3 preset size or ARCH:SIZE")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument(
        "--batches", default=None, help="comma-separated batch sizes: one decode line each (HF runs the first)"
    )
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--dump-outputs", type=Path, default=None, help="JSON of each batch's greedy ids and log-probs")
    ap.add_argument("--triton-kernels", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tuned-attention-tiles", action="store_true", help="EngineConfig.tuned_attention_tiles")
    ap.add_argument("--fused-moe", action="store_true", help="EngineConfig.fused_moe (MoE shapes)")
    args = ap.parse_args()
    gpu = args.device.startswith("cuda")
    shape = args.shape or ("qwen3-0.6b" if gpu else "tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch or (64 if gpu else 8)]
    prompt_len = args.prompt_len or (256 if gpu else 32)
    new_tokens = args.new_tokens or (512 if gpu else 64)
    meta: dict[str, object] = {
        "device": args.device,
        "shape": shape,
        "dtype": str(dtype)[6:],
        "triton_kernels": args.triton_kernels,
        "cuda_graphs": args.cuda_graphs,
        "tuned_attention_tiles": args.tuned_attention_tiles,
        "fused_moe": args.fused_moe,
    }

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(shape, dtype, Path(tmp) / "model")
        cfg = EngineConfig(
            device=args.device,
            dtype=str(dtype)[6:],
            triton_kernels=args.triton_kernels,
            cuda_graphs=args.cuda_graphs,
            # only when asked: an engine from before the option (a baseline tree) still runs this bench
            **({"tuned_attention_tiles": True} if args.tuned_attention_tiles else {}),
            **({"fused_moe": True} if args.fused_moe else {}),
        )
        engine = Engine.from_pretrained(str(model_dir), cfg)
        vocab = engine.model.config.vocab_size
        bw = copy_bandwidth(args.device)
        lines = [bench_decode(engine, b, prompt_len, new_tokens, bw, meta) for b in batches]
        prefix = None if args.skip_prefix else bench_prefix(engine, vocab, args.prefix_len, args.device)
        engine.shutdown()
        del engine
        gc.collect()  # the KV cache and graph pools go before HF allocates (no effect on either timing)
        if gpu:
            torch.cuda.empty_cache()
        first = lines[0]
        prompts, warm = first["_prompts"], first["_warm"]
        if not args.skip_hf:
            t_hf = run_hf(model_dir, prompts, warm, new_tokens, args.device, dtype)  # type: ignore[arg-type]
            tokens = len(prompts) * new_tokens  # type: ignore[arg-type]
            first.update(hf_generate_tok_s=round(tokens / t_hf, 1), speedup_vs_hf=round(t_hf / first["engine_s"], 2))
            if bw is not None:
                first["hf_roofline_frac"] = round(tokens / t_hf / first["roofline_tok_s"], 4)  # type: ignore[operator]
        for line in lines:
            print(json.dumps({k: v for k, v in line.items() if not k.startswith("_")}), flush=True)
        if args.dump_outputs is not None:  # to compare two engines' outputs on the same prompts
            args.dump_outputs.write_text(json.dumps({str(line["batch"]): line["_outputs"] for line in lines}))
        if prefix is not None:
            print(json.dumps(prefix), flush=True)


if __name__ == "__main__":
    main()
