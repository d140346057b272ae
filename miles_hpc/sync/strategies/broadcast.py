"""Broadcast weight sync, the trainer side (stage: sync; docs/design.md section 6).

Trainer rank 0 and every engine rank (each engine's TP ranks, SGLang's layout) form one process group (``sync/wire/pg.py``; gloo on CPU, NCCL/RCCL on GPU).
Per bucket of HF-named tensors, rank 0 announces names/dtypes/shapes to every engine with
``/update_weights_from_distributed`` and, concurrently, broadcasts the tensors in that order; the engines receive
and load them. The last bucket carries the new ``weight_version`` and flushes the prefix cache. Verification and
the pause/continue cycle are the publisher's (publish.py).

Invariants: the tensor order of announce and broadcast is the same list; a bucket is never split across the two;
tensors are cast to the rollout dtype before they leave, so the checksum the trainer computes is of exactly the
bytes sent. A group spans exactly `clients`: `connect` with another set destroys it and builds a new one (on a
fresh port: a TCPStore port is not reused). An engine whose announce fails makes the bucket fail with an
`EngineSyncError` naming it (the group is then unusable: the publisher reconnects without that engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

import torch

from miles_hpc.config import RunConfig
from miles_hpc.planner.transfer import update_group_ranks
from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.protocol import EngineSyncError, WeightSyncError, engine_tp_sizes, verify_checksums
from miles_hpc.sync.strategies.base import GroupSyncSpec, Strategy, check_group_placement
from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.pg import GroupSpec, open_group

__all__ = ["BroadcastSync"]


class BroadcastSync(Strategy):
    """Rank-0 side of the broadcast strategy (into engines of any tp size)."""

    name = "broadcast"
    takes_named = True
    verify = staticmethod(verify_checksums)

    @classmethod
    def check_placement(cls, cfg: RunConfig, trainer_gpus: Sequence[int], engine_gpus: Sequence[int]) -> None:
        check_group_placement(cfg, cls.name, trainer_gpus[:1], engine_gpus)  # trainer rank 0 alone sends

    def __init__(self, spec: GroupSyncSpec) -> None:
        self.spec = spec
        self.group_name = spec.group_name or "weight_update_group"
        self.group: Any = None  # a CustomGroup, or an MPIGroup for backend "mpi"
        self._clients: list[EngineClient] = []

    @property
    def clients(self) -> Sequence[EngineClient]:
        return tuple(self._clients)

    async def connect(self, clients: Sequence[EngineClient]) -> None:
        """Create the group as SGLang lays it out: rank 0 here, then each engine's TP ranks at its
        ``rank_offset + tp_rank`` (`planner.transfer.update_group_ranks`; each engine says its ``tp_size`` in
        ``/get_server_info``); the engines join while we do, every rank of one receiving each broadcast."""
        await self.close()
        s = self.spec
        port = s.next_port()
        world, offsets = update_group_ranks(await engine_tp_sizes(clients))
        group_spec = GroupSpec(
            backend=s.backend,
            master_address=s.master_address,
            master_port=port,
            rank=0,
            world_size=world,
            group_name=self.group_name,
            timeout_s=s.timeout_s,
        )
        joins = [
            c.init_weights_update_group(
                s.master_address, port, offset, world, group_name=self.group_name, backend=s.backend
            )
            for c, offset in zip(clients, offsets, strict=True)
        ]
        results = await asyncio.gather(
            asyncio.to_thread(open_group, group_spec, mpi_gpu_aware=s.mpi_gpu_aware), *joins, return_exceptions=True
        )
        failed = [c.url for c, r in zip(clients, results[1:]) if isinstance(r, BaseException)]
        if isinstance(results[0], BaseException) or failed:
            if not isinstance(results[0], BaseException):
                results[0].destroy()
            err = next(r for r in results if isinstance(r, BaseException))
            if failed:
                raise EngineSyncError(failed, f"joining the weight update group failed on {failed}: {err}") from err
            raise WeightSyncError(f"creating the weight update group on trainer rank 0 failed: {err}") from err
        self.group = results[0]
        self._clients = list(clients)

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, str]:
        """Send every tensor of ``named`` in buckets; return the trainer-side checksums of what was sent."""
        if self.group is None:
            raise WeightSyncError("push before connect()")
        # Checksums are computed in worker threads while the buckets go out (hashing a CPU copy at ~0.7 GB/s would
        # otherwise double a CPU push); the tensors they read are the sent copies, never changed afterwards.
        sums: dict[str, asyncio.Future[str]] = {}
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        it = iter(named)
        pending = next(it, None)
        loop = asyncio.get_running_loop()
        try:
            while pending is not None:
                name, t = pending
                t = t.detach().to(self.spec.rollout_dtype or t.dtype).contiguous()
                if t is pending[1]:
                    t = t.clone()  # the caller may change its tensor once we return: hash and send our copy
                sums[name] = loop.run_in_executor(None, tensor_checksum, t)
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                pending = next(it, None)
                if size >= self.spec.bucket_bytes or pending is None:
                    await self._send_bucket(bucket, version if pending is None else None, last=pending is None)
                    bucket, size = [], 0
            return dict(zip(sums, await asyncio.gather(*sums.values())))
        finally:
            await asyncio.gather(*sums.values(), return_exceptions=True)  # no hash outlives the push

    async def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str | None, *, last: bool) -> None:
        names = [n for n, _ in bucket]
        dtypes = [t.dtype for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        group = self.group
        assert group is not None

        def send() -> None:
            for _, t in bucket:
                group.broadcast(t.to(group.device), src=0)

        announces = [
            c.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self.group_name, weight_version=version, flush_cache=last
            )
            for c in self._clients
        ]
        results = await _all_or_break(asyncio.to_thread(send), announces, group, self.spec.timeout_s)
        failed = [(c.url, r) for c, r in zip(self._clients, results[1:]) if isinstance(r, BaseException)]
        span = f"{names[0]}..{names[-1]}"
        if failed:
            url, err = failed[0]
            raise EngineSyncError([u for u, _ in failed], f"weight update of bucket {span} failed on {url}: {err}")
        if isinstance(results[0], BaseException):
            raise WeightSyncError(f"broadcast of bucket {span} failed on trainer rank 0: {results[0]}") from results[0]

    async def close(self) -> None:
        if self.group is None:
            return
        await asyncio.gather(
            *(c.destroy_weights_update_group(self.group_name) for c in self._clients), return_exceptions=True
        )
        self.group.destroy()
        self.group = None
        self._clients = []


async def _all_or_break(
    send: Awaitable[None], announces: Sequence[Awaitable[Any]], group: Any, timeout_s: float
) -> list[Any]:
    """The trainer's broadcast and every engine's announce of one bucket, as results or exceptions. When one of them
    fails (an engine died mid-bucket), the group is destroyed on this side at once: the engines still waiting in the
    broadcast then fail on the closed connection instead of waiting out their receive timeout."""
    tasks = [asyncio.ensure_future(send), *(asyncio.ensure_future(a) for a in announces)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    if pending and any(not t.cancelled() and t.exception() is not None for t in done):
        await asyncio.to_thread(group.destroy)
        await asyncio.wait(pending, timeout=timeout_s)
        for t in pending:
            t.cancel()
    results: list[Any] = []
    for t in tasks:
        if t.cancelled():
            results.append(asyncio.CancelledError("the bucket's broadcast broke"))
        else:
            results.append(t.exception() or t.result())
    return results
