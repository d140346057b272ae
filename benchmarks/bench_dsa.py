"""GLM-5 at real widths on one GPU: the embedded engine's decode with DeepSeek sparse attention against the same
shape with dense MLA (DeepSeek-V3 attention, no indexer), the bytes each cached token costs against the expanded
per-head K/V, and one FSDP training step.

The reduced shape keeps GLM-5's widths (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, nope 192 / rope 64 /
v 256, indexer 32 x 128, index_topk 2048, vocabulary 154,880) and cuts the depth to `--layers` (the first dense,
then MoE with `--experts` routed experts of GLM-5's width, 8 per token; full / shared indexer layers alternate as
in GLM-5.2) so it fits one GPU. Random weights: throughput depends on the shape, not the values.

Prints one JSON line per result:
- ``decode`` per attention kind (``dsa``, ``dense_mla``): engine tokens/s for `--batch` prompts of `--prompt-len`
  tokens (past index_topk, so the sparsity matters) decoding `--new-tokens` greedy tokens; the cache's bytes per
  token (its tensors' bytes over its token capacity, measured) and the expanded form's
  (layers x heads x (qk_head_dim + v_head_dim) x dtype bytes, computed);
- ``train_step``: wall time of FSDPTrainer.train_step (one rank, bf16 mixed precision) on `--train-batch`
  sequences of `--train-seq` tokens, median of `--steps` after one warm-up step, and its loss; with
  `--indexer-loss C` the step also trains the indexers (train.indexer_loss_coef = C) and reports their KL.

    python benchmarks/bench_dsa.py                       # one H200: 4 layers, batch 8, prompt 4096
    python benchmarks/bench_dsa.py --toy --layers 2 --experts 8 --batch 2 --prompt-len 96 --new-tokens 8 \
        --train-seq 96 --steps 1                        # the CPU at toy widths (fp32): the script's own check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_rollout import run_engine  # benchmarks/ (this script's directory) is on sys.path

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.data.sample import token_hash
from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.models import ModelConfig, build_model, save_pretrained
from miles_hpc.train.batch import TrainBatch

# --toy: model widths divided by 32, head widths by 8, attention heads by 16, index_topk by 64, 16 indexer heads (few
# heads make tied indexer scores: docs/models.md); fp32 on the CPU.
_TOY = dict(
    vocab_size=320,
    hidden_size=192,
    intermediate_size=384,
    moe_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=16,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=32,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=32,
    torch_dtype="float32",
)


def glm5_reduced(layers: int, experts: int, dense_mla: bool, toy: bool = False) -> dict[str, Any]:
    """GLM-5's config.json at its widths with `layers` layers and `experts` routed experts; `dense_mla`: the same
    shape as DeepSeek-V3 attention (no indexer: every query attends to every earlier token)."""
    cfg: dict[str, Any] = dict(
        architectures=["GlmMoeDsaForCausalLM"],
        model_type="glm_moe_dsa",
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_types=["full" if i % 2 == 0 else "shared" for i in range(layers)],
        rms_norm_eps=1e-5,
        rope_theta=8000000.0,
        max_position_embeddings=202752,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    if toy:
        cfg.update(_TOY)
    if dense_mla:
        for key in ("index_n_heads", "index_head_dim", "index_topk", "indexer_types"):
            del cfg[key]
        cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], rope_interleave=True)
    return cfg


def cache_bytes_per_token(engine: Engine) -> float:
    """Bytes of every tensor the engine's cache holds, over its token capacity (measured from the tensors)."""
    cache = engine.cache
    tensors = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
    tensors += [
        t for v in vars(cache).values() if isinstance(v, list | tuple) for t in v if isinstance(t, torch.Tensor)
    ]
    routing = getattr(cache, "routing", None)
    total = sum(t.numel() * t.element_size() for t in tensors if t is not routing)  # R3 rows are not attention
    return total / (cache.num_blocks * cache.block_size)


