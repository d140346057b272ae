"""Driving every trainer rank from the controller (stage: launch; docs/design.md section 3).

Trainer rank 0 is the controller: it calls :class:`RankedTrainer` methods, which broadcast ``(verb, args)`` to the
other ranks and then run the same verb locally, so every collective inside the trainer happens on all ranks in the
same order. Ranks > 0 sit in :func:`follow` until the controller says ``shutdown`` (or dies: the broadcast then
fails and the rank exits with the error, it never idles to walltime).

Failures never hang the world: a controller that fails between two verbs sends ``abort`` with its error, and every
other rank exits with that message (:class:`ControllerAborted`); one that fails inside a verb (the others may be in
a collective that will not complete) sends nothing and exits, which breaks their collective. While the controller
is busy elsewhere (a long rollout) a heartbeat ``ping`` keeps the waiting ranks' command broadcast inside the
group's collective timeout, so that timeout can be short enough to catch a real hang. Verbs are serialised by a
lock: a verb issued from another thread (fully async training, a catch-up weight push) waits for the running one.
"""

from __future__ import annotations

import threading
import time
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


class ControllerAborted(RuntimeError):
    """On a trainer rank > 0: the controller stopped the run (its error is the message)."""


class RankedTrainer:
    """The controller's handle on the whole trainer world (same verbs as `Trainer`)."""

    def __init__(self, trainer: Trainer, *, heartbeat_s: float | None = None) -> None:
        """``heartbeat_s``: send a ``ping`` to the other ranks after this long without a verb (None: never)."""
        if trainer.rank != 0:
            raise ValueError("RankedTrainer runs on trainer rank 0; other ranks call follow()")
        self.trainer = trainer
        # One verb at a time, whichever thread issues it. Not an RLock: a collective generator (state_for_sync) may be
        # stepped in a worker thread and drained in another after a failure, and its release must work from there.
        self._lock = threading.Lock()
        self._busy = 0  # > 0 while a verb runs: the other ranks may then be inside its collectives
        self._last = time.monotonic()
        self._closed = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if heartbeat_s is not None and trainer.world_size > 1:
            self._heartbeat = threading.Thread(
                target=self._beat, args=(heartbeat_s,), name="trainer-heartbeat", daemon=True
            )
            self._heartbeat.start()

    def _fan_out(self, verb: str, *args: Any) -> None:
        if self._closed:
            raise RuntimeError(f"trainer verb {verb!r} after the trainer world was shut down or aborted")
        broadcast_object((verb, args))
        self._last = time.monotonic()

    def _verb(self, verb: str, *args: Any) -> Any:
        with self._lock:
            self._busy += 1
            try:
                self._fan_out(verb, *args)
                return getattr(self.trainer, verb)(*args)
            finally:
                self._busy -= 1
                self._last = time.monotonic()

    def _beat(self, every_s: float) -> None:
        device = getattr(self.trainer, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL broadcasts from this thread run on the rank's own GPU
        while not self._stop.wait(min(every_s, 5.0)):
            if time.monotonic() - self._last < every_s or not self._lock.acquire(timeout=0.1):
                continue
            try:
                if not self._closed and not self._busy:
                    self._fan_out("ping")
            except Exception:  # a peer is gone: the main thread's next verb reports it
                return
            finally:
                self._lock.release()

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return self._verb("compute_logprobs", batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._verb("train_step", batch)

    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A collective generator: the lock is held until it is exhausted (or closed), so no other verb can slip
        between its collectives."""
        with self._lock:
            self._busy += 1
            try:
                self._fan_out("state_for_sync")
                yield from self.trainer.state_for_sync()
            finally:
                self._busy -= 1
                self._last = time.monotonic()

    def adapter_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter: every rank holds it whole, so rank 0 alone reads it (no collective, no fan-out)."""
        return self.trainer.adapter_for_sync()  # type: ignore[attr-defined]

    def checksums(self, dtype: torch.dtype | None = None) -> dict[str, str]:
        return self._verb("checksums", dtype)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        with self._lock:
            self._busy += 1
            try:
                self._fan_out("save", str(path), extra)
                return self.trainer.save(path, extra)
            finally:
                self._busy -= 1

    def load(self, path: str | Path) -> dict[str, Any]:
        with self._lock:
            self._busy += 1
            try:
                self._fan_out("load", str(path))
                return self.trainer.load(path)
            finally:
                self._busy -= 1

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    def shard_map(self) -> Any:
        """Rank 0's view of what every rank holds (no collective)."""
        return self.trainer.shard_map()  # type: ignore[attr-defined]

    def on_every_rank(self, action: Callable[[Any], R]) -> list[R]:
        """``action(trainer)`` on every rank (the action is pickled to the others: a module-level callable, such as
        the p2p sync's rank actions); their results in rank order, on this rank."""
        with self._lock:
            self._busy += 1
            try:
                self._fan_out("on_every_rank", action)
                return _gather(action(self.trainer))
            finally:
                self._busy -= 1

    def shutdown(self) -> None:
        """Release the other ranks (the run succeeded)."""
        self._stop.set()
        with self._lock:
            self._fan_out("shutdown")
            self._closed = True

    def abort(self, reason: str) -> bool:
        """After a failure: tell the other ranks to exit with ``reason``, when they can hear it (no verb is running:
        they wait for a command). False when they could not be told (they then fail as this process exits).
        Never blocks on a busy world."""
        self._stop.set()
        if self._closed or self.trainer.world_size == 1:
            self._closed = True
            return False
        if not self._lock.acquire(timeout=1.0):
            self._closed = True
            return False
        try:
            if self._busy:  # failed inside a verb (this thread or another): the others may be in a collective
                return False
            self._fan_out("abort", reason)
            return True
        except Exception:  # a peer is gone already
            return False
        finally:
            self._closed = True
            self._lock.release()


def follow(trainer: Trainer) -> None:
    """Ranks > 0: run each verb the controller broadcasts until ``shutdown``; ``abort`` raises
    :class:`ControllerAborted` with the controller's error."""
    while True:
        verb, args = broadcast_object(None)
        if verb == "shutdown":
            return
        if verb == "ping":
            continue
        if verb == "abort":
            raise ControllerAborted(f"the controller (trainer rank 0) stopped the run: {args[0]}")
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
