"""The pause lease: a paused engine whose controller went away does not stay paused forever.

Stage: engine (HTTP layer: bookkeeping with an injected clock, and the task the server runs on it). A pause
(``/pause_generation``, or a weight update's own pause) is the trainer's: it continues generation when its weight
sync is done. A trainer that dies in between (SIGKILL, a lost node) never sends ``/continue_generation``, and without
a lease the engine would stay paused while ``/health`` said 200 and every ``/generate`` waited. So every admin call
(pause, continue, each weight-sync call, version, checks) renews the lease, at its start and at its end, and holds
it while it runs (a receive may wait minutes for the trainer's broadcast); once the engine has been paused with no
admin call for ``lease_s`` seconds the lease has run out, and `PauseLease.watch` (a task of server.py):
- continues generation and logs a warning, when the weights are consistent;
- otherwise (half-updated weights, which the engine refuses to serve: core.py) logs an error once, and the server
  answers 503 on ``/health`` and ``/health_generate`` naming the reason (`stuck_reason`), so routers and operators
  see an engine that needs its weights reloaded.

Invariants: the lease never runs out while an admin call is in flight; ``lease_s`` None means no lease (a pause
lasts until it is continued); each run-out episode is logged once. Not thread-safe: the server's event loop is its
only user; the lease's own continue runs under the same lock as ``/pause_generation`` and ``/continue_generation``,
so it never undoes a pause that arrives meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from .core import Engine, RequestError

__all__ = ["PauseLease"]

log = logging.getLogger(__name__)


class PauseLease:
    """When the last admin call ended, how many are in flight, and whether the lease has run out."""

    def __init__(self, lease_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s is not None and lease_s <= 0:
            raise ValueError(f"pause lease must be > 0 seconds or None, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._renewed = clock()
        self._in_flight = 0
        self._reported = False  # this episode's run-out was reported (logged)

    def renew(self) -> None:
        self._renewed = self._clock()
        self._reported = False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Around one admin call: renewed when it starts and when it ends, never run out while it runs."""
        self._in_flight += 1
        self.renew()
        try:
            yield
        finally:
            self._in_flight -= 1
            self.renew()

    def idle_s(self) -> float:
        """Seconds since the last admin call ended (0 while one is in flight)."""
        return 0.0 if self._in_flight else max(0.0, self._clock() - self._renewed)

    def remaining_s(self) -> float | None:
        """Seconds until the lease runs out (None: no lease)."""
        return None if self.lease_s is None else max(0.0, self.lease_s - self.idle_s())

    def ran_out(self) -> bool:
        return self.lease_s is not None and not self._in_flight and self.idle_s() >= self.lease_s

    def take_report(self) -> bool:
        """True once per episode (until the next renewal): whether the caller should report the run-out now."""
        first, self._reported = not self._reported, True
        return first

    def stuck_reason(self, engine: Engine) -> str | None:
        """Why ``engine`` cannot serve although it runs: paused on half-updated weights past the lease; else None."""
        if not (engine.paused and engine.half_updated and self.ran_out()):
            return None
        return (
            f"weights are half-updated: an update paused generation and no weight-sync call came for "
            f"{self.idle_s():.0f} s (pause lease {self.lease_s:.0f} s; the trainer is gone?); finish the update or "
            "reload weights (POST /update_weights_from_disk) before generation can continue"
        )

    async def watch(self, engine: Engine, pausing: asyncio.Lock, closing: Callable[[], bool]) -> None:
        """Until cancelled (the server's task): continue generation once the lease of a pause ran out, or report
        the engine stuck on half-updated weights. ``pausing``: the lock of the pause and continue handlers."""
        if self.lease_s is None:
            return
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self.lease_s / 4)))
            if closing() or not engine.paused or not self.ran_out():
                continue
            async with pausing:
                if not (engine.paused and self.ran_out()):  # continued or renewed meanwhile
                    continue
                if not engine.half_updated:
                    log.warning(
                        "generation was paused and no /continue_generation or weight-sync call came for %.0f s "
                        "(pause lease %.0f s, --pause-lease; the trainer that paused it is gone?): continuing "
                        "generation",
                        self.idle_s(),
                        self.lease_s,
                    )
                    try:
                        await asyncio.to_thread(engine.resume)
                        continue
                    except RequestError:  # half-updated since: reported below
                        pass
                if self.take_report():
                    log.error("this engine cannot serve: %s", self.stuck_reason(engine))
