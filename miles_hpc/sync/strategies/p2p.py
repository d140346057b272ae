"""Point-to-point weight sync: every trainer rank sends its own shards straight to the engines (stage: sync;
docs/design.md section 6, strategy "p2p"; the plan is ``planner/transfer.py``).

One process group spans trainer ranks ``0..R-1`` and then each engine's TP ranks (engine ``i`` rank ``r`` at
``R + i * T + r``, SGLang's layout, ``planner.transfer.update_group_ranks``; engines of one tp size ``T``, read
from their ``/get_server_info``). Each engine rank needs its part of each tensor (the engines' own layout,
``engine_layout`` with the KV heads they report): resharded, it receives exactly the pieces of that part, from the
trainer ranks that hold them. Per bucket of HF tensors (``bucket_bytes`` of full tensors, in Hub order), trainer
rank 0 tells each engine which pieces each of its ranks expects from which trainer rank (``/update_weights_from_
p2p``, our extension: ``pieces``, and ``tp_pieces`` per TP rank); meanwhile every trainer rank posts one send per
piece, per engine rank, in plan order, and the engine ranks post the matching receives in the same order. Nothing
is gathered: a trainer rank's link carries its shard bytes times the number of engines, and an engine rank
receives its part only.

The trainer side runs on every trainer rank: the strategy hands the trainer handle (``ShardSource``; the
controller's ``RankedTrainer``, launch/trainer_ranks.py) one of three typed actions, :class:`JoinGroup`,
:class:`PushShards`, :class:`LeaveGroup`, and ``on_every_rank`` runs it on each rank (the action is pickled to the
other ranks) and returns their :class:`RankResult` in rank order. A rank never raises out of an action (its error
comes back in the result), so a failed update never breaks the ranks' command loop.

Verification without a gather: each trainer rank hashes the piece it holds of every tensor (rollout dtype,
``sync.wire.checksum.piece_key`` names), and each engine hashes the same boxes of its tensors
(``/weights_piece_checksums``, our extension); the boxes partition each tensor, so equal piece checksums mean equal
tensors. Real SGLang has no per-rank receive: against it, use ``broadcast`` (docs/weight_sync.md).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from miles_hpc.config import RunConfig
from miles_hpc.planner.transfer import (
    Box,
    EngineRank,
    ShardMap,
    Transfer,
    engine_layout,
    group_rank,
    plan_transfers,
    update_group_ranks,
)
from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.protocol import EngineSyncError, WeightSyncError, engine_tp_sizes, verify_pieces
from miles_hpc.sync.strategies.base import GroupSyncSpec, Strategy, check_group_placement
from miles_hpc.sync.wire.checksum import piece_key, tensor_checksum
from miles_hpc.sync.wire.pg import Backend, GroupSpec, open_group

__all__ = [
    "JoinGroup",
    "LeaveGroup",
    "P2PSync",
    "PushShards",
    "RankResult",
    "RankView",
    "ShardSource",
    "ThreadedRanks",
    "buckets_of",
]


class RankView(Protocol):
    """What an action needs of one trainer rank (a trainer, or a rank of ``ThreadedRanks``)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def shard_map(self) -> ShardMap: ...


R = TypeVar("R")


class ShardSource(Protocol):
    """What the strategy needs of the trainer side (``RankedTrainer`` on trainer rank 0)."""

    @property
    def world_size(self) -> int: ...

    def shard_map(self) -> ShardMap: ...  # rank 0's: shapes, every rank's boxes, rank 0's data

    def on_every_rank(self, action: Callable[[Any], R]) -> list[R]: ...  # results in rank order


@dataclass(frozen=True, slots=True)
class RankResult:
    """One trainer rank's answer to an action: an error message, or (push) its piece checksums."""

    error: str | None = None
    sums: dict[str, str] = field(default_factory=dict)