def bench_decode(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    hf = glm5_reduced(args.layers, args.experts, dense_mla=kind == "dense_mla", toy=args.toy)
    mc = ModelConfig.from_hf_dict(hf)
    torch.manual_seed(0)
    model = build_model(mc, dtype=args.dtype, device=args.device)
    dtype = str(args.dtype).removeprefix("torch.")
    context = args.prompt_len + args.new_tokens + 8
    # The cache sized for this workload (4 blocks of slack per sequence), not most of the GPU: both engines are
    # compared at the same capacity, and the DSA prefill's float32 scores (256 queries x 32 heads x S at a time)
    # get room.
    blocks = args.batch * (-(-context // 16) + 4)
    cfg = EngineConfig(device=args.device, dtype=dtype, max_context_len=context, block_size=16, num_blocks=blocks)
    engine = Engine(model, cfg)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, mc.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    run_engine(engine, torch.randint(0, mc.vocab_size, (args.batch, 64), generator=g).tolist(), 4)  # warm-up
    t_prefill, _ = run_engine(engine, prompts, 1)
    prompts = torch.randint(0, mc.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    t_all, results = run_engine(engine, prompts, args.new_tokens)
    assert all(r.completion_tokens == args.new_tokens for r in results)
    decode_s = max(t_all - t_prefill, 1e-9)  # the same prefill (another prompt of the same shape) taken out
    size = args.dtype.itemsize
    expanded = mc.num_hidden_layers * mc.num_attention_heads * (mc.qk_head_dim + mc.v_head_dim) * size
    line = {
        "bench": "dsa",
        "result": "decode",
        "attention": kind,
        "layers": args.layers,
        "experts": args.experts,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "engine_s": round(t_all, 3),
        "prefill_s": round(t_prefill, 3),
        "decode_tok_s": round(args.batch * (args.new_tokens - 1) / decode_s, 1),
        "cache_bytes_per_token": round(cache_bytes_per_token(engine), 1),
        "expanded_bytes_per_token": expanded,
    }
    del engine, model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return line


def bench_train(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env
    from miles_hpc.train.fsdp import FSDPTrainer

    hf = glm5_reduced(args.layers, args.experts, dense_mla=False, toy=args.toy)
    t_setup = time.perf_counter()
    torch.manual_seed(0)
    # Random init on the device (on the host, billions of parameters take minutes), written as a checkpoint.
    model = build_model(ModelConfig.from_hf_dict(hf), dtype=args.dtype, device=args.device)
    save_pretrained(model, tmp / "model")
    del model
    os.environ.setdefault("MASTER_PORT", "29561")
    gpu = args.device == "cuda"
    init_trainer_world(world_from_env(device=args.device))
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, hf["vocab_size"], (args.train_batch, args.train_seq), generator=g).tolist()
    batch = TrainBatch(
        tokens=seqs,
        loss_mask=[[0] + [1] * (len(s) - 1) for s in seqs],
        rollout_logprobs=[[0.0] * len(s) for s in seqs],
        advantages=[[1.0 if i % 2 else -1.0] * len(s) for i, s in enumerate(seqs)],
        token_hash=[token_hash(s) for s in seqs],
    )
    cfg = TrainConfig(
        lr=1e-6, max_tokens_per_microbatch=args.train_seq, mixed_precision=gpu, indexer_loss_coef=args.indexer_loss
    )
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    try:
        trainer = FSDPTrainer(str(tmp / "model"), cfg, AlgoConfig(), device=args.device, seed=0)
        setup_s = time.perf_counter() - t_setup
        times, metrics = [], {}
        for i in range(args.steps + 1):
            sync()
            t0 = time.perf_counter()
            metrics = trainer.train_step(batch)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        return {
            "bench": "dsa",
            "result": "train_step",
            "layers": args.layers,
            "experts": args.experts,
            "sequences": args.train_batch,
            "seq_len": args.train_seq,
            "setup_s": round(setup_s, 1),
            "indexer_loss_coef": args.indexer_loss,
            "step_s": round(statistics.median(times), 3),
            "loss": metrics["loss"],
            "indexer_kl": metrics.get("dsa/indexer_kl"),
            "grad_norm": metrics["grad_norm"],
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if gpu else None,
        }
    finally:
        teardown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=2)
    ap.add_argument("--train-seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", choices=["decode", "train"], default=None)
    ap.add_argument("--indexer-loss", type=float, default=0.0, help="train.indexer_loss_coef of the train step")
    ap.add_argument("--toy", action="store_true", help="toy widths, fp32, on the CPU (checks the script)")
    args = ap.parse_args()
    args.device = "cpu" if args.toy else "cuda"
    args.dtype = torch.float32 if args.toy else torch.bfloat16
    if not args.toy and not torch.cuda.is_available():
        ap.error("needs a CUDA/ROCm GPU (or --toy)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.only != "train":
            for kind in ("dsa", "dense_mla"):
                print(json.dumps(bench_decode(kind, args, Path(tmp))), flush=True)
        if args.only != "decode":
            print(json.dumps(bench_train(args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
