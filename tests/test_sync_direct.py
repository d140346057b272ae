"""Direct writes of the colocated strategy (sync/strategies/colocated_direct.py, engine/direct_weights.py).

CPU: the engine's handle entries rebuild exactly the views weight updates write into (dense with a tied head, MoE
with per-expert names into fused tensors); an engine on the CPU refuses the routes with the message the trainer
falls back on. GPU tier: a publish to an engine on this GPU writes into its parameters (two versions, MoE
per-expert names, checksums equal, generation continues on the new version); a write stopped part-way leaves the
engine half-updated (it refuses to continue) until the next complete one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import require
from sync_support import bf16_fleet, engine_sums, gpu_engine, router_of
from test_client_engine import HAVE_SERVER, EngineProcess, stop_all, tiny_model

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.direct_weights import handle_entries
from miles_hpc.engine.validate import RequestError
from miles_hpc.models import hf_target, iter_hf_tensors, load_pretrained
from miles_hpc.models.presets import init_model
from miles_hpc.rollout.client import EngineClient, EngineHTTPError
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.sync.protocol import EngineSyncError
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies.colocated import ColocatedSpec, ColocatedSync
from miles_hpc.sync.strategies.colocated_direct import write_and_hash
from miles_hpc.sync.wire.checksum import digests, head, lanes_of, tensor_checksum, tensor_checksums

needs_server = pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_entries_rebuild_the_views_updates_write_into(tmp_path: Path, arch: str) -> None:
    model = load_pretrained(init_model(arch, "tiny", tmp_path / arch))
    named, entries = handle_entries(model)
    hf_names = [n for n, _ in iter_hf_tensors(model)]
    assert [e[0] for e in entries] == hf_names and "lm_head.weight" not in hf_names  # tied head: not an entry
    params = dict(model.named_parameters())
    for name, idx, shape, stride, offset in entries:
        view = named[idx][1].as_strided(shape, stride, offset)
        want = hf_target(model, name, params)
        assert view.data_ptr() == want.data_ptr() and torch.equal(view, want), name
    if arch == "qwen3_moe":  # per-expert names are views into the fused tensors, not copies
        assert sum(".experts.0.gate_proj" in e[0] for e in entries) == model.num_moe_layers
        assert len(named) < len(entries)


def test_write_and_hash_writes_every_destination_and_hashes_what_it_wrote() -> None:
    g = torch.Generator().manual_seed(0)
    srcs = [
        torch.randn(n, generator=g).to(dt)
        for n, dt in ((300, torch.bfloat16), (7, torch.float32), (0, torch.bfloat16), (1000, torch.float16))
    ]
    dsts = [[torch.zeros_like(s), torch.ones_like(s)] for s in srcs]  # two engines each
    lanes = write_and_hash(zip(srcs, dsts), batch_bytes=600)  # several batches, one tensor larger than a batch
    assert all(torch.equal(d, s) for s, ds in zip(srcs, dsts) for d in ds)
    assert torch.equal(lanes, lanes_of(srcs))
    named = {f"t{i}": s for i, s in enumerate(srcs)}
    assert dict(zip(named, digests([head(s) for s in srcs], lanes))) == tensor_checksums(named.items())
    assert write_and_hash(iter(()), 1).shape == (0, 2)


def test_write_and_hash_batches_bound_temporaries_and_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """`batch_bytes` bounds the cast temporaries a batch holds, `launch_bytes` the sources per launch: sources that
    are the caller's own tensors (third field False) fill launches up to `launch_bytes` (on an H200, 2 GiB
    launches wrote a 7B push in 13.2 ms, 512 MB ones in 20.4 ms)."""
    from miles_hpc.sync.strategies import colocated_direct

    launches: list[int] = []
    real = colocated_direct.copy_with_lanes
    monkeypatch.setattr(colocated_direct, "copy_with_lanes", lambda pairs: launches.append(len(pairs)) or real(pairs))
    srcs = [torch.randn(100) for _ in range(6)]  # 400 bytes each
    dsts = [[torch.empty_like(s)] for s in srcs]
    lanes = write_and_hash(((s, d, False) for s, d in zip(srcs, dsts)), batch_bytes=400, launch_bytes=1200)
    assert launches == [3, 3] and torch.equal(lanes, lanes_of(srcs))
    launches.clear()
    write_and_hash(
        ((s, d, i % 2 == 0) for i, (s, d) in enumerate(zip(srcs, dsts))), batch_bytes=800, launch_bytes=1 << 20
    )
    assert launches == [3, 3]  # temporaries at 0 and 2 fill the first batch
    launches.clear()
    write_and_hash(zip(srcs, dsts), batch_bytes=800)  # pairs: every source counts as held
    assert launches == [2, 2, 2]


class _CommitOnly:
    """An engine client that only commits (DirectWriter.push's one call), counting the calls."""

    def __init__(self, url: str) -> None:
        self.url, self.commits = url, 0

    async def weights_direct_commit(self, **kw: object) -> str:
        self.commits += 1
        return "ok"


def test_direct_push_resolves_names_once_per_engine_instance() -> None:
    """A push writes every tensor into every target and returns the checksums of what it wrote (a cast to the
    engine's dtype included); the views, dtype and head of each name are looked up once per engine instance
    (later pushes: a shape check), a shape that changed is still refused naming the engine, and a new instance
    (a restarted engine) is looked up afresh."""
    from miles_hpc.sync.strategies.colocated_direct import DirectTarget, DirectWriter

    g = torch.Generator().manual_seed(5)
    named = [("a", torch.randn(4, 6, generator=g)), ("b", torch.randn(10, generator=g).bfloat16())]
    views = {"a": torch.zeros(4, 6, dtype=torch.bfloat16), "b": torch.zeros(10, dtype=torch.bfloat16)}
    writer = DirectWriter()
    clients = [_CommitOnly("http://e0")]

    def push(targets: list[DirectTarget], w: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
        return asyncio.run(writer.push(iter(w), targets, clients, "1", 5.0))  # type: ignore[arg-type]

    targets = [DirectTarget("http://e0", "i0", views, [])]
    for _ in range(2):
        sums = push(targets, named)
        assert sums == {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in named}
        assert all(torch.equal(views[n], t.to(torch.bfloat16)) for n, t in named)
    assert clients[0].commits == 2 and set(writer._known[1]) == {"a", "b"}
    with pytest.raises(EngineSyncError, match=r"trainer shape \(24,\), engine http://e0 holds \(4, 6\)"):
        push(targets, [("a", named[0][1].reshape(-1))])
    moved = {"a": torch.zeros(4, 6, dtype=torch.float32), "b": torch.zeros(10, dtype=torch.bfloat16)}
    sums = push([DirectTarget("http://e0", "i1", moved, [])], named)  # restarted: another dtype now
    assert torch.equal(moved["a"], named[0][1]) and sums["a"] == tensor_checksum(named[0][1])


def test_cpu_engine_refuses_a_direct_write(tmp_path: Path) -> None:
    engine = Engine.from_pretrained(str(init_model("qwen3", "tiny", tmp_path / "m")), EngineConfig())
    with pytest.raises(RequestError, match="need an engine on a GPU"):
        engine.begin_direct_write()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    with bf16_fleet(tmp_path_factory.mktemp("direct-engines"), n=1) as procs:
        yield procs


@needs_server
@pytest.mark.process
def test_cpu_engine_server_refuses_the_routes(engines: list[EngineProcess]) -> None:
    async def main() -> None:
        async with router_of(engines) as router:
            c = router.clients[0]
            for call in (c.weights_ipc_handles, c.weights_direct_begin):
                with pytest.raises(EngineHTTPError, match="need an engine on a GPU"):
                    await call()

    asyncio.run(asyncio.wait_for(main(), 30))


# ---------------------------------------------------------------- GPU tier
def _perturbed(model_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    model = load_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return [(n, t.detach().to("cuda")) for n, t in iter_hf_tensors(model)]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_direct_publish_to_an_engine_on_this_gpu(tmp_path: Path, arch: str) -> None:
    require(HAVE_SERVER, "the embedded engine server (miles-hpc serve)")
    model_dir = tiny_model() if arch == "qwen3" else init_model(arch, "tiny", tmp_path / arch)
    proc = EngineProcess(model_dir, tmp_path / "engine-0.json", args=("--device", "cuda", "--dtype", "bfloat16"))
    try:
        rec = proc.start().wait_ready(180)

        async def main() -> None:
            sync = ColocatedSync(ColocatedSpec(rollout_dtype=torch.bfloat16, timeout_s=60))
            async with Router.from_urls([rec.url], RouterConfig(health_interval_s=60), connect_retries=0) as router:
                pub = Publisher(sync, router, pause_mode="in_place")
                for version, seed in (("1", 1), ("2", 2)):
                    w = _perturbed(model_dir, seed)
                    report = await pub.publish(lambda w=w: iter(w), version)
                    assert report.engines == 1 and report.tensors == len(w)
                    got = await engine_sums(router.clients[0])
                    assert {n: got[n] for n, _ in w} == {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in w}
                assert sync._direct.unsupported(router.clients) is None and sync._direct._targets  # went direct
                out = await router.generate([5, 6, 7], {"max_new_tokens": 2})
                assert out.weight_versions[0].version == "2"

        asyncio.run(asyncio.wait_for(main(), 180))
    finally:
        stop_all([proc])


@pytest.mark.gpu
def test_a_write_stopped_part_way_leaves_the_engine_half_updated(tmp_path: Path) -> None:
    with gpu_engine(tmp_path) as rec:

        async def main() -> None:
            sync = ColocatedSync(ColocatedSpec(rollout_dtype=torch.bfloat16, timeout_s=60))
            c = EngineClient(rec.url, connect_retries=0)
            async with c:
                await sync.connect([c])
                await c.pause("in_place")
                w = _perturbed(tiny_model(), 3)
                bad = w[:3] + [("model.layers.0.no_such.weight", w[0][1])] + w[3:]
                with pytest.raises(EngineSyncError, match="no_such"):
                    await sync.push(iter(bad), "3")
                with pytest.raises(EngineHTTPError, match="half-updated"):
                    await c.continue_generation()
                sums = await sync.push(iter(w), "4")  # a complete write: consistent again
                await c.continue_generation()
                got = await engine_sums(c)
                assert {n: got[n] for n, _ in w} == sums
                assert (await c.model_info())["weight_version"] == "4"

        asyncio.run(asyncio.wait_for(main(), 120))
