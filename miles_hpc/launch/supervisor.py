"""Keeping a run's processes honest (stage: launch; docs/reliability.md): engines restarted, trainer ranks watched.

:class:`EngineSupervisor` runs beside the loop, in its event loop:
- an engine process of this run that exits (``owner``: the local cluster that started it) is quarantined in the
  router at once and started again after a backoff, at most ``max_restarts`` times per engine;
- an engine's rendezvous record (``RUN/rendezvous/engine-<i>.json``) that names a new URL (a local restart, or a
  rollout worker under srun that restarted its engine) becomes the router's client for that engine; the router's
  health checks then re-admit it through the publisher's hook, which first gives it the current weights and checks
  them (sync/publish.py);
- with no engine serving for ``down_timeout_s``, or every engine dead with no restart left, the run fails with one
  message naming every engine's fate (:class:`EngineFleetDown`).

:func:`watch_trainer_ranks` (a thread): a trainer rank process of a local run that exits ends the run within a second
or two with its exit code and log, whatever the controller is doing (a collective with a dead peer can otherwise wait
for the group's timeout).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.errors import EngineError
from miles_hpc.rollout.router import Router

if TYPE_CHECKING:
    from miles_hpc.launch.local import LocalCluster
    from miles_hpc.launch.signals import StopControl

log = logging.getLogger(__name__)


class EngineFleetDown(RuntimeError):
    """No engine can serve the run any more (the message names each engine's fate)."""


@dataclass(slots=True)
class _Fate:
    restarts: int = 0
    exit_code: int | None = None  # of the last process that died
    restart_at: float | None = None  # when the pending restart starts
    gave_up: bool = False


class EngineSupervisor:
    """Restarts dead engines of ``owner`` and follows every engine's rendezvous record (module docstring)."""

    def __init__(
        self,
        router: Router,
        rendezvous: Path,
        client_factory: Callable[[str], EngineClient],
        *,
        owner: LocalCluster | None = None,
        max_restarts: int = 3,
        down_timeout_s: float = 300.0,
        backoff_s: float = 1.0,
        interval_s: float = 0.5,
    ) -> None:
        self.router, self.rendezvous, self.client_factory = router, rendezvous, client_factory
        self.owner = owner
        self.max_restarts, self.down_timeout_s = max_restarts, down_timeout_s
        self.backoff_s, self.interval_s = backoff_s, interval_s
        self.fates = [_Fate() for _ in router.clients]
        self.restarts_done = 0
        self._down_since: float | None = None

    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled; raises EngineFleetDown when the fleet is gone."""
        while True:
            self.check(time.monotonic())
            await asyncio.sleep(self.interval_s)

    def check(self, now: float) -> None:
        """One round: processes, records, the fleet."""
        if self.owner is not None:
            for i, fate in enumerate(self.fates):
                self._check_process(i, fate, now)
        for i in range(len(self.fates)):
            self._follow_record(i)
        self._check_fleet(now)

    def _check_process(self, i: int, fate: _Fate, now: float) -> None:
        assert self.owner is not None
        if fate.restart_at is not None:
            if now >= fate.restart_at:
                fate.restart_at = None
                fate.restarts += 1
                self.restarts_done += 1
                print(f"[miles-hpc] restarting engine {i} ({fate.restarts}/{self.max_restarts})", flush=True)
                self.owner.restart_engine(i)
            return
        code = self.owner.engine_exit(i)
        if code is None or fate.gave_up:
            return
        fate.exit_code = code
        url = self.router.clients[i].url
        why = f"engine {i} ({url}) exited with code {code}; see {self.owner.engine_log(i)}"
        self.router.quarantine(i, EngineError(url, "", why))
        if fate.restarts < self.max_restarts:
            fate.restart_at = now + self.backoff_s * 2**fate.restarts
            print(f"[miles-hpc] {why}: restarting it", flush=True)
        else:
            fate.gave_up = True
            print(f"[miles-hpc] {why}: no restart left (rollout.engine_restarts={self.max_restarts})", flush=True)

    def _follow_record(self, i: int) -> None:
        path = self.rendezvous / f"engine-{i}.json"
        try:
            url = str(json.loads(path.read_text())["url"]).rstrip("/")
        except (OSError, ValueError, KeyError, TypeError):
            return  # not (yet) written, or being replaced
        if url != self.router.clients[i].url:
            log.warning("engine %d is now at %s", i, url)
            print(f"[miles-hpc] engine {i} listens again at {url}: re-admitted once it holds the weights", flush=True)
            self.router.replace_client(i, self.client_factory(url))

    def _check_fleet(self, now: float) -> None:
        live = len(self.router.selector.available())
        if live:
            self._down_since = None
            return
        if self._down_since is None:
            self._down_since = now
        hopeless = self.owner is not None and all(f.gave_up for f in self.fates)
        if hopeless or now - self._down_since > self.down_timeout_s:
            raise EngineFleetDown(self.describe(now))

    def describe(self, now: float) -> str:
        down = 0.0 if self._down_since is None else now - self._down_since
        parts = []
        for i, (client, fate) in enumerate(zip(self.router.clients, self.fates)):
            last = self.router.stats().quarantined.get(client.url, "out of the fleet")
            restarted = f", restarted {fate.restarts}x" if fate.restarts else ""
            parts.append(f"engine {i} ({client.url}): {last}{restarted}")
        return (
            f"no rollout engine has served for {down:.0f} s (rollout.engine_down_timeout_s="
            f"{self.down_timeout_s:g}, rollout.engine_restarts={self.max_restarts}): " + "; ".join(parts)
        )


def watch_trainer_ranks(cluster: LocalCluster, control: StopControl, interval_s: float = 0.5) -> threading.Event:
    """A daemon thread failing the run (``control.fail``) when a trainer rank process of ``cluster`` exits before
    the run ends; set the returned event to stop watching (at the end of a run, when the ranks exit by design)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            exited = cluster.trainer_exits()
            if exited:
                name, code = exited[0]
                control.fail(f"{name.replace('-', ' rank ')} exited with code {code}; see {cluster.logs / name}.log")
                return

    threading.Thread(target=watch, name="trainer-rank-watch", daemon=True).start()
    return done
