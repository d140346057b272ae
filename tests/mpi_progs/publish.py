"""mpirun --ompi-server file:URI -np 2 python publish.py MODEL_DIR PORT_DIR ADMIN_KEY URL [URL ...]

The trainer side of weight sync over MPI, against real `miles-hpc serve` engines started by their own mpirun (same
ompi-server): every process is its own MPI job, joined by connect/accept (sync/wire/pg.py open_group, backend "mpi").
1. broadcast: trainer rank 0 publishes two versions to every engine through the Publisher (pause, push, verify
   per-tensor checksums, continue);
2. p2p: both ranks are trainer ranks, each holding dim-0 chunks of the weights; rank 0 drives P2PSync, rank 1
   runs the actions rank 0 sends it over COMM_WORLD (what RankedTrainer does over torch.distributed); verified
   per piece. Rank 0 then compares every engine's whole-tensor checksums with the trainer's tensors.
Each rank prints one RESULT line.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import torch
from common import report
from mpi4py import MPI

from miles_hpc.launch.local import free_port
from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies.base import GroupSyncSpec
from miles_hpc.sync.strategies.broadcast import BroadcastSync
from miles_hpc.sync.strategies.p2p import P2PSync, PushShards, ThreadedRanks
from miles_hpc.sync.wire.checksum import tensor_checksum

model_dir, port_dir, admin, urls = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
world = MPI.COMM_WORLD
rank = world.Get_rank()


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    model = load_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return [(n, t.to(torch.bfloat16).clone()) for n, t in iter_hf_tensors(model)]


class MPIRanks:
    """Rank 0's handle on the trainer ranks of this mpirun (COMM_WORLD carries the commands, not the tensors)."""

    def __init__(self, ranks: ThreadedRanks) -> None:
        self.ranks, self.world_size = ranks, world.Get_size()

    def shard_map(self) -> Any:
        return self.ranks.rank_view(0).shard_map()

    def on_every_rank(self, action: Any) -> list[Any]:
        world.bcast(action, root=0)
        return world.gather(action(self.ranks.rank_view(0)), root=0)


async def engine_sums(clients: list[EngineClient]) -> list[dict[str, str]]:
    return [(await c.weights_checksums()).ranks[0].checksums for c in clients]


async def drive() -> dict[str, Any]:
    clients = [EngineClient(u, admin_api_key=admin, connect_retries=0) for u in urls]
    out: dict[str, Any] = {}
    async with Router(clients, RouterConfig(health_interval_s=60), owns_clients=True) as router:
        spec = dict(master_address=port_dir, next_port=free_port, backend="mpi", bucket_bytes=1 << 16, timeout_s=60)
        bsync = BroadcastSync(GroupSyncSpec(**spec, group_name="bcast"))  # type: ignore[arg-type]
        try:
            for version in ("1", "2"):
                named = weights(int(version))
                await Publisher(bsync, router, pause_mode="in_place").publish(lambda: iter(named), version)
                want = {n: tensor_checksum(t) for n, t in named}
                out[f"broadcast_v{version}_ok"] = all(s == want for s in await engine_sums(clients))
        finally:
            await bsync.close()
        ranks = ThreadedRanks(weights(3), world.Get_size())
        psync = P2PSync(GroupSyncSpec(**spec, group_name="p2p", rollout_dtype=torch.bfloat16), MPIRanks(ranks))
        try:
            report_ = await Publisher(psync, router, pause_mode="in_place").publish(lambda: iter(()), "3")
            want = {n: tensor_checksum(t) for n, t in ranks.named.items()}
            out["p2p_ok"] = all(s == want for s in await engine_sums(clients))
            out["p2p_pieces"] = report_.tensors
            out["versions"] = [str((await c.model_info())["weight_version"]) for c in clients]
        finally:
            await psync.close()
    return out


if rank == 0:
    try:
        fields = asyncio.run(drive())
    finally:
        world.bcast(None, root=0)  # release rank 1
    report(rank=rank, **fields)
else:
    ranks = ThreadedRanks(weights(3), world.Get_size())
    sent = 0
    while (action := world.bcast(None, root=0)) is not None:
        world.gather(action(ranks.rank_view(rank)), root=0)
        sent += isinstance(action, PushShards)
    report(rank=rank, pushes=sent)
