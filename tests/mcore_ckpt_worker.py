"""One rank of a megatron checkpoint run on the CPU (gloo), started by tests/test_megatron_ckpt.py under
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT:

    python mcore_ckpt_worker.py save MODEL_DIR TP EP CKPT OUT_FILE [DEVICE DISTRIBUTED_OPTIMIZER]
        MegatronTrainer: a train step (two optimizer steps), `save(CKPT)`, then the next train step without a
        restore: the run that never stopped.
    python mcore_ckpt_worker.py resume MODEL_DIR TP EP CKPT OUT_FILE
        A fresh MegatronTrainer in this layout: `load(CKPT)`, then the same next train step.
    python mcore_ckpt_worker.py refuse MODEL_DIR TP EP CKPT OUT_FILE
        `load(CKPT)` into a trainer of MODEL_DIR, which must raise ValueError: its message.

MCORE_RECOMPUTE=full or selective in the environment: train.activation_checkpointing with that
megatron.recompute_granularity; MCORE_CP: megatron.context_parallel; MCORE_PP, MCORE_VPP: megatron.pipeline_parallel and
virtual_pipeline; MCORE_OFFLOAD: megatron.optimizer_offload_fraction (precision-aware when > 0); MCORE_MIXED=1: train.mixed_precision (bf16).
DEVICE cuda: megatron's own optimizer (DISTRIBUTED_OPTIMIZER 1: the distributed one) instead of the CPU path's AdamW.
Rank 0 saves what it got to OUT_FILE: weights and (CPU) Adam moments under HF names (gathered over TP and EP), Adam's
and our step, lr, four draws of torch's RNG, the loop's state and the next step's metrics and weights.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch

if __name__ == "__main__":
    # Only here, not where this file is imported as `__mp_main__`: megatron's checkpoint writer starts a spawned
    # helper (a multiprocessing Manager), which re-imports this file and needs none of it. On a GPU machine whose
    # Python writes no bytecode (PYTHONDONTWRITEBYTECODE) importing megatron-core from source took ~20 s per
    # process there, and the GPU resume test imported it three times (save, its helper, resume).
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import megatron_cpu_shims

    megatron_cpu_shims()

    from test_megatron import TRAIN_LENGTHS
    from test_train_fsdp import STEP_ALGO, STEP_CFG, make_batch

    from miles_hpc.config import MegatronConfig
    from miles_hpc.train import dist as tdist
    from miles_hpc.train import megatron as mg

    # a warm-up, so that the lr of the next step depends on the restored step
    CKPT_CFG = dataclasses.replace(STEP_CFG, mixed_precision=False, warmup_steps=8)
EXTRA = {"next_step": 1, "weight_version": 1, "prompts": {"epoch": 0, "position": 3}}


def hf_moments(trainer: mg.MegatronTrainer, key: str) -> dict[str, torch.Tensor]:
    """The CPU path's AdamW moment `key` as full HF-named tensors, gathered over TP, EP and pipeline stages by the
    trainer's own `state_for_sync`: each parameter's data is the moment while it runs (frozen parameters, DSA
    indexers and MTP layers, have no Adam state: zeros; GLM's router bias, a buffer, stays itself)."""
    params = [p for _, p in trainer._named_parameters()]
    held = [p.data for p in params]
    try:
        for p in params:
            p.data = trainer.optimizer.state[p][key] if p.requires_grad else torch.zeros_like(p)
        return {k: v.clone() for k, v in trainer.state_for_sync()}
    finally:
        for p, data in zip(params, held):
            p.data = data


def snapshot(trainer: mg.MegatronTrainer) -> dict[str, Any]:
    """What a checkpoint must carry, as every layout can compare it: HF-named weights and moments (the CPU path's
    AdamW, whose state is keyed by the parameters), Adam's steps, our step and lr."""
    moments = None
    if isinstance(trainer.optimizer, torch.optim.Optimizer):
        moments = {key: hf_moments(trainer, key) for key in ("exp_avg", "exp_avg_sq")}
    steps = {float(s["step"]) for opt in trainer._inner_optimizers() for s in opt.state.values() if "step" in s}
    weights = {k: v.clone() for k, v in trainer.state_for_sync()}  # (at TP 1 some are views of the parameters)
    return {"weights": weights, "moments": moments, "step": trainer.step, "lr": trainer.lr, "adam_steps": steps}


def next_step(trainer: mg.MegatronTrainer) -> dict[str, Any]:
    metrics = trainer.train_step(make_batch(TRAIN_LENGTHS, seed=1))
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in trainer.state_for_sync()}}


def main(
    mode: str,
    model_dir: str,
    tp: str,
    ep: str,
    ckpt: str,
    out: str,
    device: str = "cpu",
    distributed_optimizer: str = "0",
) -> None:
    torch.set_num_threads(1)
    world = tdist.world_from_env(device=device)
    tdist.init_trainer_world(world)
    recompute = os.environ.get("MCORE_RECOMPUTE", "")  # full / selective: train.activation_checkpointing
    offload = float(os.environ.get("MCORE_OFFLOAD", "0"))
    mcfg = MegatronConfig(
        tensor_parallel=int(tp),
        expert_parallel=int(ep),
        distributed_optimizer=distributed_optimizer == "1",
        recompute_granularity=recompute or "full",
        context_parallel=int(os.environ.get("MCORE_CP", "1")),
        pipeline_parallel=int(os.environ.get("MCORE_PP", "1")),
        virtual_pipeline=int(os.environ.get("MCORE_VPP", "1")),
        optimizer_offload_fraction=offload,
        precision_aware_optimizer=offload > 0,
    )
    mixed = os.environ.get("MCORE_MIXED", "0") == "1"  # train.mixed_precision (bf16): the flagship's
    train_cfg = dataclasses.replace(CKPT_CFG, activation_checkpointing=bool(recompute), mixed_precision=mixed)
    trainer = mg.MegatronTrainer(model_dir, train_cfg, STEP_ALGO, mcfg, device=world.device, seed=0)
    if mode == "save":
        trainer.train_step(make_batch(TRAIN_LENGTHS))
        trainer.save(ckpt, EXTRA)
        result = {"at_save": snapshot(trainer), "rng": torch.rand(4), "extra": EXTRA, "next": next_step(trainer)}
    elif mode == "resume":
        extra = trainer.load(ckpt)
        result = {"at_save": snapshot(trainer), "rng": torch.rand(4), "extra": extra, "next": next_step(trainer)}
    else:
        try:
            trainer.load(ckpt)
            result = {"error": None}
        except ValueError as e:
            result = {"error": str(e)}
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)
    tdist.teardown()


if __name__ == "__main__":  # a guard megatron's checkpoint writer needs: it starts a (spawned) helper process
    main(*sys.argv[1:])
    tdist.leave(0)
