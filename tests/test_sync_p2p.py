"""The p2p strategy (sync/strategies/p2p.py) over real `miles-hpc serve` engines and a real gloo group: two trainer ranks
(`ThreadedRanks`: threads of this process, each with its own group member) send only the dim-0 shards they hold; every engine ends
with exactly the trainer's tensors (checked by piece checksums and, independently, by the engines' whole-tensor
checksums); a tampered engine fails verification naming the piece; a bad announcement is refused with a message.
The whole loop with FSDP2 ranks and p2p is in tests/test_loop_e2e.py.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from sync_support import ADMIN, bf16_fleet, engine_sums, perturbed_weights, router_of
from test_client_engine import HAVE_SERVER

from miles_hpc.launch.local import free_port
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.errors import EngineError
from miles_hpc.sync.protocol import WeightSyncError
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies.base import GroupSyncSpec
from miles_hpc.sync.strategies.p2p import P2PSync, ThreadedRanks, buckets_of
from miles_hpc.sync.wire.checksum import tensor_checksum

pytestmark = [
    pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built"),
    pytest.mark.process,
]

WORLD = 2


def test_p2p_publish_every_engine_holds_the_trainers_weights(tmp_path: Path) -> None:
    with bf16_fleet(tmp_path, 2) as procs:

        async def main() -> None:
            world = ThreadedRanks(perturbed_weights(1), WORLD)
            sync = P2PSync(
                GroupSyncSpec(
                    master_address="127.0.0.1",
                    next_port=free_port,
                    bucket_bytes=1 << 16,
                    rollout_dtype=torch.bfloat16,
                    timeout_s=30,
                ),
                world,
            )
            async with router_of(procs) as router:
                publisher = Publisher(sync, router, pause_mode="retract")
                try:
                    for version, seed in (("1", 1), ("2", 2)):
                        world.set_weights(perturbed_weights(seed))
                        report = await publisher.publish(lambda: pytest.fail("p2p must not gather"), version)
                        assert report.engines == 2 and report.dropped == ()
                        want = {n: tensor_checksum(t) for n, t in world.named.items()}
                        for c in router.clients:
                            assert await engine_sums(c) == want  # whole tensors, independent of the pieces
                            assert str((await c.model_info())["weight_version"]) == version
                    # Piece checksums: one per held box, i.e. 2 per tensor with >= 2 rows (uneven last chunks too).
                    assert report.tensors == sum(len({b for b in world.layout[n] if not b.empty}) for n in world.shapes)
                    assert len(buckets_of(world.shapes, 2, 1 << 16)) > 3  # several buckets went out

                    # An engine whose tensor differs from the trainer's fails verification naming the piece.
                    name, t = next((n, t) for n, t in world.named.items() if t.dim() == 2)
                    bad = t.clone()
                    bad[-1, -1] += 1.0
                    blob = base64.b64encode(save({name: bad})).decode()
                    await router.clients[1].update_weights_from_tensor([blob], load_format="safetensors")
                    with pytest.raises(WeightSyncError, match=rf"{router.clients[1].url}.*{name}@"):
                        await sync.verify(router.clients, await_sums(world))
                finally:
                    await sync.close()

        asyncio.run(main())


def test_p2p_from_ranks_holding_copies_reaches_every_engine(tmp_path: Path) -> None:
    """Trainer ranks that hold identical copies (Megatron's DP or TP replicas: here every rank holds every tensor
    whole) take turns as the source by destination, so the second engine's pieces come from other ranks than the
    first's: each engine must be told its own (it was told the first's, and its receives met other pieces: gloo's
    "data size doesn't match", the engine down)."""
    from miles_hpc.planner.transfer import Box

    def whole(shapes: dict[str, tuple[int, ...]], world: int) -> dict[str, list[Box]]:
        return {n: [Box.full(s)] * world for n, s in shapes.items()}

    with bf16_fleet(tmp_path, 2) as procs:

        async def main() -> None:
            world = ThreadedRanks(perturbed_weights(3), WORLD, layout=whole)
            spec = GroupSyncSpec(
                master_address="127.0.0.1",
                next_port=free_port,
                bucket_bytes=1 << 16,
                rollout_dtype=torch.bfloat16,
                timeout_s=30,
            )
            sync = P2PSync(spec, world)
            async with router_of(procs) as router:
                publisher = Publisher(sync, router, pause_mode="retract")
                try:
                    report = await asyncio.wait_for(publisher.publish(lambda: pytest.fail("no gather"), "1"), 120)
                    assert report.engines == 2 and report.dropped == ()
                    want = {n: tensor_checksum(t) for n, t in world.named.items()}
                    for c in router.clients:
                        assert await engine_sums(c) == want
                finally:
                    await sync.close()
            assert all(p.proc.poll() is None for p in procs), "an engine exited"

        asyncio.run(main())


def await_sums(world: ThreadedRanks) -> dict[str, str]:
    """The pieces the trainer ranks hold, hashed as a push would (rollout dtype = bf16 already)."""
    from miles_hpc.sync.wire.checksum import piece_key

    out = {}
    for n, t in world.named.items():
        for box in {b for b in world.layout[n] if not b.empty}:
            out[piece_key(n, box.dims)] = tensor_checksum(t[box.slices()])
    return out


def test_bad_p2p_announcement_is_refused_with_the_tensor_named(tmp_path: Path) -> None:
    with bf16_fleet(tmp_path, 1) as procs:

        async def main() -> None:
            async with EngineClient(f"http://127.0.0.1:{procs[0].port}", admin_api_key=ADMIN) as c:
                # Rows 0..3 of an 8-row tensor: not all of it, refused before any receive is posted.
                with pytest.raises(EngineError, match=r"model\.norm\.weight.*do not cover"):
                    await c.update_weights_from_p2p(["model.norm.weight"], ["bfloat16"], [[8]], [[[0, 0, 4]]])
                with pytest.raises(EngineError, match="outside shape"):
                    await c.update_weights_from_p2p(["model.norm.weight"], ["bfloat16"], [[8]], [[[0, 0, 9]]])
                with pytest.raises(EngineError, match="no weight update group"):
                    await c.update_weights_from_p2p(
                        ["model.norm.weight"], ["bfloat16"], [[8]], [[[0, 0, 8]]], group_name="nope"
                    )
                with pytest.raises(EngineError, match="no HF tensor"):
                    await c.weights_piece_checksums(["model.nope.weight"], [[[0, 1]]])

        asyncio.run(main())


def test_p2p_against_sglang_engines_falls_back_to_broadcast(tmp_path: Path) -> None:
    from miles_hpc.config import load_config
    from miles_hpc.sync.factory import build_sync
    from miles_hpc.sync.strategies.broadcast import BroadcastSync

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs/tiny_cpu.yaml", ["sync.strategy=p2p", "rollout.backend=sglang"])
    assert isinstance(build_sync(cfg, tmp_path, "127.0.0.1", free_port, trainer=None), BroadcastSync)
    cfg = load_config(repo / "configs/tiny_cpu.yaml", ["sync.strategy=p2p"])
    assert isinstance(
        build_sync(cfg, tmp_path, "127.0.0.1", free_port, trainer=ThreadedRanks(perturbed_weights(0), WORLD)), P2PSync
    )