def buckets_of(shapes: dict[str, tuple[int, ...]], esize: int, bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into buckets of at least ``bucket_bytes`` of full tensors (the last may be smaller)."""
    out: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if size >= bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += esize * _numel(shape)
    return [b for b in out if b]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _by_name(plan: Iterable[Transfer]) -> dict[str, list[Transfer]]:
    out: dict[str, list[Transfer]] = defaultdict(list)
    for t in plan:
        out[t.name].append(t)
    return out


class P2PSync(Strategy):
    """Rank-0 side of the p2p strategy: the group, the engines' announcements, the merged piece checksums."""

    name = "p2p"
    takes_named = False  # every trainer rank sends its own shards; the gathered iterator is never built

    @classmethod
    def check_placement(cls, cfg: RunConfig, trainer_gpus: Sequence[int], engine_gpus: Sequence[int]) -> None:
        check_group_placement(cfg, cls.name, trainer_gpus, engine_gpus)  # every trainer rank sends

    def __init__(self, spec: GroupSyncSpec, trainer: ShardSource) -> None:
        self.spec = spec
        self.group_name = spec.group_name or "p2p_weight_group"
        self.trainer = trainer
        self._clients: list[EngineClient] = []
        self._joined = False
        self._pieces: dict[str, list[Box]] = {}  # boxes of the last push, for verify
        self._tp, self._kv_heads = 1, None  # the engines' TP layout (read at connect)
        self._plans: tuple[tuple[Any, ...], list[list[dict[str, list[Transfer]]]]] | None = None

    @property
    def clients(self) -> Sequence[EngineClient]:
        return tuple(self._clients)

    def _dtype(self, like: torch.dtype) -> torch.dtype:
        return self.spec.rollout_dtype or like

    async def connect(self, clients: Sequence[EngineClient]) -> None:
        await self.close()
        s, world = self.spec, self.trainer.world_size
        tps = await engine_tp_sizes(clients)
        if len(set(tps)) > 1:
            raise WeightSyncError(f"p2p needs engines of one tp size; {[c.url for c in clients]} have {tps}")
        self._tp = tps[0] if tps else 1
        if self._tp > 1:  # each engine rank receives its own part: plan with the engines' own layout
            self._kv_heads = (await clients[0].model_info()).get("layout_kv_heads")
        port = s.next_port()
        size, offsets = update_group_ranks(tps, senders=world)
        join = JoinGroup(
            group_name=self.group_name,
            master_address=s.master_address,
            master_port=port,
            world_size=size,
            backend=s.backend,
            timeout_s=s.timeout_s,
            mpi_gpu_aware=s.mpi_gpu_aware,
        )
        joins = [
            c.init_weights_update_group(
                s.master_address, port, offset, size, group_name=self.group_name, backend=s.backend
            )
            for c, offset in zip(clients, offsets, strict=True)
        ]
        results = await asyncio.gather(
            asyncio.to_thread(self.trainer.on_every_rank, join), *joins, return_exceptions=True
        )
        self._joined, self._clients = True, list(clients)  # close() undoes whatever part did join
        failed = [c.url for c, r in zip(clients, results[1:]) if isinstance(r, BaseException)]
        trainer_errors = _errors(results[0])
        if failed or trainer_errors:
            await self.close()
            err = next((r for r in results[1:] if isinstance(r, BaseException)), None)
            if failed:
                raise EngineSyncError(failed, f"joining the p2p weight group failed on {failed}: {err}")
            raise WeightSyncError(f"creating the p2p weight group failed: {trainer_errors[0]}")

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, str]:
        """Every trainer rank sends its pieces; returns the piece checksums (``piece_key`` -> checksum)."""
        if not self._joined:
            raise WeightSyncError("push before connect()")
        for _ in named:  # the publisher hands p2p an empty iterator (takes_named); never gather anyway
            raise WeightSyncError("p2p sends every rank's own shards: it takes no gathered tensors")
        sm = self.trainer.shard_map()
        replicas = len(self._clients)
        like = next(iter(sm.local.values())).dtype if sm.local else torch.float32
        dtype = self._dtype(like)
        esize = torch.empty((), dtype=dtype).element_size()
        buckets = buckets_of(sm.shapes, esize, self.spec.bucket_bytes)
        tp = self._tp
        expected = await asyncio.to_thread(self._expected, sm, esize, replicas)
        action = PushShards(
            group_name=self.group_name,
            replicas=replicas,
            bucket_bytes=self.spec.bucket_bytes,
            dtype=str(dtype).removeprefix("torch."),
            tp_size=tp,
            kv_heads=self._kv_heads,
        )
        sending = asyncio.ensure_future(asyncio.to_thread(self.trainer.on_every_rank, action))
        failed: list[tuple[str, BaseException]] = []
        dtype_name = str(dtype).removeprefix("torch.")
        try:
            for b, names in enumerate(buckets):
                last = b == len(buckets) - 1
                shapes = [list(sm.shapes[n]) for n in names]
                calls = []
                for e, c in enumerate(self._clients):
                    mine = expected[e % len(expected)]
                    per_rank = [[[_piece(t) for t in mine[r].get(n, ())] for r in range(tp)] for n in names]
                    calls.append(
                        c.update_weights_from_p2p(
                            names,
                            [dtype_name] * len(names),
                            shapes,
                            [ranks[0] for ranks in per_rank],
                            group_name=self.group_name,
                            weight_version=version if last else None,
                            flush_cache=last,
                            tp_pieces=per_rank if tp > 1 else None,
                        )
                    )
                answers = await asyncio.gather(*calls, return_exceptions=True)
                failed = [(c.url, a) for c, a in zip(self._clients, answers) if isinstance(a, BaseException)]
                if failed:
                    break
        finally:
            results = await sending  # the trainer ranks finish (or time out) before anything else happens
        errors = _errors(results)
        if failed:
            url, err = failed[0]
            raise EngineSyncError(
                [u for u, _ in failed],
                f"p2p weight update failed on {url}: {err}" + (f" (trainer: {errors[0]})" if errors else ""),
            )
        if errors:
            raise EngineSyncError([c.url for c in self._clients], f"p2p weight update failed: {errors[0]}")
        merged: dict[str, str] = {}
        for rank, r in enumerate(results):
            for key, value in r.sums.items():
                if merged.setdefault(key, value) != value:
                    raise WeightSyncError(
                        f"trainer ranks disagree on piece {key}: rank {rank} holds {value}, another rank {merged[key]}"
                    )
        self._pieces = defaultdict(list)
        for name in sm.shapes:
            for box in dict.fromkeys(b for b in sm.layout[name] if not b.empty):
                self._pieces[name].append(box)
        return merged

    def _expected(self, sm: ShardMap, esize: int, replicas: int) -> list[list[dict[str, list[Transfer]]]]:
        """What each engine's rank r receives from which trainer rank, ``[replica][r][name]``. Identical copies of a
        piece (Megatron's TP or DP replicas) take turns by destination (`plan_transfers`), so where the trainer
        holds copies each replica has a plan of its own; without copies one plan serves every replica. Cached
        while the shard map, the element size and the engines stay the same (planning the flagship's 32 engine
        ranks takes seconds)."""
        key = (esize, replicas, self._tp, self._kv_heads, _fingerprint(sm))
        if self._plans is not None and self._plans[0] == key:
            return self._plans[1]
        layout = engine_layout(sm.shapes, self._tp, replicas, kv_heads=self._kv_heads)
        copies = any(len({b for b in boxes if not b.empty}) < sum(not b.empty for b in boxes) for boxes in
                     sm.layout.values())  # fmt: skip
        plans = [
            [
                _by_name(plan_transfers(sm.shapes, sm.layout, layout, esize, only=EngineRank(e, r)))
                for r in range(self._tp)
            ]
            for e in range(replicas if copies else 1)
        ]
        self._plans = (key, plans)
        return plans

    async def verify(self, clients: Sequence[EngineClient], expected: dict[str, str]) -> None:
        await verify_pieces(clients, self._pieces, expected)

    async def close(self) -> None:
        if not self._joined:
            return
        clients, self._clients, self._joined = self._clients, [], False
        await asyncio.gather(
            asyncio.to_thread(self.trainer.on_every_rank, LeaveGroup(self.group_name)),
            *(c.destroy_weights_update_group(self.group_name) for c in clients),
            return_exceptions=True,
        )


