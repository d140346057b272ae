"""Driving every trainer rank from the controller (stage: launch; docs/design.md section 3).

Trainer rank 0 is the controller: it calls :class:`RankedTrainer` methods, which broadcast ``(verb, args)`` to the
other ranks and then run the same verb locally, so every collective inside the trainer happens on all ranks in the
same order. Ranks > 0 sit in :func:`follow` until the controller says ``shutdown`` (or dies: the broadcast then
fails and the rank exits with the error, it never idles to walltime).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.dist import broadcast_object
from miles_hpc.train.protocol import Trainer

_VERBS = ("compute_logprobs", "train_step", "state_for_sync", "checksums", "save", "load", "on_every_rank")
R = TypeVar("R")


class RankedTrainer:
    """The controller's handle on the whole trainer world (same verbs as `Trainer`)."""

    def __init__(self, trainer: Trainer) -> None:
        if trainer.rank != 0:
            raise ValueError("RankedTrainer runs on trainer rank 0; other ranks call follow()")
        self.trainer = trainer

    def _fan_out(self, verb: str, *args: Any) -> None:
        broadcast_object((verb, args))

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        self._fan_out("compute_logprobs", batch)
        return self.trainer.compute_logprobs(batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self._fan_out("train_step", batch)
        return self.trainer.train_step(batch)

    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._fan_out("state_for_sync")
        return self.trainer.state_for_sync()

    def adapter_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter: every rank holds it whole, so rank 0 alone reads it (no collective, no fan-out)."""
        return self.trainer.adapter_for_sync()  # type: ignore[attr-defined]

    def checksums(self, dtype: torch.dtype | None = None) -> dict[str, str]:
        self._fan_out("checksums", dtype)
        return self.trainer.checksums(dtype)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        self._fan_out("save", str(path), extra)
        return self.trainer.save(path, extra)

    def load(self, path: str | Path) -> dict[str, Any]:
        self._fan_out("load", str(path))
        return self.trainer.load(path)

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    def shard_map(self) -> Any:
        """Rank 0's view of what every rank holds (no collective)."""
        return self.trainer.shard_map()  # type: ignore[attr-defined]

    def on_every_rank(self, action: Callable[[Any], R]) -> list[R]:
        """``action(trainer)`` on every rank (the action is pickled to the others: a module-level callable, such as
        the p2p sync's rank actions); their results in rank order, on this rank."""
        self._fan_out("on_every_rank", action)
        return _gather(action(self.trainer))

    def shutdown(self) -> None:
        self._fan_out("shutdown")


def follow(trainer: Trainer) -> None:
    """Ranks > 0: run each verb the controller broadcasts until ``shutdown``."""
    while True:
        verb, args = broadcast_object(None)
        if verb == "shutdown":
            return
        if verb not in _VERBS:
            raise RuntimeError(f"trainer rank {trainer.rank}: unknown command {verb!r} from the controller")
        if verb == "on_every_rank":
            _gather(args[0](trainer))
            continue
        result = getattr(trainer, verb)(*args)
        if verb == "state_for_sync":
            for _ in result:  # a collective generator: step through it with rank 0
                pass


def _gather(result: R) -> list[R]:
    """Every rank's ``result`` on rank 0, in rank order (an empty list elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [result]
    out: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(result, out if dist.get_rank() == 0 else None, dst=0)
    return out
