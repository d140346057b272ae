"""Build the weight-sync strategy a run's config asks for (stage: sync).

`strategy_class(cfg)` is the class `build_sync` will build (its traits: what it sends, what its engines need at
launch, which placement it requires; strategies/base.py), so the launch layer asks it before any process starts
and never names a strategy. `build_sync(cfg, run_dir, master_address, ...)` builds it; strategies that a
single-machine `miles-hpc run` cannot drive raise a `ConfigError` naming the key (`check_strategy`).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from miles_hpc.config import ConfigError, RunConfig
from miles_hpc.models.lora import LoraSpec
from miles_hpc.sync.protocol import WeightSync
from miles_hpc.sync.strategies.base import GroupSyncSpec, Strategy
from miles_hpc.sync.strategies.broadcast import BroadcastSync
from miles_hpc.sync.strategies.colocated import ColocatedSpec, ColocatedSync
from miles_hpc.sync.strategies.delta import DeltaSpec, DeltaSync
from miles_hpc.sync.strategies.lora import LoraSync, LoraSyncSpec
from miles_hpc.sync.strategies.p2p import P2PSync, ShardSource
from miles_hpc.sync.wire.pg import Backend

__all__ = ["RUNNABLE", "build_sync", "check_strategy", "master_address_for", "strategy_class"]

log = logging.getLogger(__name__)

STRATEGIES: dict[str, type[Strategy]] = {
    c.name: c for c in (BroadcastSync, P2PSync, DeltaSync, ColocatedSync, LoraSync)
}
RUNNABLE = tuple(STRATEGIES)


def strategy_class(cfg: RunConfig) -> type[Strategy]:
    """The strategy `build_sync` builds for ``cfg`` (p2p against SGLang engines falls back to broadcast)."""
    if cfg.sync.strategy not in STRATEGIES:
        raise ConfigError(f"sync.strategy: {cfg.sync.strategy!r} is not built; use one of {', '.join(RUNNABLE)}")
    if cfg.sync.strategy == "p2p" and cfg.rollout.backend == "sglang":
        return BroadcastSync  # SGLang has no per-rank receive endpoint (docs/weight_sync.md)
    return STRATEGIES[cfg.sync.strategy]


def check_strategy(cfg: RunConfig) -> None:
    """What `miles-hpc run` (local subprocesses) can drive; raises a ConfigError naming the key."""
    if cfg.sync.strategy not in RUNNABLE:
        raise ConfigError(
            f"sync.strategy: {cfg.sync.strategy!r} is not available in `miles-hpc run` yet; "
            f"use one of {', '.join(RUNNABLE)}"
        )
    if cfg.sync.transport == "mpi":
        raise ConfigError(
            "sync.transport: mpi needs every trainer and engine process started by an MPI launcher "
            "that lets separate jobs connect (mpirun with a shared ompi-server, srun with PMIx); "
            "`miles-hpc run` starts plain local subprocesses: use transport torch here "
            "(docs/weight_sync.md, MPI transport)"
        )


def master_address_for(urls: Sequence[str], configured: str | None = None) -> str:
    """Where engines at `urls` join trainer rank 0's weight-update groups: `configured` (sync.master_address), else
    loopback when every engine is on this host, else the local address this host reaches the first remote engine
    from (a UDP "connect" picks the route; nothing is sent). Rank 0's store listens on that address only."""
    if configured:
        return configured
    hosts = [urllib.parse.urlsplit(u).hostname or "" for u in urls]
    remote = [h for h in hosts if not _loopback(h)]
    if not remote:
        return "127.0.0.1"
    try:
        info = socket.getaddrinfo(remote[0], 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return str(s.getsockname()[0])
    except OSError:  # no route from here (yet): this host's name, which the cluster resolves
        return socket.getfqdn()


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_sync(
    cfg: RunConfig,
    run_dir: Path,
    master_address: str,
    next_port: Callable[[], int],
    backend: Backend = "gloo",
    trainer: ShardSource | None = None,
) -> WeightSync:
    """`next_port`: a free TCP port on `master_address` (process groups); `backend`: gloo (CPU) or nccl;
    `trainer`: the controller's handle on every trainer rank (p2p sends from each of them)."""
    check_strategy(cfg)
    cls = strategy_class(cfg)
    s = cfg.sync
    gpu_aware = {"auto": None, "on": True, "off": False}[s.mpi_gpu_aware]
    if s.transport == "mpi":
        backend = "mpi"
        master_address = str(run_dir / "rendezvous" / "mpi")  # the port files of MPI's connect/accept
        Path(master_address).mkdir(parents=True, exist_ok=True)
    if cls is not STRATEGIES[s.strategy]:
        log.warning(
            "sync.strategy %s: SGLang engines receive weights by broadcast only; using %s",
            s.strategy,
            cls.name,
        )
    if cls is P2PSync:
        if trainer is None:
            raise ValueError("sync.strategy p2p needs the trainer ranks' handle (build_sync(..., trainer=...))")
        return P2PSync(
            GroupSyncSpec(
                master_address=master_address,
                next_port=next_port,
                backend=backend,
                bucket_bytes=s.bucket_bytes,
                rollout_dtype=getattr(torch, cfg.model.dtype),
                timeout_s=s.timeout_s,
                mpi_gpu_aware=gpu_aware,
            ),
            trainer,
        )
    if cls is DeltaSync:
        rollout_dtype = getattr(torch, cfg.model.dtype)
        return DeltaSync(
            DeltaSpec(
                run_dir=run_dir,
                rollout_dtype=rollout_dtype,
                timeout_s=s.timeout_s,
                group_bytes=min(s.bucket_bytes, 1 << 30),
                device="cpu" if s.delta_device == "cpu" else None,
            )
        )
    if cls is LoraSync:  # adapters only, as PEFT files the engines load (SGLang's /load_lora_adapter)
        lora = cfg.lora
        spec = LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)
        return LoraSync(
            LoraSyncSpec(
                run_dir=run_dir,
                spec=spec,
                rollout_dtype=getattr(torch, cfg.model.dtype),
                base_model=cfg.model.path or "",
                timeout_s=s.timeout_s,
                verify_bits=cfg.rollout.backend != "sglang",
                check_base=cfg.rollout.backend != "sglang",
            )
        )
    if cls is ColocatedSync:  # the engines of a local run share the trainer's host
        rollout_dtype = getattr(torch, cfg.model.dtype)
        return ColocatedSync(
            ColocatedSpec(bucket_bytes=s.bucket_bytes, rollout_dtype=rollout_dtype, timeout_s=s.timeout_s)
        )
    return BroadcastSync(
        GroupSyncSpec(
            master_address=master_address,
            next_port=next_port,
            backend=backend,
            bucket_bytes=s.bucket_bytes,
            timeout_s=s.timeout_s,
            mpi_gpu_aware=gpu_aware,
        )
    )
