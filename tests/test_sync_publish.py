"""The publish cycle (sync/publish.py) over real `miles-hpc serve` engines and a real gloo broadcast group: every
engine verified at the new version; an engine SIGKILLed between updates is dropped and the run goes on with the
others; once restarted it stays out until the next publish gives it the current weights, then it is re-admitted;
a checksum mismatch stops the publish naming the tensor.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_client_engine import HAVE_SERVER, EngineProcess, engine_fleet, tiny_model

from miles_hpc.launch.local import free_port
from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.rollout.sglang import wait_for_engines
from miles_hpc.sync.protocol import WeightSyncError
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies.base import GroupSyncSpec
from miles_hpc.sync.strategies.broadcast import BroadcastSync
from miles_hpc.sync.wire.checksum import tensor_checksum

pytestmark = [
    pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built"),
    pytest.mark.process,
]


@pytest.fixture
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    args = ("--weight-update-timeout", "5")  # a peer dying mid-update frees the others after 5 s
    with engine_fleet(tmp_path_factory.mktemp("rendezvous"), 3, args) as procs:
        yield procs


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's tensors moved by a seeded perturbation: one "trainer step" per seed."""
    model = load_pretrained(tiny_model())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return list(iter_hf_tensors(model))


def test_publish_drops_a_dead_engine_and_readmits_it_with_current_weights(engines: list[EngineProcess]) -> None:
    records = wait_for_engines(engines[0].rendezvous.parent, 3, timeout=90, poll_s=0.05)
    urls = [r.url for r in records]
    for proc, rec in zip(engines, records):
        proc.port = rec.port
    cfg = RouterConfig(health_interval_s=0.1, health_timeout_s=3, readmit_after=2)

    async def main() -> None:
        sync = BroadcastSync(
            GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, bucket_bytes=1 << 16, timeout_s=20)
        )
        publisher: Publisher
        clients = [EngineClient(u, connect_retries=0) for u in urls]
        router = Router(clients, cfg, owns_clients=True, on_readmit=lambda i, c: publisher.readmit_check(i, c))
        async with router:
            publisher = Publisher(sync, router, pause_mode="in_place")
            try:
                w1 = weights(1)
                report = await publisher.publish(lambda: iter(w1), "1")
                assert (report.engines, report.dropped, report.tensors) == (3, (), len(w1))
                infos = await asyncio.gather(*(c.model_info() for c in router.clients))
                assert [i["weight_version"] for i in infos] == ["1"] * 3

                engines[2].kill(signal.SIGKILL)  # dies between two updates, before the router notices
                w2 = weights(2)
                report = await publisher.publish(lambda: iter(w2), "2")
                assert report.dropped == (urls[2],) and report.engines == 2
                assert list(router.stats().quarantined) == [urls[2]]
                sums = {n: tensor_checksum(t.to(torch.float32)) for n, t in w2}
                for c in router.clients[:2]:
                    got = (await c.weights_checksums()).ranks[0].checksums
                    assert {n: got[n] for n in sums} == sums
                # Generation goes on with the other two (they were continued after the update).
                out = await router.generate([5, 6, 7], {"max_new_tokens": 3})
                assert out.weight_versions[0].version == "2"

                # The trainer trains on (its weights are past version 2): an engine restarted with the base weights
                # (version 0) is alive, but kept out until the next publish gives it version 3.
                publisher.note_trained()
                await asyncio.to_thread(lambda: engines[2].start().wait_ready())
                await asyncio.sleep(1.0)  # many health checks: each re-admission attempt is refused
                assert urls[2] in router.stats().quarantined
                assert "weight version '0'" in router.stats().quarantined[urls[2]]
                w3 = weights(3)
                report = await publisher.publish(lambda: iter(w3), "3")
                assert report.engines == 3 and report.dropped == ()
                for _ in range(100):
                    if not router.stats().quarantined:
                        break
                    await asyncio.sleep(0.05)
                assert router.stats().quarantined == {}

                # Between a publish and the next train step, a restarted engine is caught up at once: the trainer
                # still holds the published weights, which it gets (verified) before it is re-admitted.
                engines[1].kill(signal.SIGKILL)
                await asyncio.to_thread(lambda: engines[1].start().wait_ready())
                for _ in range(200):
                    if urls[1] in router.stats().quarantined:
                        break
                    await asyncio.sleep(0.05)
                for _ in range(400):
                    if not router.stats().quarantined:
                        break
                    await asyncio.sleep(0.05)
                assert router.stats().quarantined == {}
                assert (await router.clients[1].model_info())["weight_version"] == "3"
                sums = {n: tensor_checksum(t.to(torch.float32)) for n, t in w3}
                got = (await router.clients[1].weights_checksums()).ranks[0].checksums
                assert {n: got[n] for n in sums} == sums
            finally:
                await sync.close()

    asyncio.run(main())


class _Corrupting(BroadcastSync):
    """Claims one tensor was sent with other bits: verification must catch it."""

    async def push(self, named, version):  # type: ignore[no-untyped-def]
        sums = await super().push(named, version)
        name = sorted(sums)[0]
        sums[name] = "0" * 32
        return sums


