"""Optimizer and learning-rate schedule of the trainer (stage: train).

- AdamW over two parameter groups: weight decay on matrices (linear and embedding weights), none on norms and
  biases (1-D parameters), as is standard for transformers.
- LR schedule: linear warm-up over `warmup_steps` optimizer steps (the first step already uses lr / warmup), then
  constant, or cosine from `lr` to `min_lr_ratio * lr` over `total_steps` (the last step reaches the floor).
  Expressed as a `LambdaLR`, so its state is one integer and checkpoints restore it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from miles_hpc.config import TrainConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_lambda", "no_decay"]


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights and biases take no weight decay."""
    return param.dim() < 2 or name.endswith(".bias") or "norm" in name


def build_optimizer(
    cfg: TrainConfig, named_params: Iterable[tuple[str, nn.Parameter]], device: torch.device | None = None
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; on a CUDA `device` the fused (single-kernel) implementation, elsewhere
    the plain loop (DTensor params of FSDP2 on gloo take it reliably; the cost is negligible at CPU sizes)."""
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (plain if no_decay(name, p) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    cuda = device is not None and device.type == "cuda"
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=cfg.adam_betas,
        eps=cfg.adam_eps,
        foreach=False if not cuda else None,
        fused=True if cuda else None,
    )


def lr_lambda(cfg: TrainConfig, total_steps: int | None) -> Callable[[int], float]:
    """Multiplier of `cfg.lr` at optimizer step `s` (0-based: the lr the (s+1)-th step uses)."""
    warmup = cfg.warmup_steps
    if cfg.lr_schedule == "cosine" and (total_steps is None or total_steps < 1):
        raise ValueError("train.lr_schedule=cosine needs the total number of optimizer steps (total_steps)")

    def f(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        assert total_steps is not None
        span = max(1, total_steps - warmup - 1)
        progress = min(1.0, (s - warmup) / span)
        floor = cfg.min_lr_ratio
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
