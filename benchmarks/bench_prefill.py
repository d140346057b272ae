"""Prefill speed of the embedded engine against the matmul roofline, and the prefix cache's gain, at long prompts.

Prints one JSON line per result:
- ``prefill``: one fresh prompt of `L` tokens (max_new_tokens=1, nothing cached; median of `--reps` prompts) for
  each `L` of `--lens`: tokens/s, and the fraction of the matmul roofline: the forward's FLOPs (2 x the
  parameters each token multiplies, the LM head on the one row that samples, and causal attention's
  Q.K and P.V) over the dense matmul rate measured in the same run (`--peak-n` cubed GEMMs in the model's dtype).
- ``prefix_cache``: at each `L`, a request whose first `L` tokens an earlier request left in the cache plus 16 new
  tokens, against a fresh prompt of the same length (`bench_rollout.bench_prefix`).

    python benchmarks/bench_prefill.py                    # CPU: the tiny preset, short prompts
    python benchmarks/bench_prefill.py --device cuda      # Qwen3-0.6B shapes, bf16, 2k-16k-token prompts
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_rollout import bench_prefix, make_checkpoint, run_engine, sync

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.models import ModelConfig


def matmul_rate(device: str, dtype: torch.dtype, n: int, reps: int = 10) -> float:
    """FLOP/s of an `n` x `n` x `n` matmul in `dtype` (after warm-up), the practical compute limit."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def prefill_flops(c: ModelConfig, n_params: int, embed_params: int, lm_head_params: int, tokens: int) -> float:
    """FLOPs of one prompt's forward: each token through every matrix but the embedding and the LM head, the LM head
    on the one sampling row, and causal attention (Q.K and P.V over tokens * (tokens + 1) / 2 pairs per head)."""
    body = n_params - embed_params - (0 if c.tie_word_embeddings else lm_head_params)
    pairs = tokens * (tokens + 1) / 2
    attn = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs
    return 2 * body * tokens + 2 * lm_head_params + attn


def bench_prefill(engine: Engine, length: int, reps: int, rate: float | None, meta: dict[str, object]) -> dict:
    """One `prefill` line: the median over `reps` fresh `length`-token prompts (after one warm-up prompt)."""
    model = engine.model
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(length)
    rand = lambda: torch.randint(0, vocab, (length,), generator=g).tolist()  # noqa: E731
    run_engine(engine, [rand()], 1)  # warm-up: kernels for these shapes, allocator growth
    times = []
    for _ in range(reps):
        t, (res,) = run_engine(engine, [rand()], 1)
        assert res.cached_tokens == 0 and res.prompt_tokens == length
        times.append(t)
    t = statistics.median(times)
    n_params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    head = model.lm_head.weight.numel()
    flops = prefill_flops(model.config, n_params, embed, head, length)
    line: dict[str, object] = {
        "bench": "prefill",
        "result": "prefill",
        **meta,
        "prompt_tokens": length,
        "reps": reps,
        "prefill_s": round(t, 5),
        "prefill_all_s": [round(x, 5) for x in times],
        "tok_s": round(length / t, 1),
        "tflops": round(flops / t / 1e12, 2),
    }
    if rate is not None:
        line.update(
            matmul_tflops=round(rate / 1e12, 1),
            roofline_s=round(flops / rate, 5),
            roofline_frac=round(flops / rate / t, 4),
        )
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, help="qwen3-0.6b or a preset size (tiny, small)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--lens", default=None, help="comma-separated prompt lengths (GPU: 2048,4096,8192,16384)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peak-n", type=int, default=None, help="side of the reference GEMM (GPU 8192, CPU 1024)")
    ap.add_argument("--skip-prefix", action="store_true")
    args = ap.parse_args()
    gpu = args.device.startswith("cuda")
    shape = args.shape or ("qwen3-0.6b" if gpu else "tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    lens = [int(x) for x in (args.lens or ("2048,4096,8192,16384" if gpu else "256,512")).split(",")]
    meta: dict[str, object] = {"device": args.device, "shape": shape, "dtype": str(dtype)[6:]}
    rate = matmul_rate(args.device, dtype, args.peak_n or (8192 if gpu else 1024))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(shape, dtype, Path(tmp) / "model")
        cfg = EngineConfig(device=args.device, dtype=str(dtype)[6:], max_context_len=max(lens) + 64)
        engine = Engine.from_pretrained(str(model_dir), cfg)
        meta["max_prefill_tokens"] = cfg.max_prefill_tokens
        for length in lens:
            print(json.dumps(bench_prefill(engine, length, args.reps, rate, meta)), flush=True)
            if not args.skip_prefix:
                vocab = engine.model.config.vocab_size
                print(json.dumps(bench_prefix(engine, vocab, length, args.device, reps=args.reps)), flush=True)
        engine.shutdown()


if __name__ == "__main__":
    main()
