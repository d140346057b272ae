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

__all__ = [
    "adamw_sharded_state",
    "check_same_model",
    "fix_group_order",
    "init_adam_state",
    "load_adamw",
    "load_distributed_optimizer",
]


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


def fix_group_order(optimizer: Any) -> Any:
    """megatron-core 0.16's distributed optimizer gives each of its parameter groups the order [float32 parameters,
    fp32 copies of the 16-bit ones] (`_build_model_and_main_param_groups`), but records each model parameter's place
    as its index in the group's mixed list (`_build_optimizer_group_ranges`); its checkpoint save and load index
    the group with that place. In a group holding both kinds (a bf16 model with float32 norms or router weights)
    they name the wrong parameter: the save fails on a size mismatch, or copies the wrong states. Here the places
    are recomputed in the group's real order, for every distributed sub-optimizer of `optimizer`; a group of one
    kind keeps its places (the same numbers). Returns `optimizer`."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(sub, "model_param_group_index_map") or not hasattr(sub, "opt_group_ranges"):
            continue  # not megatron's distributed optimizer
        for group_index, group_range in enumerate(sub.opt_group_ranges):
            params = group_range["params"]
            fp32 = [p for p in params if p.dtype not in (torch.float16, torch.bfloat16)]
            half = [p for p in params if p.dtype in (torch.float16, torch.bfloat16)]
            for order, p in enumerate([*fp32, *half]):
                sub.model_param_group_index_map[p] = (group_index, order)
    return optimizer
