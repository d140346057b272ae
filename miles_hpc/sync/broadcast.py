"""Broadcast weight sync, the trainer side (stage: sync; DESIGN section 6).

Trainer rank 0 and every engine rank form one process group (``sync/pg.py``; gloo on CPU, NCCL/RCCL on GPU).
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.checksum import tensor_checksum
from miles_hpc.sync.pg import GroupSpec, open_group
from miles_hpc.sync.protocol import EngineSyncError, WeightSyncError, verify_checksums

__all__ = ["BroadcastSpec", "BroadcastSync"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BroadcastSpec:
    master_address: str
    next_port: Callable[[], int]  # a free TCP port on master_address, asked once per (re)connect
    backend: str = "gloo"
    bucket_bytes: int = 512 << 20
    group_name: str = "weight_update_group"
    rollout_dtype: torch.dtype | None = None  # None: send the trainer's dtype
    timeout_s: float = 300.0
    mpi_gpu_aware: bool | None = None  # backend "mpi": hand CUDA buffers to MPI (None: detect)


class BroadcastSync:
    """Rank-0 side of the broadcast strategy (engines of tp size 1: one rank each)."""

    name = "broadcast"
    takes_named = True
    verify = staticmethod(verify_checksums)

    def __init__(self, spec: BroadcastSpec) -> None:
        self.spec = spec
        self.group: Any = None  # a CustomGroup, or an MPIGroup for backend "mpi"
        self._clients: list[EngineClient] = []

    @property
    def clients(self) -> Sequence[EngineClient]:
        return tuple(self._clients)

    async def connect(self, clients: Sequence[EngineClient]) -> None:
        """Create the group: rank 0 here, engine i at rank 1 + i; the engines join while we do."""
        await self.close()
        s = self.spec
        port = s.next_port()
        world = 1 + len(clients)
        group_spec = GroupSpec(backend=s.backend, master_address=s.master_address, master_port=port,
                               rank=0, world_size=world, group_name=s.group_name, timeout_s=s.timeout_s)  # fmt: skip
        joins = [
            c.init_weights_update_group(s.master_address, port, 1 + i, world,
                                        group_name=s.group_name, backend=s.backend)  # fmt: skip
            for i, c in enumerate(clients)
        ]
        results = await asyncio.gather(asyncio.to_thread(open_group, group_spec, mpi_gpu_aware=s.mpi_gpu_aware), *joins, return_exceptions=True)
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
            c.update_weights_from_distributed(names, dtypes, shapes, group_name=self.spec.group_name,
                                              weight_version=version, flush_cache=last)  # fmt: skip
            for c in self._clients
        ]
        results = await asyncio.gather(asyncio.to_thread(send), *announces, return_exceptions=True)
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
        await asyncio.gather(*(c.destroy_weights_update_group(self.spec.group_name) for c in self._clients),
                             return_exceptions=True)  # fmt: skip
        self.group.destroy()
        self.group = None
        self._clients = []
