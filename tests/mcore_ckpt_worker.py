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
megatron.recompute_granularity; MCORE_CP: megatron.context_parallel. DEVICE cuda: megatron's own optimizer (DISTRIBUTED_OPTIMIZER 1: the distributed one) instead of the CPU path's AdamW.
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

    from megatron.core import parallel_state
    from test_megatron import TRAIN_LENGTHS
    from test_train_fsdp import STEP_ALGO, STEP_CFG, make_batch

    from miles_hpc.config import MegatronConfig
    from miles_hpc.train import dist as tdist
    from miles_hpc.train import megatron as mg
    from miles_hpc.train.mcore_weights import Rule, iter_full_hf

    # a warm-up, so that the lr of the next step depends on the restored step
    CKPT_CFG = dataclasses.replace(STEP_CFG, mixed_precision=False, warmup_steps=8)
EXTRA = {"next_step": 1, "weight_version": 1, "prompts": {"epoch": 0, "position": 3}}


def hf_named(trainer: mg.MegatronTrainer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors shaped as this rank's megatron parameters (keyed by their names), gathered to full HF-named tensors
    as `full_hf_state` gathers the weights: TP shards from the TP group, each expert from its EP rank."""
    cfg = trainer.config
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()

    buffers = dict(trainer.model.module.named_buffers())  # GLM's router bias: no Adam state, zeros

    def gather(rule: Rule) -> list[torch.Tensor]:
        name = rule.mcore_name(cfg.num_experts, ep)
        mine = (tensors[name] if name in tensors else torch.zeros_like(buffers[name])).contiguous()
        if rule.expert is not None:
            n, group = ep, parallel_state.get_expert_model_parallel_group()
        else:
            n, group = tp, parallel_state.get_tensor_model_parallel_group()
        parts = [mine]
        if n > 1:
            parts = [torch.empty_like(mine) for _ in range(n)]
            torch.distributed.all_gather(parts, mine, group=group)
        return [parts[rule.owner(cfg.num_experts, ep)]] if rule.expert is not None else parts

    return {name: t.clone() for name, t in iter_full_hf(cfg, gather)}


def snapshot(trainer: mg.MegatronTrainer) -> dict[str, Any]:
    """What a checkpoint must carry, as every layout can compare it: HF-named weights and moments (the CPU path's
    AdamW, whose state is keyed by the parameters), Adam's steps, our step and lr."""
    moments = None
    if isinstance(trainer.optimizer, torch.optim.Optimizer):
        params = dict(trainer.model.module.named_parameters())
        moments = {
            # frozen parameters (DSA indexers, MTP layers) have no Adam state: zeros in their place
            key: hf_named(
                trainer,
                {
                    n: trainer.optimizer.state[p][key] if p.requires_grad else torch.zeros_like(p)
                    for n, p in params.items()
                },
            )
            for key in ("exp_avg", "exp_avg_sq")
        }
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
    mcfg = MegatronConfig(
        tensor_parallel=int(tp),
        expert_parallel=int(ep),
        distributed_optimizer=distributed_optimizer == "1",
        recompute_granularity=recompute or "full",
        context_parallel=int(os.environ.get("MCORE_CP", "1")),
    )
    train_cfg = dataclasses.replace(CKPT_CFG, activation_checkpointing=bool(recompute))
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
