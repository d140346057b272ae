"""Megatron's optimizer CPU offload on one GPU (issue 26): one train step of a reduced Qwen3-MoE at real widths with
the optimizer states on the GPU and offloaded to the host, the GPU memory each peaked at
(`torch.cuda.max_memory_allocated`) against what the layout planner (`planner/layouts.rank_memory`) predicts for the
same model, layout, options and micro-batch, and how far the weights after the two steps differ.

Prints one JSON line per result:
- ``megatron_step`` per option set (``offload`` = `megatron.optimizer_offload_fraction`, precision-aware when > 0):
  step seconds (the second of two steps, the first warms up), the measured peak (above what was allocated before
  the trainer was built: `allocated_before_gb`, 0 unless an earlier trainer's memory was not freed) and the
  planner's prediction in GB (1e9 B) with their ratio, the planner's terms, and the host memory the planner gives
  the optimizer;
- ``offload_vs_gpu``: the largest absolute difference of any weight after the same two steps with and without
  offload (bf16 weights, fp32 optimizer both ways: the same Adam arithmetic on another device);
- ``peak_composition`` per option set, with ``--peak-report``: the allocations live at the peak (the allocator's
  recorded history replayed), summed by the innermost frame in this project or megatron that made each, largest
  first: where the bytes the planner does not predict come from.

    python benchmarks/bench_megatron_memory.py                 # one H200: ~1.9B parameters, 8 layers of 32 experts
    python benchmarks/bench_megatron_memory.py --layers 2 --experts 4 --hidden 256 --moe-inter 128 --seq 256
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles_hpc.config import AlgoConfig, MegatronConfig, TrainConfig
from miles_hpc.data.sample import token_hash
from miles_hpc.models import ModelConfig, build_model, save_pretrained
from miles_hpc.models.presets import preset_config
from miles_hpc.planner.layouts import GB, Batch, Layout, MemoryOptions, rank_memory
from miles_hpc.train.batch import TrainBatch


def _model(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cfg = preset_config("qwen3_moe", "tiny")
    heads = max(args.hidden // 128, 1)
    cfg.update(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_inter,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=min(8, args.experts),
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=128 if args.hidden >= 128 else args.hidden // heads,
        vocab_size=args.vocab,
    )
    torch.manual_seed(0)
    save_pretrained(build_model(ModelConfig.from_hf_dict(cfg)), out)
    return cfg


def _batch(seq: int, sequences: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, vocab, (seq,), generator=g).tolist() for _ in range(sequences)]
    return TrainBatch(
        tokens=toks,
        loss_mask=[[0] * 16 + [1] * (seq - 16) for _ in toks],
        rollout_logprobs=[(-torch.rand(seq, generator=g) * 4).tolist() for _ in toks],
        advantages=[[1.0 if i % 2 == 0 else -1.0] * seq for i in range(sequences)],
        token_hash=[token_hash(t) for t in toks],
    )


def _step(model_dir: Path, cfg: dict[str, Any], args: argparse.Namespace, offload: float) -> dict[str, Any]:
    from miles_hpc.train import megatron as mg

    train = TrainConfig(
        lr=1e-5, max_tokens_per_microbatch=args.seq, updates_per_step=1, grad_clip=1.0, mixed_precision=True
    )
    mcfg = MegatronConfig(optimizer_offload_fraction=offload, precision_aware_optimizer=offload > 0)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # what an earlier trainer left (0 unless one leaked)
    if args.peak_report:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    trainer = mg.MegatronTrainer(model_dir, train, AlgoConfig(), mcfg, device="cuda", seed=0)
    batch = _batch(args.seq, args.sequences, args.vocab)
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - before
    if args.peak_report:
        report = peak_composition(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        print(json.dumps({"result": "peak_composition", "offload": offload, **report}), flush=True)
    opts = MemoryOptions(offload_fraction=offload, precision_aware=offload > 0)
    plan = rank_memory(cfg, Layout(), opts, Batch(seq_len=args.seq, micro_batch=1))
    weights = {n: t.float().cpu() for n, t in trainer.state_for_sync()}
    del trainer
    gc.collect()
    row = {
        "result": "megatron_step",
        "offload": offload,
        "params": sum(t.numel() for t in weights.values()),
        "step_s": times[-1],
        "peak_gb": peak / GB,
        "planned_gb": plan.gpu / GB,
        "planned_over_peak": plan.gpu / peak,
        "planned_terms_gb": {
            "weights": plan.weights / GB,
            "grads": plan.grads / GB,
            "optimizer_gpu": plan.optimizer_gpu / GB,
            "activations": plan.activations / GB,
        },
        "planned_host_gb": plan.optimizer_host / GB,
        "allocated_before_gb": before / GB,
        "micro_batch_tokens": args.seq,
        "micro_batches": args.sequences,
    }
    print(json.dumps(row), flush=True)
    return weights


def _where(frames: list[dict[str, Any]]) -> str:
    for f in frames:  # innermost first
        name = f.get("filename", "")
        if "miles_hpc" in name or "megatron" in name:
            return f"{name.split('site-packages/')[-1].split('miles_hpc/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "elsewhere"


def peak_composition(snapshot: dict[str, Any], top: int = 20) -> dict[str, Any]:
    """Replay the recorded allocations and frees of device 0; at the largest live total, the live bytes by where
    they were allocated (`_where`), the `top` largest in GB."""
    events = snapshot["device_traces"][0]

    def replay(stop: int) -> tuple[dict[int, tuple[int, Any]], int, int]:
        live: dict[int, tuple[int, Any]] = {}
        total = best = best_at = 0
        for i, ev in enumerate(events[:stop]):
            if ev["action"] == "alloc":
                live[ev["addr"]] = (ev["size"], ev.get("frames", []))
                total += ev["size"]
                if total > best:
                    best, best_at = total, i + 1
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
        return live, best, best_at

    _, best, best_at = replay(len(events))  # where the live total peaked, then what was live there
    at_peak = {a: (size, _where(frames)) for a, (size, frames) in replay(best_at)[0].items()}
    sums: dict[str, int] = {}
    for size, where in at_peak.values():
        sums[where] = sums.get(where, 0) + size
    biggest = sorted(sums.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_traced_gb": best / GB, "by_site_gb": {k: round(v / GB, 4) for k, v in biggest}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (one sequence per micro-batch)")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--peak-report", action="store_true", help="also print what is live at each step's peak")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_megatron_memory: needs a CUDA GPU (megatron's optimizer and its offload are CUDA-only)")
        return 2
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
    from miles_hpc.train import dist as tdist

    tdist.init_trainer_world(tdist.world_from_env(device="cuda"))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _model(args, Path(tmp) / "model")
        on_gpu = _step(Path(tmp) / "model", cfg, args, 0.0)
        offloaded = _step(Path(tmp) / "model", cfg, args, 1.0)
    diff = max((on_gpu[n] - offloaded[n]).abs().max().item() for n in on_gpu)
    print(json.dumps({"result": "offload_vs_gpu", "max_abs_weight_diff": diff}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
