"""Checkpoint helpers of the megatron-core backend (stage: train; used by `MegatronTrainer.save/load` in
`train/megatron.py`): the model-config check, the optimizer state a load needs to exist first, torch AdamW's state
as dist_checkpointing tensors (the CPU path), and the distributed optimizer's fully reshardable load with Adam's
`step` handled (megatron-core 0.16-0.19 lose it on that path).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing

from miles_hpc.models import ModelConfig

__all__ = ["adamw_sharded_state", "check_same_model", "init_adam_state", "load_adamw", "load_distributed_optimizer"]


def check_same_model(root: Path, saved: dict[str, Any] | None, cfg: ModelConfig) -> None:
    """Refuse a checkpoint written for another model config (dist_checkpointing would catch another shape, not,
    say, another RoPE base), naming each differing field with both values."""
    ours = json.loads(json.dumps(cfg.to_hf_dict()))  # as saved: tuples become lists
    if saved is None:
        raise ValueError(
            f"{root}: megatron.json records no model config (an older checkpoint); this run's model is {ours}"
        )
    diff = [
        f"{k}={saved.get(k)!r} in the checkpoint, {ours.get(k)!r} in this run"
        for k in sorted(saved.keys() | ours.keys())
        if saved.get(k) != ours.get(k)
    ]
    if diff:
        raise ValueError(f"{root}: written for another model config: {'; '.join(diff)}")


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer the state a checkpoint is loaded into. torch's Adam creates its state (the moments and
    the per-parameter `step` megatron reads) only in a step, so take one with zero gradients at lr 0: it moves no
    weight (update and decoupled decay both scale with lr), and the load overwrites the state. megatron does the
    same before loading its FSDP layout (`DistributedOptimizer._init_optimizer_states_with_dummy_values`)."""
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.numel():
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def adamw_sharded_state(optimizer: torch.optim.Optimizer, model_sd: dict[str, Any]) -> dict[str, Any]:
    """The CPU path's AdamW state as megatron's non-distributed optimizer writes its own (`FP32Optimizer`): each
    moment a ShardedTensor named and sharded as its parameter (`optimizer.state.exp_avg.<name>`), the
    hyperparameters whole (parameter lists stay local), and Adam's step once (torch keeps one per parameter)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = dist_checkpointing.optimizer.get_param_id_to_sharded_param_map(model_sd, params)
    sd = optimizer.state_dict()
    steps = {float(s["step"]) for s in sd["state"].values()}
    if len(steps) > 1:
        raise RuntimeError(f"AdamW parameters at different steps {sorted(steps)}: the checkpoint keeps one")
    dist_checkpointing.optimizer.optim_state_to_sharding_state(sd, ids, exclude_keys=("step",))
    sd["step"] = steps.pop() if steps else 0.0
    return sd


def load_adamw(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    step = float(loaded.pop("step"))
    for s in loaded["state"].values():
        s["step"] = torch.tensor(step)  # one tensor per parameter: torch's Adam increments each in place
    optimizer.load_state_dict(loaded)


def load_distributed_optimizer(optimizer: Any, loaded: dict[str, Any]) -> None:
    """megatron's `DistributedOptimizer.load_state_dict` of its fully reshardable layout, around what fails there
    with torch's Adam (no Apex/TE; megatron-core 0.16 and 0.19): it puts the saved step into every parameter's state
    (as one shared tensor), then copies the saved tensors into each tensor of that state, and the saved tensors have
    no `step` (KeyError: 'step'). So: hyperparameters and step first, then the master weights and moments with the
    steps set aside, then each parameter's step back as its own tensor (torch's Adam increments each in place)."""
    kind = loaded.pop("param_state_sharding_type")
    if kind != "fully_reshardable":
        raise ValueError(
            f"megatron optimizer state in the {kind!r} layout; this trainer writes and reads 'fully_reshardable'"
        )
    param_state = loaded.pop("param_state")
    optimizer.load_state_dict(loaded)  # without param_state: hyperparameters, grad scaler, torch Adam's step
    state = optimizer.optimizer.state
    steps = {p: s.pop("step") for p, s in state.items() if "step" in s}
    optimizer.load_parameter_state_from_fully_reshardable(param_state)
    for p, step in steps.items():
        state[p]["step"] = step.clone()