def test_checksum_mismatch_stops_the_publish_naming_the_tensor(engines: list[EngineProcess], tmp_path: Path) -> None:
    records = wait_for_engines(engines[0].rendezvous.parent, 3, timeout=90, poll_s=0.05)

    async def main() -> None:
        sync = _Corrupting(GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, timeout_s=20))
        async with Router.from_urls([r.url for r in records], connect_retries=0) as router:
            publisher = Publisher(sync, router)
            w = weights(4)
            try:
                with pytest.raises(WeightSyncError, match=r"checksum mismatch on http://.* for tensor '"):
                    await publisher.publish(lambda: iter(w), "1")
                assert publisher.version is None
                # The engines were continued: they serve (the run stops on the error, the fleet is not stuck).
                out = await router.generate([5, 6, 7], {"max_new_tokens": 2})
                assert out.completion_tokens == 2
            finally:
                await sync.close()

    asyncio.run(main())


def test_engine_killed_mid_push_is_dropped_and_the_others_complete(engines: list[EngineProcess]) -> None:
    records = wait_for_engines(engines[0].rendezvous.parent, 3, timeout=90, poll_s=0.05)
    urls = [r.url for r in records]

    async def main() -> None:
        # Small buckets: the update is many parts, and engine 1 dies after the first ones went out.
        sync = BroadcastSync(
            GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, bucket_bytes=1 << 14, timeout_s=15)
        )
        async with Router.from_urls(urls, RouterConfig(health_interval_s=60), connect_retries=0) as router:
            publisher = Publisher(sync, router)
            w = weights(5)
            calls = 0

            def named() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal calls
                calls += 1
                for k, item in enumerate(w):
                    if calls == 1 and k == len(w) // 2:
                        engines[1].kill(signal.SIGKILL)
                    yield item

            try:
                report = await publisher.publish(named, "1")
                assert calls == 2 and report.dropped == (urls[1],) and report.engines == 2
                infos = await asyncio.gather(*(router.clients[i].model_info() for i in (0, 2)))
                assert [i["weight_version"] for i in infos] == ["1", "1"]
                assert not any(i["weights_half_updated"] for i in infos)
                out = await router.generate([5, 6, 7], {"max_new_tokens": 2})
                assert out.engine_url != urls[1] and out.weight_versions[0].version == "1"
            finally:
                await sync.close()

    asyncio.run(main())


class _KillingAfterPush(BroadcastSync):
    """Kills one engine once its update went out: it dies between the transfer and the verification."""

    victim: EngineProcess

    async def push(self, named, version):  # type: ignore[no-untyped-def]
        sums = await super().push(named, version)
        self.victim.kill(signal.SIGKILL)
        return sums


def test_engine_dead_before_verification_is_dropped_and_the_others_verified(engines: list[EngineProcess]) -> None:
    """An engine that dies after its transfer (a tensor-parallel rank gone, the process gone) cannot answer the
    checksum call: it is dropped as in a transfer, the others are verified at the new version, the run goes on."""
    records = wait_for_engines(engines[0].rendezvous.parent, 3, timeout=90, poll_s=0.05)
    urls = [r.url for r in records]

    async def main() -> None:
        sync = _KillingAfterPush(GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, timeout_s=15))
        sync.victim = engines[2]
        async with Router.from_urls(urls, RouterConfig(health_interval_s=60), connect_retries=0) as router:
            publisher = Publisher(sync, router)
            try:
                report = await publisher.publish(lambda: iter(weights(6)), "1")
                assert report.dropped == (urls[2],) and report.engines == 2 and publisher.version == "1"
                assert list(router.stats().quarantined) == [urls[2]]
                out = await router.generate([5, 6, 7], {"max_new_tokens": 2})
                assert out.engine_url != urls[2] and out.weight_versions[0].version == "1"
            finally:
                await sync.close()

    asyncio.run(main())


def test_check_answers_stops_on_a_mismatch_before_naming_failed_engines() -> None:
    from miles_hpc.sync.protocol import EngineSyncError, check_answers

    clients = [EngineClient(f"http://e{i}:1") for i in range(3)]
    want = {"a": "1", "b": "2"}
    check_answers(clients, [dict(want)] * 3, want, "weight checksum", "tensor")
    with pytest.raises(EngineSyncError, match="failed on http://e1:1: gone") as e:
        check_answers(clients, [dict(want), OSError("gone"), dict(want)], want, "weight checksum", "tensor")
    assert e.value.failed == ("http://e1:1",)
    with pytest.raises(WeightSyncError, match="mismatch on http://e2:1 for tensor 'b'") as e2:
        check_answers(clients, [dict(want), OSError("gone"), {"a": "1"}], want, "weight checksum", "tensor")
    assert not isinstance(e2.value, EngineSyncError)
    with pytest.raises(asyncio.CancelledError):
        check_answers(clients, [asyncio.CancelledError()], want, "weight checksum", "tensor")