def _fingerprint(sm: ShardMap) -> int:
    """A hash of the shard map's layout (names, shapes, every rank's boxes): equal layouts plan alike."""
    return hash(tuple((name, tuple(shape), tuple(sm.layout[name])) for name, shape in sm.shapes.items()))


def _piece(t: Transfer) -> list[int]:
    """One expected piece as the engine reads it: [trainer rank, lo0, hi0, lo1, hi1, ...] of its tensor (trainer
    ranks are the first ranks of the group, so a trainer rank is also its group rank)."""
    return [t.src_rank, *(x for d in t.dst_box.dims for x in d)]


def _errors(result: Any) -> list[str]:
    if isinstance(result, BaseException):
        return [f"trainer rank 0: {result}"]
    return [r.error for r in result if r.error]


# ------------------------------------------------------------------------------ every trainer rank
_GROUPS: dict[tuple[str, int], Any] = {}  # (group name, trainer rank): tests run ranks as threads


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinGroup:
    """Every trainer rank joins the p2p group at its own rank (trainer ranks come first in the group)."""

    group_name: str
    master_address: str
    master_port: int
    world_size: int
    backend: Backend
    timeout_s: float
    mpi_gpu_aware: bool | None = None

    def __call__(self, trainer: RankView) -> RankResult:
        def run() -> RankResult:
            rank = trainer.rank
            spec = GroupSpec(
                backend=self.backend,
                master_address=self.master_address,
                master_port=self.master_port,
                rank=rank,
                world_size=self.world_size,
                group_name=self.group_name,
                timeout_s=self.timeout_s,
            )
            _leave(self.group_name, rank)
            device = getattr(trainer, "device", None) if spec.backend != "gloo" else None
            _GROUPS[(self.group_name, rank)] = open_group(spec, device, mpi_gpu_aware=self.mpi_gpu_aware)
            return RankResult()

        return _reported(trainer, run)


