"""The publish cycle around every weight-sync strategy: pause -> transfer -> verify -> continue (stage: sync).

`Publisher.publish(named_fn, version)`:
1. targets = the router's available engines, plus quarantined engines that answer `/health` again (they need the
   current weights before they may serve: the router's re-admission hook `readmit_check` refuses an engine whose
   `weight_version` is not the published one);
2. pause the targets (`sync.pause_mode`: abort | retract | in_place);
3. (re)connect the strategy when the targets changed, then `push` (the strategy's transfer; the last part sets
   `weight_version`);
4. an `EngineSyncError` names the engines whose part failed; a broken collective fails every member, so those
   that no longer answer `/health` (dead or hung) are quarantined (the run goes on with the others), the rest of
   the trainer's iterator is drained (it is a collective on every trainer rank), and the push is retried once
   with the remaining engines from a fresh iterator; anything else stops the run. Engines still blocked in the
   broken group are freed when the members they wait on close it (the trainer's side at once, an engine rank whose
   receive failed at once: engine/weight_receiver.py `_breaks`), at the latest after their own receive timeout
   (`miles-hpc serve --weight-update-timeout`, set from `sync.timeout_s`); when no engine is left (none could be paused,
   or every one died), the version is recorded as published and engines catch up when they return (below);
5. verify every target's per-tensor checksums against what was sent (a mismatch stops the run, naming the tensor;
   an engine that died after the transfer, whose check fails and whose /health no longer answers, is dropped);
6. continue generation on the updated engines (also after a failure, so nothing stays paused by accident; an
   engine left half-updated refuses to continue, engine/core.py, and stays out of the fleet).

Catch-up: an engine that comes back without the published weights (restarted by launch/supervisor.py) gets them
from the router's re-admission hook at once, through the same cycle with it as the only target, unless the trainer
has trained since the last publish (`note_trained`): the publish due next includes it. Publishes and catch-ups take
turns (one lock), so a run whose only engine died serves again as soon as its restart listens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from miles_hpc.faults import crash_point
from miles_hpc.rollout.client import EngineClient, EngineHTTPError
from miles_hpc.rollout.requests import PauseMode
from miles_hpc.rollout.router import Router
from miles_hpc.sync.protocol import EngineSyncError, WeightSync, WeightSyncError

__all__ = ["PublishReport", "Publisher"]

log = logging.getLogger(__name__)

NamedFn = Callable[[], Iterable[tuple[str, torch.Tensor]]]


@dataclass(frozen=True, slots=True)
class PublishReport:
    version: str
    engines: int  # engines that hold `version` now
    dropped: tuple[str, ...]  # engines taken out of the fleet during this publish
    tensors: int
    seconds: float


class Publisher:
    """Runs the publish cycle of one strategy over the engines of one router."""

    def __init__(self, sync: WeightSync, router: Router, *, pause_mode: PauseMode = "retract") -> None:
        self.sync, self.router, self.pause_mode = sync, router, pause_mode
        self.version: str | None = None  # the last version every live engine verified
        self._named_fn: NamedFn | None = None  # what that version was read from
        self._trained_since = False  # the trainer moved past `version`: a catch-up would send newer weights
        self._turn = asyncio.Lock()

    def note_trained(self) -> None:
        """The loops call this after each train step: until the next publish, the trainer holds weights newer than
        `version`, so a returning engine waits for that publish instead of a catch-up."""
        self._trained_since = True

    async def publish(self, named_fn: NamedFn, version: str) -> PublishReport:
        async with self._turn:
            t0 = time.perf_counter()
            targets = await self._targets()
            dropped: list[str] = []
            self.router.paused = True  # aborts and health answers while paused are the pause's doing (router.py)
            try:
                report = await self._publish(named_fn, version, targets, dropped, t0)
            finally:
                self.router.paused = False
            if not report.engines:
                # Every engine is out (dead, restarting): the version is the trainer's all the same; an engine that
                # comes back gets it from `catch_up` before it serves. launch/supervisor.py bounds the wait.
                log.warning("weight sync: no engine took weight version %s; returning engines catch up", version)
                self.version = version
            self._named_fn, self._trained_since = named_fn, False
            return report

    async def catch_up(self, client: EngineClient) -> bool:
        """Give ``client`` the published weights (verified); False when there is nothing to give it now."""
        async with self._turn:
            if self.version is None or self._named_fn is None or self._trained_since:
                return False
            log.warning("weight sync: catching %s up to weight version %s", client.url, self.version)
            await self._publish(self._named_fn, self.version, [client], [], time.perf_counter())
            return True

    async def _publish(
        self, named_fn: NamedFn, version: str, targets: list[EngineClient], dropped: list[str], t0: float
    ) -> PublishReport:
        answers = await asyncio.gather(*(c.pause(self.pause_mode) for c in targets), return_exceptions=True)
        for c, a in zip(targets, answers):
            if isinstance(a, BaseException):
                self._drop(c, a, dropped)
        targets = paused = [c for c in targets if c.url not in dropped]
        if not targets:  # none could be paused: all are out (the caller decides what that means)
            return PublishReport(version, 0, tuple(dropped), 0, time.perf_counter() - t0)
        try:
            sent: dict[str, str] = {}
            for attempt in (0, 1):
                it = iter(named_fn() if self.sync.takes_named else ())
                try:
                    if list(self.sync.clients) != targets:
                        await self.sync.connect(targets)
                    crash_point("sync:paused")  # engines paused, no tensor sent yet
                    sent = await self.sync.push(it, version)
                    break
                except EngineSyncError as e:
                    _drain(it)
                    await self.sync.close()
                    # A collective breaks for every member when one dies: drop the engines that are gone (or
                    # hung: no /health answer), retry with the ones that answer.
                    targets = await self._drop_dead(targets, e, dropped)
                    if not targets:  # every member died during the update: nothing holds it (see publish)
                        return PublishReport(version, 0, tuple(dropped), 0, time.perf_counter() - t0)
                    if attempt == 1:
                        raise WeightSyncError(f"weight version {version}: {e}") from e
                    log.warning("weight sync: retrying with %d engines", len(targets))
                except BaseException:
                    _drain(it)
                    raise
            try:
                await self.sync.verify(targets, sent)
            except EngineSyncError as e:  # no mismatch, but engines that could not answer: dead ones leave
                targets = await self._drop_dead(targets, e, dropped)
                if any(c.url in e.failed for c in targets):  # one that still answers /health: not verified
                    raise WeightSyncError(f"weight version {version}: {e}") from e
            if not targets:
                return PublishReport(version, 0, tuple(dropped), 0, time.perf_counter() - t0)
            self.version = version
        finally:
            await asyncio.gather(
                *(c.continue_generation() for c in paused if c.url not in dropped), return_exceptions=True
            )
        return PublishReport(version, len(targets), tuple(dropped), len(sent), time.perf_counter() - t0)

    async def _drop_dead(
        self, targets: list[EngineClient], error: EngineSyncError, dropped: list[str]
    ) -> list[EngineClient]:
        """`targets` less the engines `error` names that no longer answer /health (dead, or a tensor-parallel rank
        gone), each dropped."""
        named = [c for c in targets if c.url in set(error.failed)]
        alive = await asyncio.gather(*(self._alive(c) for c in named))
        gone = {c.url for c, ok in zip(named, alive) if not ok}
        for c in targets:
            if c.url in gone:
                self._drop(c, error, dropped)
        return [c for c in targets if c.url not in gone]

    def _drop(self, client: EngineClient, error: BaseException, dropped: list[str]) -> None:
        """Out of the fleet (the router fails over its work); the next publish tries it again."""
        dropped.append(client.url)
        for i, c in enumerate(self.router.clients):
            if c is client:
                self.router.quarantine(i, error)
        log.warning("weight sync: dropped %s: %s", client.url, error)

    async def readmit_check(self, i: int, client: EngineClient) -> None:
        """The router's re-admission hook: an engine serves again only with the published weights (given to it
        here when the trainer still holds them: `catch_up`)."""
        info = await client.model_info()
        if self.version is not None and str(info.get("weight_version")) != self.version:
            if await self.catch_up(client):
                info = await client.model_info()
        if self.version is not None and str(info.get("weight_version")) != self.version:
            raise WeightSyncError(
                f"{client.url} holds weight version {info.get('weight_version')!r}, the trainer "
                f"published {self.version!r}: it gets the weights at the next publish"
            )

    async def _targets(self) -> list[EngineClient]:
        """Available engines, plus quarantined ones that are alive again, in the router's order."""
        quarantined = self.router.selector.quarantined
        alive = await asyncio.gather(*(self._alive(self.router.clients[i]) for i in sorted(quarantined)))
        back = {i for i, ok in zip(sorted(quarantined), alive) if ok}
        return [c for i, c in enumerate(self.router.clients) if i not in quarantined or i in back]

    @staticmethod
    async def _alive(client: EngineClient) -> bool:
        """Whether ``client`` can take weights: it answers /health, or says its weights are half-updated (a 503
        that only a full update cures)."""
        try:
            await client.health(timeout=5.0, retries=0)
        except EngineHTTPError as e:
            return e.status == 503 and "weights are half-updated" in str(e)
        except Exception:  # noqa: BLE001 (any failure means: not a target this time)
            return False
        return True


def _drain(it: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Step through the rest of a trainer-side iterator: every trainer rank runs the same collectives."""
    for _ in it:
        pass
