"""Trainer throughput and MFU of our FSDP2 and megatron-core backends versus a plain `transformers` training step,
same GPU, same run.

Prints one JSON line per side: tokens/s, model TFLOP/s and MFU = model FLOPs / time / peak. Model FLOPs per token
are the usual 6 x (matmul parameters, LM head included) plus causal attention 6 x layers x heads x head_dim x seq
(forward + backward); the peak is the dense bf16 datasheet figure (989 TFLOP/s on H100/H200 SXM, `--peak-tflops`).
With one update per step (the default) our `train_step` runs no extra forward for the PPO old log-probs. Ours runs
twice: eager, and with `train.compile=true` (decoder layers compiled, attention eager; compile time is in warm-up).
The megatron side is `MegatronTrainer` (TP 1, bf16 params, megatron's distributed optimizer, local layer spec
without Transformer Engine, its core attention replaced by SDPA over the packed sequences: train/mcore_attention.py),
one packed micro-batch per rank like ours; side `megatron-seq` runs it with one sequence per micro-batch (the
layout the mask-based attention needed before).

    python benchmarks/bench_train.py                 # ~1.1B Qwen3 shapes, seq 4096, batch 2, bf16, one GPU
    python benchmarks/bench_train.py --ranks 2 --sides eager,compiled    # FSDP2 over GPUs 0 and 1 (NCCL)
    python benchmarks/bench_train.py --device cpu --ranks 2 --shape small --seq 512 --sides eager   # gloo, CPU

`--ranks N` runs our sides as N data-parallel FSDP2 (or megatron DP) ranks, one process per GPU, each with its own
`--batch` sequences packed into one micro-batch, so every rank does the work of the one-rank run: tokens/s count
all ranks' tokens, MFU is per GPU (model FLOPs / time / (N x peak)). Compare a `--ranks 2` line with a
`--ranks 1` line of the same shape. On the CPU (`--device cpu`, fp32, no MFU: no peak is assumed) the ranks talk
gloo; run it with one torch thread per rank (`OMP_NUM_THREADS=1`) to compare like with like.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from collective_bw import spawn_ranks  # benchmarks/ (this script's directory) is on sys.path

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.data.sample import token_hash
from miles_hpc.models import ModelConfig, build_model, save_pretrained
from miles_hpc.train.batch import TrainBatch

SHAPE_1B = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    torch_dtype="bfloat16",
)


def model_flops_per_token(cfg: ModelConfig, seq: int) -> tuple[float, int]:
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size
    matmul_params = layers * per_layer + cfg.vocab_size * d  # LM head (tied or not, it is a matmul)
    attention = 6 * layers * q * seq  # causal: half of 12 * layers * q * seq
    return 6 * matmul_params + attention, matmul_params


def timed(fn, steps: int, warmup: int) -> list[float]:
    """Seconds of each of `steps` steps after `warmup` untimed ones (compilation happens in those)."""
    wait = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    for _ in range(warmup):
        fn()
    wait()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        wait()
        out.append(time.perf_counter() - t0)
    return out


def bench_ours(
    model_dir: Path,
    seqs: list[list[int]],
    steps: int,
    warmup: int,
    compile: bool = False,
    backend: str = "fsdp",
    device: str = "cuda",
) -> list[float]:
    """Step times of our trainer. Under `--ranks N` every rank runs this with the global batch (N x `--batch`
    sequences); the trainer gives each rank its share."""
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env

    if "WORLD_SIZE" not in os.environ:  # one rank in this process: a fresh store per side
        os.environ["MASTER_PORT"] = str(
            29533 + int(compile) + 2 * backend.startswith("megatron") + (backend == "megatron-seq")
        )
    info = world_from_env(device=device)
    init_trainer_world(info)
    # One packed micro-batch per rank (megatron too: its core attention is SDPA per sequence, no [heads, T, T]
    # scores), or for backend "megatron-seq" one sequence per micro-batch (the earlier layout).
    per_rank = len(seqs) // info.world_size
    tokens = len(seqs[0]) if backend == "megatron-seq" else sum(len(s) for s in seqs[:per_rank])
    cfg = TrainConfig(lr=1e-5, max_tokens_per_microbatch=tokens, mixed_precision=device == "cuda", compile=compile)
    if backend.startswith("megatron"):
        from miles_hpc.config import MegatronConfig
        from miles_hpc.train.megatron import MegatronTrainer

        mcfg = MegatronConfig(distributed_optimizer=device == "cuda")  # megatron's own optimizer is CUDA-only
        trainer = MegatronTrainer(str(model_dir), cfg, AlgoConfig(), mcfg, device=device, seed=0)
    else:
        from miles_hpc.train.fsdp import FSDPTrainer

        trainer = FSDPTrainer(str(model_dir), cfg, AlgoConfig(), device=device, seed=0)
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch(
        tokens=seqs,
        loss_mask=[[0] + [1] * (len(s) - 1) for s in seqs],
        rollout_logprobs=[[0.0] * len(s) for s in seqs],
        advantages=[[float(a)] * len(s) for a, s in zip(torch.randn(len(seqs), generator=g).tolist(), seqs)],
        token_hash=[token_hash(s) for s in seqs],
    )
    try:
        return timed(lambda: trainer.train_step(batch), steps, warmup)
    finally:
        teardown()
        if device == "cuda":
            torch.cuda.empty_cache()


def bench_hf(model_dir: Path, seqs: list[list[int]], steps: int, warmup: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.tensor(seqs, device="cuda")

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, steps, warmup)


SHAPES = {"1b": SHAPE_1B}  # and bench_weight_sync.py's sizes on the "small" preset (byte vocabulary)


def shape_config(name: str) -> dict[str, Any]:
    if name in SHAPES:
        return SHAPES[name]
    import sys

    from miles_hpc.models.presets import preset_config

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_weight_sync import SIZES

    return preset_config("qwen3", "small") | SIZES[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator warm-up)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--sides",
        default="eager,compiled,megatron,hf",
        help="comma-separated subset of eager,compiled,megatron,megatron-seq,hf",
    )
    ap.add_argument("--ranks", type=int, default=1, help="data-parallel trainer ranks (our sides; one per GPU)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--shape",
        choices=["1b", "small", "25m", "100m", "1.5b", "7b"],
        default="1b",
        help="1b: ~1.1B Qwen3 with its 151,936 vocabulary; others: bench_weight_sync.py's sizes",
    )
    args = ap.parse_args()
    gpu = args.device == "cuda"
    if gpu and torch.cuda.device_count() < args.ranks:
        ap.error(f"--ranks {args.ranks} needs {args.ranks} GPUs; this machine has {torch.cuda.device_count()}")
    hf = shape_config(args.shape) | {"torch_dtype": "bfloat16" if gpu else "float32"}
    cfg = ModelConfig.from_hf_dict(hf)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, cfg.vocab_size, (args.ranks * args.batch, args.seq), generator=g).tolist()
    tokens = args.ranks * args.batch * args.seq  # all ranks' tokens per step
    flops_tok, matmul_params = model_flops_per_token(cfg, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        save_pretrained(build_model(cfg, dtype=torch.bfloat16 if gpu else torch.float32), model_dir)
        runs = {
            "eager": ("miles_hpc_fsdp2", False, "fsdp"),
            "compiled": ("miles_hpc_fsdp2_compiled", True, "fsdp"),
            "megatron": ("miles_hpc_megatron_core", False, "megatron"),
            "megatron-seq": ("miles_hpc_megatron_core_one_seq_per_microbatch", False, "megatron-seq"),
            "hf": ("transformers_adamw_fused",),
        }
        for key in args.sides.split(","):
            name = runs[key][0]
            if key == "hf" and (args.skip_hf or args.ranks > 1 or not gpu):
                continue  # the peer is one plain GPU step
            if key.startswith("megatron") and importlib.util.find_spec("megatron.core") is None:
                print(json.dumps({"bench": "train", "side": name, "skipped": "megatron-core is not installed"}))
                continue
            if key == "hf":
                times = bench_hf(model_dir, seqs, args.steps, args.warmup)
            else:
                side = (model_dir, seqs, args.steps, args.warmup, runs[key][1], runs[key][2], args.device)
                times = spawn_ranks(args.ranks, bench_ours, *side) if args.ranks > 1 else bench_ours(*side)
            t = sum(times) / len(times)  # the mean step: MFU and tokens/s from it
            line = {
                "bench": "train",
                "side": name,
                "device": torch.cuda.get_device_name() if gpu else "cpu",
                "ranks": 1 if key == "hf" else args.ranks,
                "shape": args.shape,
                "params_matmul": matmul_params,
                "seq": args.seq,
                "batch_per_rank": args.batch,
                "warmup": args.warmup,
                "step_s": round(t, 4),
                "step_min_median_max_s": [
                    round(min(times), 4),
                    round(sorted(times)[len(times) // 2], 4),
                    round(max(times), 4),
                ],
                "tokens_per_s": round(tokens / t, 1),  # hf runs only at --ranks 1: the same tokens
                "model_tflops": round(flops_tok * tokens / t / 1e12, 1 if gpu else 4),
            }
            if gpu:
                line["mfu"] = round(line["model_tflops"] / (line["ranks"] * args.peak_tflops), 4)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