@dataclass(frozen=True, kw_only=True, slots=True)
class PushShards:
    """Every trainer rank sends its pieces of every tensor to each of ``replicas`` engines, in plan order."""

    group_name: str
    replicas: int
    bucket_bytes: int
    dtype: str  # the rollout dtype's torch name ("bfloat16")
    tp_size: int = 1  # the engines' (each rank is sent its own part)
    kv_heads: int | None = None  # their layout's KV heads (engine_layout's kv_heads)

    def __call__(self, trainer: RankView) -> RankResult:
        def run() -> RankResult:
            group = _GROUPS.get((self.group_name, trainer.rank))
            if group is None:
                raise RuntimeError(f"no p2p group {self.group_name!r} on this rank: join first")
            sums = send_shards(
                group,
                trainer.shard_map(),
                trainer.rank,
                trainer.world_size,
                self.replicas,
                self.bucket_bytes,
                getattr(torch, self.dtype),
                tp=self.tp_size,
                kv_heads=self.kv_heads,
            )
            return RankResult(sums=sums)

        return _reported(trainer, run)


@dataclass(frozen=True, slots=True)
class LeaveGroup:
    """Every trainer rank leaves (destroys its member of) the p2p group."""

    group_name: str

    def __call__(self, trainer: RankView) -> RankResult:
        def run() -> RankResult:
            _leave(self.group_name, trainer.rank)
            return RankResult()

        return _reported(trainer, run)


