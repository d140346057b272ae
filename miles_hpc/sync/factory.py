"""Build the weight-sync strategy a run's config asks for (stage: sync).

`build_sync(cfg, run_dir, master_address)` maps `sync.strategy` to its module; strategies that a single-machine
`miles-hpc run` cannot drive yet raise a `ConfigError` naming the key, before any process starts
(`check_strategy`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from miles_hpc.config import ConfigError, RunConfig
from miles_hpc.sync.broadcast import BroadcastSpec, BroadcastSync
from miles_hpc.sync.colocated import ColocatedSpec, ColocatedSync
from miles_hpc.sync.delta import DeltaSpec, DeltaSync
from miles_hpc.sync.protocol import WeightSync

__all__ = ["RUNNABLE", "build_sync", "check_strategy"]

RUNNABLE = ("broadcast", "delta", "colocated")


def check_strategy(cfg: RunConfig) -> None:
    if cfg.sync.strategy not in RUNNABLE:
        raise ConfigError(f"sync.strategy: {cfg.sync.strategy!r} is not available in `miles-hpc run` yet; "
                          f"use one of {', '.join(RUNNABLE)}")  # fmt: skip


def build_sync(
    cfg: RunConfig, run_dir: Path, master_address: str, next_port: Callable[[], int], backend: str = "gloo"
) -> WeightSync:
    """`next_port`: a free TCP port on `master_address` (broadcast groups); `backend`: gloo (CPU) or nccl."""
    check_strategy(cfg)
    s = cfg.sync
    if s.strategy == "delta":
        rollout_dtype = getattr(torch, cfg.model.dtype)
        return DeltaSync(DeltaSpec(run_dir=run_dir, rollout_dtype=rollout_dtype, timeout_s=s.timeout_s))
    if s.strategy == "colocated":  # the engines of a local run share the trainer's host
        rollout_dtype = getattr(torch, cfg.model.dtype)
        return ColocatedSync(ColocatedSpec(bucket_bytes=s.bucket_bytes, rollout_dtype=rollout_dtype,
                                           timeout_s=s.timeout_s))  # fmt: skip
    return BroadcastSync(BroadcastSpec(master_address=master_address, next_port=next_port, backend=backend,
                                       bucket_bytes=s.bucket_bytes, timeout_s=s.timeout_s))  # fmt: skip
