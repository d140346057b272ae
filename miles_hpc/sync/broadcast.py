"""Broadcast weight sync, the trainer side (stage: sync; DESIGN section 6).

Trainer rank 0 and every engine rank form one process group (``sync/pg.py``; gloo on CPU, NCCL/RCCL on GPU).
Per bucket of HF-named tensors, rank 0 announces names/dtypes/shapes to every engine with
``/update_weights_from_distributed`` and, concurrently, broadcasts the tensors in that order; the engines receive
and load them. The last bucket carries the new ``weight_version`` and flushes the prefix cache. Afterwards
:meth:`BroadcastSync.verify` compares every engine's per-tensor checksums with the trainer's and stops the run
naming the first tensor that differs.

Invariants: the tensor order of announce and broadcast is the same list; a bucket is never split across the two;
tensors are cast to the rollout dtype before they leave, so the checksum the trainer computes is of exactly the
bytes sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.checksum import tensor_checksum
from miles_hpc.sync.pg import CustomGroup, GroupSpec


class WeightSyncError(RuntimeError):
    """A weight update failed or did not verify; the message names the engine and tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BroadcastSpec:
    master_address: str
    master_port: int
    backend: str = "gloo"
    bucket_bytes: int = 512 << 20
    group_name: str = "weight_update_group"
    rollout_dtype: torch.dtype | None = None  # None: send the trainer's dtype
    timeout_s: float = 300.0


class BroadcastSync:
    """Rank-0 side of the broadcast strategy over ``clients`` (one engine rank each: tp size 1)."""

    def __init__(self, clients: Sequence[EngineClient], spec: BroadcastSpec) -> None:
        self.clients = list(clients)
        self.spec = spec
        self.group: CustomGroup | None = None

    async def connect(self) -> None:
        """Create the group: rank 0 here, engine i at rank 1 + i; the engines join while we do."""
        s = self.spec
        world = 1 + len(self.clients)
        group_spec = GroupSpec(backend=s.backend, master_address=s.master_address, master_port=s.master_port,
                               rank=0, world_size=world, group_name=s.group_name, timeout_s=s.timeout_s)  # fmt: skip
        joins = [
            c.init_weights_update_group(s.master_address, s.master_port, 1 + i, world,
                                        group_name=s.group_name, backend=s.backend)  # fmt: skip
            for i, c in enumerate(self.clients)
        ]
        self.group, *_ = await asyncio.gather(asyncio.to_thread(CustomGroup, group_spec), *joins)

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, str]:
        """Send every tensor of ``named`` in buckets; return the trainer-side checksums of what was sent."""
        if self.group is None:
            raise WeightSyncError("push before connect()")
        sums: dict[str, str] = {}
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        it = iter(named)
        pending = next(it, None)
        while pending is not None:
            name, t = pending
            t = t.detach().to(self.spec.rollout_dtype or t.dtype).contiguous()
            sums[name] = tensor_checksum(t)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            pending = next(it, None)
            if size >= self.spec.bucket_bytes or pending is None:
                await self._send_bucket(bucket, version if pending is None else None, last=pending is None)
                bucket, size = [], 0
        return sums

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
            for c in self.clients
        ]
        results = await asyncio.gather(asyncio.to_thread(send), *announces, return_exceptions=True)
        errors = [(c.url, r) for c, r in zip([None, *self.clients], results) if isinstance(r, BaseException)]
        if errors:
            where, err = errors[0]
            raise WeightSyncError(f"weight update of bucket {names[0]}..{names[-1]} failed on "
                                  f"{where or 'trainer rank 0'}: {err}") from err  # fmt: skip

    async def verify(self, expected: dict[str, str]) -> None:
        """Every engine holds exactly the tensors sent: compare per-tensor checksums (names are HF names)."""
        answers = await asyncio.gather(*(c.weights_checksums() for c in self.clients))
        for client, answer in zip(self.clients, answers):
            got: dict[str, str] = {}
            for rank in answer.ranks:
                got.update(rank.checksums)
            for name, want in expected.items():
                if got.get(name) != want:
                    raise WeightSyncError(
                        f"weight checksum mismatch on {client.url} for tensor {name!r}: "
                        f"trainer {want}, engine {got.get(name, 'missing')}"
                    )

    async def close(self) -> None:
        if self.group is None:
            return
        await asyncio.gather(*(c.destroy_weights_update_group(self.spec.group_name) for c in self.clients),
                             return_exceptions=True)  # fmt: skip
        self.group.destroy()
        self.group = None
