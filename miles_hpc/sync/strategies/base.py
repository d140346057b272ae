"""What every weight-sync strategy knows of itself (stage: sync), so that nothing outside `sync/` names one.

A strategy class says, before any process starts:
- `sends`: what it moves, the trainer's full state (HF tensors) or the LoRA adapter alone; `source(trainer)` is
  the trainer verb that yields it;
- `publish_at_start`: the engines need one publish before the first rollout even without a warm-up (LoRA: they
  serve the adapter by name from the first request on);
- `engine_needs(cfg)`: what its engines need at launch (`EngineNeeds`: SGLang's LoRA flags, the adapter name every
  generation names);
- `check_placement(cfg, trainer_gpus, engine_gpus)`: whether the run's devices can carry it (raises a
  `ConfigError` naming the key);
and, once built, `metrics()` of the last push (merged into the step's metrics).

`GroupSyncSpec` holds the fields of the strategies that move tensors over one process group (broadcast, p2p).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch

from miles_hpc.config import ConfigError, RunConfig
from miles_hpc.sync.wire.pg import Backend

__all__ = ["EngineNeeds", "GroupSyncSpec", "Sends", "Strategy", "SyncSource", "check_group_placement"]

Sends = Literal["state", "adapters"]
Named = Iterable[tuple[str, torch.Tensor]]


class SyncSource(Protocol):
    """The trainer verbs a strategy reads from (the controller's `RankedTrainer`)."""

    def state_for_sync(self) -> Named: ...

    def adapter_for_sync(self) -> Named: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineNeeds:
    """What a strategy needs of its engines when they are launched."""

    lora_rank: int | None = None
    """Engines must serve LoRA adapters up to this rank (SGLang: `--enable-lora --max-lora-rank`); None: no LoRA."""
    lora_target_modules: tuple[str, ...] = ()
    """The modules adapters may target (SGLang: `--lora-target-modules`)."""
    adapter_name: str | None = None
    """Every generation names this adapter (`lora_path` of `/generate`); None: the base weights."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSyncSpec:
    """A strategy over one process group of trainer and engine ranks (broadcast, p2p)."""

    master_address: str
    next_port: Callable[[], int]  # a free TCP port on master_address, asked once per (re)connect
    backend: Backend = "gloo"
    bucket_bytes: int = 512 << 20
    group_name: str | None = None  # None: the strategy's own name for its group
    rollout_dtype: torch.dtype | None = None  # None: send the trainer's dtype
    timeout_s: float = 300.0
    mpi_gpu_aware: bool | None = None  # backend "mpi": hand CUDA buffers to MPI (None: detect)


class Strategy:
    """Defaults of the class-level knowledge above; each strategy overrides what differs."""

    name: ClassVar[str]
    sends: ClassVar[Sends] = "state"
    takes_named: ClassVar[bool] = True
    publish_at_start: ClassVar[bool] = False

    @classmethod
    def engine_needs(cls, cfg: RunConfig) -> EngineNeeds:
        return EngineNeeds()

    @classmethod
    def check_placement(cls, cfg: RunConfig, trainer_gpus: Sequence[int], engine_gpus: Sequence[int]) -> None:
        """Raise a ConfigError naming the key when the run's devices cannot carry this strategy."""

    def source(self, trainer: SyncSource) -> Callable[[], Named]:
        return trainer.adapter_for_sync if self.sends == "adapters" else trainer.state_for_sync

    def metrics(self) -> dict[str, float]:
        """Figures of the last push (`sync/...` keys); none by default."""
        return {}


def check_group_placement(cfg: RunConfig, name: str, senders: Sequence[int], engine_gpus: Sequence[int]) -> None:
    """One process group spans the senders and every engine: one kind of device on both sides, and (NCCL) no
    engine on a sender's GPU."""
    t, r = cfg.train, cfg.rollout
    if t.device != r.device:
        raise ConfigError(
            f"sync.strategy: {name} runs one process group over trainer and engines, NCCL between "
            f"GPUs or gloo between CPUs; train.device={t.device} and rollout.device={r.device} differ: "
            f"put both on one kind of device, or use sync.strategy=delta"
        )
    for i, g in enumerate(engine_gpus):
        if g in senders:
            raise ConfigError(
                f"sync.strategy: {name}: engine {i} would share GPU {g} with a trainer rank, and "
                f"NCCL refuses two ranks of one group on one GPU; use sync.strategy=colocated (CUDA "
                f"IPC on the shared GPU) or give the run more GPUs"
            )