def _reported(trainer: RankView, run: Callable[[], RankResult]) -> RankResult:
    """``run()``, its error returned (naming the rank) instead of raised: the controller decides."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 (reported to the controller, which decides)
        return RankResult(error=f"trainer rank {trainer.rank}: {type(e).__name__}: {e}")


def _leave(name: str, rank: int) -> None:
    group = _GROUPS.pop((name, rank), None)
    if group is not None:
        group.destroy()


def send_shards(
    group: Any,
    sm: Any,
    rank: int,
    world: int,
    replicas: int,
    bucket_bytes: int,
    dtype: torch.dtype,
    *,
    tp: int = 1,
    kv_heads: int | None = None,
) -> dict[str, str]:
    """Post this rank's sends bucket by bucket (each bucket waited on before the next), hashing each held piece
    in worker threads meanwhile; returns ``piece_key`` -> checksum of the pieces this rank holds. Engines of TP
    ``tp``: each engine rank is sent the pieces of its own part (group rank ``world + replica * tp + rank``)."""
    esize = torch.empty((), dtype=dtype).element_size()
    layout = engine_layout(sm.shapes, tp, replicas, kv_heads=kv_heads)
    plan = _by_name(plan_transfers(sm.shapes, sm.layout, layout, esize, only=rank))
    sums: dict[str, Future[str]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for names in buckets_of(sm.shapes, esize, bucket_bytes):
            sends: list[tuple[torch.Tensor, int]] = []
            for name in names:
                if name not in sm.local:
                    continue
                # No copy when already in the rollout dtype: the rank is inside this call until every send and
                # hash is done, so nothing (no optimizer step) changes its parameters meanwhile.
                src = sm.local[name].detach().to(device=group.device, dtype=dtype)
                box = sm.layout[name][rank]
                sums[piece_key(name, box.dims)] = pool.submit(tensor_checksum, src)
                for t in plan.get(name, ()):
                    sends.append((src[t.src_box.slices()].contiguous(), group_rank(t.dst, world=world, tp_size=tp)))
            group.exchange(sends, [])
        return {k: f.result() for k, f in sums.items()}


# ------------------------------------------------------------------------------ ranks as threads
class _ThreadRank:
    def __init__(self, owner: ThreadedRanks, rank: int) -> None:
        self.owner, self.rank, self.world_size = owner, rank, owner.world_size

    def shard_map(self) -> ShardMap:
        o, r = self.owner, self.rank
        local = {n: t[o.layout[n][r].slices()] for n, t in o.named.items() if not o.layout[n][r].empty}
        return ShardMap(o.shapes, o.layout, local)


class ThreadedRanks:
    """``world`` trainer ranks as threads of this process over fixed HF-named tensors, each holding FSDP2's dim-0
    chunks (or the boxes ``layout`` gives, e.g. whole copies as Megatron's DP replicas hold): the trainer side of p2p without a trainer (tests, benchmarks). ``p2p`` runs an action on every rank at
    once, as ``RankedTrainer`` does across processes; each rank has its own group member."""

    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        world: int,
        layout: Callable[[dict[str, tuple[int, ...]], int], Any] | None = None,
    ) -> None:
        self.world_size = world
        self._layout_of = layout  # (shapes, world) -> every rank's boxes; None: FSDP2's dim-0 chunks
        self.set_weights(named)
        self._ranks = [_ThreadRank(self, r) for r in range(world)]

    def set_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        from miles_hpc.planner.transfer import fsdp_layout

        self.named = dict(named)
        self.shapes = {n: tuple(t.shape) for n, t in self.named.items()}
        self.layout = (self._layout_of or fsdp_layout)(self.shapes, self.world_size)

    def shard_map(self) -> Any:
        return self._ranks[0].shard_map()

    def rank_view(self, rank: int) -> RankView:
        """Rank ``rank`` as an action sees it (``rank``, ``world_size``, ``shard_map()``)."""
        return self._ranks[rank]

    def on_every_rank(self, action: Callable[[Any], R]) -> list[R]:
        with ThreadPoolExecutor(max_workers=self.world_size) as pool:
            return list(pool.map(action, self._ranks))
