"""The point-to-point weight-sync plan, as pure functions (stage: planner; docs/weight_sync.md, strategy "p2p").

Model. Every tensor is named by its HF name and has a global shape. A *box* is a half-open N-d region of it,
``((start, stop), ...)`` per dim. Trainer rank ``s`` holds one box of each tensor (:func:`fsdp_layout`: FSDP2's
dim-0 ``torch.chunk`` shards, the last ranks possibly empty); engine rank ``(replica, rank)`` needs one box
(:func:`engine_layout`: column/row/vocab/expert parallel slices by rules). :func:`plan_transfers` intersects the
two: each non-empty intersection is one :class:`Transfer`, with three views of the same elements: ``global_box``
(tensor coordinates), ``src_box`` (relative to the box the source holds: index its local shard with it) and
``dst_box`` (relative to the box the destination needs: index the slice of the HF tensor that rank loads).

Invariants. The held boxes of a tensor partition it (ranks may hold identical copies, as Megatron's TP ranks hold a
norm: the copies take turns by destination), so every element an engine rank needs arrives exactly once. A trainer
rank sends each element it holds once to each engine rank that needs it, never more: for the split kinds (one rank
per replica needs each element) at most its shard bytes x replicas, the bound of the p2p design; replicated tensors
(norms, biases, router gates: well under 1% of the bytes) go to all ``tp_size`` ranks of each replica. Nothing is
gathered at trainer rank 0.

Use. Senders and receivers do not negotiate: every process computes the plan from the same inputs (shapes in the
same order, the same layouts) and keeps its own part (``plan_transfers(..., only=rank)``, or :func:`sends_of` /
:func:`recvs_of` of the full plan); it posts one isend/irecv per transfer in plan order
(``torch.distributed.batch_isend_irecv``), so between any two peers both sides list their operations in the same
order, which is how NCCL and MPI pair them. A transport may instead pack one link's pieces, in plan order, into one
buffer of :func:`link_bytes` bytes (FSDP2 cuts each of a MoE's thousands of experts into ``world`` pieces).
:func:`group_rank` numbers the p2p group: trainer ranks first, then engine ranks replica-major. The receiver copies
each piece into ``dst_box`` of its slice; fusing slices into its parameters (qkv, gate_up, stacked experts, a
padded vocab shard, which starts at the slice's first row) is the loader's business, as in SGLang's
``weight_loader``.

Engines. Our embedded engine implements the per-rank receive (``sync/strategies/p2p.py``, any tp size: each TP rank
receives its own part). SGLang 0.5.x, as far as we know, takes updates over
HTTP only as a broadcast group (``/update_weights_from_distributed``) or in-process tensors
(``/update_weights_from_tensor``) and has no per-rank receive endpoint, so against SGLang the p2p strategy falls
back to broadcast (``sync/factory.py``). (RDMA writes into registered SGLang memory are in progress upstream; this
plan could drive them, but we do not implement that.)
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

Kind = Literal["column", "row", "vocab", "kv", "replicated", "expert"]
Within = Literal["column", "row", "replicated"]


class PlanError(ValueError):
    """A layout or plan input is inconsistent; the message names the tensor."""


@dataclass(frozen=True, slots=True)
class Box:
    """A half-open N-d box: ``dims[i] == (start, stop)`` along dim ``i``. A 0-d box is a scalar's one element."""

    dims: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        for lo, hi in self.dims:
            if not 0 <= lo <= hi:
                raise ValueError(f"bad box extent ({lo}, {hi}) in {self.dims}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple((0, int(n)) for n in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.dims)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when it is empty."""
        if len(self.dims) != len(other.dims):
            raise ValueError(f"boxes of different rank: {self.dims} and {other.dims}")
        dims = []
        for (a, b), (c, d) in zip(self.dims, other.dims, strict=True):
            lo, hi = max(a, c), min(b, d)
            if lo >= hi:
                return None
            dims.append((lo, hi))
        return Box(tuple(dims))

    def contains(self, other: Box) -> bool:
        return len(self.dims) == len(other.dims) and all(
            a <= c and d <= b for (a, b), (c, d) in zip(self.dims, other.dims, strict=True)
        )

    def relative_to(self, origin: Box) -> Box:
        """This box in the local coordinates of a tensor that holds ``origin`` (which must contain it)."""
        if not origin.contains(self):
            raise ValueError(f"{self.dims} is not inside {origin.dims}")
        return Box(tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(self.dims, origin.dims, strict=True)))

    def with_dim(self, dim: int, lo: int, hi: int) -> Box:
        return Box(self.dims[:dim] + ((lo, hi),) + self.dims[dim + 1 :])

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor with this: ``t[box.slices()]``."""
        return tuple(slice(lo, hi) for lo, hi in self.dims)


@dataclass(frozen=True, slots=True)
class ShardMap:
    """What one trainer rank knows of the layout: HF name -> global shape, the box every rank holds, and this rank's
    data (a tensor per HF name it holds any of; absent where it holds nothing). The trainer builds it
    (``train/shards.py`` for FSDP2, ``train/mcore_weights.py`` for megatron); the p2p strategy sends from it."""

    shapes: dict[str, tuple[int, ...]]
    layout: dict[str, tuple[Box, ...]]
    local: dict[str, Any]


@dataclass(frozen=True, order=True, slots=True)
class EngineRank:
    """Tensor-parallel ``rank`` of engine ``replica``; orders replica-major."""

    replica: int
    rank: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """One piece of tensor ``name`` from trainer rank ``src_rank`` to engine rank ``dst`` (coordinates: module doc)."""

    name: str
    src_rank: int
    dst: EngineRank
    src_box: Box
    dst_box: Box
    global_box: Box
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitRule:
    """Tensors whose name ``re.search``-matches ``pattern`` are split as ``kind`` on the engine ranks.

    column, kv: dim 0 in ``tp_size`` equal parts (kv: per KV head when there are fewer heads than ranks, SGLang's
    head replication); row: dim 1 in equal parts; vocab: dim 0, padded to ``vocab_pad_to``, in blocks (the last ranks
    get fewer rows, or none); replicated: whole tensor on every rank; expert: group 1 of ``pattern`` is the expert
    index, the owning expert-parallel group of ``tp_size // ep_size`` ranks needs it, split among them as ``within``.
    """

    pattern: str
    kind: Kind
    within: Within = "replicated"

    def __post_init__(self) -> None:
        if self.kind not in get_args(Kind) or self.within not in get_args(Within):
            raise ValueError(
                f"rule {self.pattern!r}: kind must be one of {get_args(Kind)} and within one of "
                f"{get_args(Within)}; got {self.kind!r}, {self.within!r}"
            )
        if self.kind == "expert" and re.compile(self.pattern).groups < 1:
            raise ValueError(f"expert rule {self.pattern!r} needs a group capturing the expert index")


# First match wins; experts precede the dense projections whose names they contain.
DEFAULT_TP_RULES: tuple[SplitRule, ...] = (
    SplitRule(pattern=r"\.experts\.(\d+)\.(gate_proj|up_proj|w1|w3)\.weight$", kind="expert", within="column"),
    SplitRule(pattern=r"\.experts\.(\d+)\.(down_proj|w2)\.weight$", kind="expert", within="row"),
    SplitRule(pattern=r"\.(k_proj|v_proj)\.(weight|bias)$", kind="kv"),
    SplitRule(pattern=r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.(weight|bias)$", kind="column"),
    SplitRule(pattern=r"\.(o_proj|down_proj)\.weight$", kind="row"),
    SplitRule(pattern=r"(^|\.)(embed_tokens|lm_head)\.weight$", kind="vocab"),
    SplitRule(pattern=r"norm\.weight$|\.mlp\.gate\.weight$|_correction_bias$|\.bias$", kind="replicated"),
    SplitRule(pattern=r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", kind="replicated"),  # MLA's low-rank inputs
)

TrainerLayout = Mapping[str, Sequence[Box]]  # name -> the box each trainer rank holds (index = rank)
EngineLayout = Mapping[str, Mapping[EngineRank, Box]]  # name -> the box each engine rank needs (absent: nothing)
ExpertOwner = Callable[[int, int, int], int]  # (expert, num_experts, ep_size) -> expert-parallel rank


def contiguous_experts(expert: int, num_experts: int, ep_size: int) -> int:
    """SGLang's placement: ep rank ``i`` owns experts ``[i * E/ep, (i + 1) * E/ep)``."""
    return expert // (num_experts // ep_size)


def fsdp_layout(shapes: Mapping[str, Sequence[int]], world: int) -> dict[str, tuple[Box, ...]]:
    """FSDP2's shards: rank ``r`` holds dim-0 rows ``[r*c, (r+1)*c)`` clipped to the tensor, ``c = ceil(n/world)``.

    Tensors of one shape share one tuple (a MoE has thousands of same-shape experts; :func:`plan_transfers`
    then checks and indexes each distinct tuple once).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    by_shape: dict[tuple[int, ...], tuple[Box, ...]] = {}
    out: dict[str, tuple[Box, ...]] = {}
    for name, shape in shapes.items():
        if len(shape) == 0:
            raise PlanError(f"{name}: FSDP2 shards along dim 0; a 0-d tensor has none")
        if (key := tuple(shape)) not in by_shape:
            n, full, c = shape[0], Box.full(shape), -(-shape[0] // world)
            by_shape[key] = tuple(full.with_dim(0, min(n, r * c), min(n, (r + 1) * c)) for r in range(world))
        out[name] = by_shape[key]
    return out


def _tp_boxes(
    name: str, shape: Sequence[int], kind: str, tp: int, *, kv_heads: int | None, vocab_pad_to: int, strict: bool
) -> list[Box]:
    """The box each of ``tp`` ranks needs of one tensor split as ``kind`` (empty boxes for ranks needing nothing)."""
    full = Box.full(shape)
    if kind == "replicated" or tp == 1:
        return [full] * tp
    dim = 1 if kind == "row" else 0
    if len(shape) <= dim:
        raise PlanError(f"{name}: a {kind}-parallel tensor needs a dim {dim}, shape is {tuple(shape)}")
    n = shape[dim]
    if kind == "vocab":
        padded = -(-n // vocab_pad_to) * vocab_pad_to
        if padded % tp and strict:
            raise PlanError(
                f"{name}: vocab dim {n} (padded to {padded}) is not divisible by tp_size {tp}; "
                "strict=False splits it in blocks (chunk semantics)"
            )
        block = -(-padded // tp)
        spans = [(min(n, r * block), min(n, (r + 1) * block)) for r in range(tp)]
    elif kind == "kv" and kv_heads is not None:  # whole heads per rank; fewer heads than ranks: copies of one head
        if (tp % kv_heads if kv_heads < tp else kv_heads % tp) or n % kv_heads:
            raise PlanError(
                f"{name}: {kv_heads} KV heads (dim 0 = {n}) neither split nor replicate evenly over tp_size {tp}"
            )
        copies, rows = max(1, tp // kv_heads), n // kv_heads * max(1, kv_heads // tp)
        spans = [(r // copies * rows, (r // copies + 1) * rows) for r in range(tp)]
    else:
        if n % tp:
            raise PlanError(
                f"{name}: dim {dim} of shape {tuple(shape)} does not split evenly into {tp} {kind}-parallel parts"
            )
        per = n // tp
        spans = [(r * per, (r + 1) * per) for r in range(tp)]
    return [full.with_dim(dim, lo, hi) for lo, hi in spans]


def engine_layout(
    shapes: Mapping[str, Sequence[int]],
    tp_size: int,
    replicas: int,
    *,
    rules: Sequence[SplitRule] = DEFAULT_TP_RULES,
    ep_size: int = 1,
    strict: bool = False,
    kv_heads: int | None = None,
    vocab_pad_to: int = 1,
    num_experts: int | None = None,
    expert_owner: ExpertOwner = contiguous_experts,
) -> dict[str, dict[EngineRank, Box]]:
    """What each engine rank needs, in global coordinates; ranks that need nothing of a tensor are absent.

    ``strict``: every tensor must match a rule and vocab splits must be even (otherwise an unmatched tensor is
    replicated and an uneven vocab is split in blocks).
    ``num_experts``: per MoE layer; None counts the expert indices present in ``shapes`` per layer prefix.
    ``vocab_pad_to``: SGLang pads the vocab to a multiple of 64 before splitting; 1 gives ``torch.chunk`` blocks.
    """
    if min(tp_size, replicas, ep_size, vocab_pad_to) < 1 or tp_size % ep_size:
        raise ValueError(
            f"need tp_size, replicas, ep_size, vocab_pad_to >= 1 and ep_size | tp_size; got {tp_size}, "
            f"{replicas}, {ep_size}, {vocab_pad_to}"
        )
    moe_tp = tp_size // ep_size
    matched: dict[str, tuple[SplitRule | None, re.Match[str] | None]] = {}
    counts: dict[str, int] = defaultdict(int)  # expert-layer prefix -> 1 + largest expert index seen
    for name in shapes:
        rule, m = next(((r, m) for r in rules if (m := re.search(r.pattern, name))), (None, None))
        if rule is None and strict:
            raise PlanError(f"{name}: no split rule matches (strict=True); add a SplitRule for it")
        matched[name] = (rule, m)
        if rule is not None and rule.kind == "expert" and m is not None:
            counts[name[: m.start(1)]] = max(counts[name[: m.start(1)]], int(m.group(1)) + 1)

    out: dict[str, dict[EngineRank, Box]] = {}
    for name, shape in shapes.items():
        rule, m = matched[name]
        kind = "replicated" if rule is None else rule.kind
        if kind == "expert" and rule is not None and m is not None:
            expert, total = int(m.group(1)), num_experts or counts[name[: m.start(1)]]
            if total % ep_size:
                raise PlanError(f"{name}: {total} experts do not split evenly over ep_size {ep_size}")
            owner = expert_owner(expert, total, ep_size)
            if not 0 <= owner < ep_size:
                raise PlanError(f"{name}: expert_owner gave ep rank {owner}, outside [0, {ep_size})")
            inner = _tp_boxes(name, shape, rule.within, moe_tp, kv_heads=None, vocab_pad_to=1, strict=strict)
            one = {owner * moe_tp + j: box for j, box in enumerate(inner)}
        else:
            boxes = _tp_boxes(name, shape, kind, tp_size, kv_heads=kv_heads, vocab_pad_to=vocab_pad_to, strict=strict)
            one = dict(enumerate(boxes))
        out[name] = {EngineRank(e, r): b for e in range(replicas) for r, b in one.items() if not b.empty}
    return out


class _Holdings:
    """The distinct boxes held of one tensor (checked to partition it), indexed by dim-0 extent for overlap search."""

    def __init__(self, name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
        full, groups = Box.full(shape), defaultdict(list)
        for rank, box in enumerate(boxes):
            if not full.contains(box):
                raise PlanError(f"{name}: trainer rank {rank} holds {box.dims}, outside shape {tuple(shape)}")
            if not box.empty:
                groups[box].append(rank)
        self.boxes = sorted(groups, key=lambda b: b.dims)  # by dim-0 start first, as the overlap search needs
        self.ranks = [tuple(groups[b]) for b in self.boxes]
        self.index_of = {r: i for i, ranks in enumerate(self.ranks) for r in ranks}
        self.starts = [_span0(b)[0] for b in self.boxes]
        self.max_stop = list(itertools.accumulate((_span0(b)[1] for b in self.boxes), max))
        for i, box in enumerate(self.boxes):
            for j, _ in self.overlapping(box):
                if j != i:
                    raise PlanError(
                        f"{name}: trainer ranks {self.ranks[i]} and {self.ranks[j]} hold partly "
                        f"overlapping boxes {box.dims} and {self.boxes[j].dims}"
                    )
        held = sum(b.numel for b in self.boxes)
        if held != full.numel:
            raise PlanError(f"{name}: trainer ranks hold {held} of its {full.numel} elements; they must cover it")

    def overlapping(self, need: Box, rank: int | None = None) -> list[tuple[int, Box]]:
        """(index, intersection) of every distinct held box meeting ``need`` (only ``rank``'s box, if given)."""
        if rank is not None:
            found = [] if (i := self.index_of.get(rank)) is None else [(i, self.boxes[i].intersect(need))]
        else:
            lo, hi = _span0(need)
            found = []
            for i in range(bisect.bisect_left(self.starts, hi) - 1, -1, -1):  # boxes starting before hi
                if self.max_stop[i] <= lo:  # none at or before i reaches past lo
                    break
                found.append((i, self.boxes[i].intersect(need)))
        return [(i, g) for i, g in found if g is not None]


def _span0(box: Box) -> tuple[int, int]:
    return box.dims[0] if box.dims else (0, 1)


def _shift(box: Box, origin: Box) -> Box:
    return Box(tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box.dims, origin.dims, strict=True)))


def plan_transfers(
    shapes: Mapping[str, Sequence[int]],
    trainer_layout: TrainerLayout,
    engine_layout: EngineLayout,
    dtype_bytes: int | Mapping[str, int],
    *,
    only: int | EngineRank | None = None,
) -> list[Transfer]:
    """Every piece each trainer rank sends to each engine rank, ordered by name (as in ``shapes``), dst, src.

    ``dtype_bytes``: element size, for all tensors or per name. ``only``: just the part one trainer rank (int) or
    engine rank takes part in, the same sub-list :func:`per_rank_ops` takes of the full plan, without building
    the rest (the full plan of a large MoE has millions of pieces; each rank needs only its own).
    """
    unknown = [n for n in engine_layout if n not in shapes]
    if unknown:
        raise PlanError(f"{unknown[0]}: engines need it but it is not in shapes")
    plan: list[Transfer] = []
    # A layout sequence shared by several tensors is checked and indexed once; the cache keeps it alive, so its id
    # cannot be reused by another object during this call.
    checked: dict[tuple[int, tuple[int, ...]], tuple[Sequence[Box], _Holdings]] = {}
    for name, shape in shapes.items():
        if name not in trainer_layout:
            raise PlanError(f"{name}: no trainer layout for it")
        boxes = trainer_layout[name]
        key = (id(boxes), tuple(shape))
        if key not in checked:
            checked[key] = (boxes, _Holdings(name, shape, boxes))
        held, full = checked[key][1], Box.full(shape)
        esize = dtype_bytes if isinstance(dtype_bytes, int) else dtype_bytes[name]
        needs = engine_layout.get(name, {})
        dsts = sorted(needs) if not isinstance(only, EngineRank) else [only] if only in needs else []
        for dst in dsts:
            need = needs[dst]
            if not full.contains(need):
                raise PlanError(f"{name}: engine rank {dst} needs {need.dims}, outside shape {tuple(shape)}")
            pieces = []
            for i, g in held.overlapping(need, only if isinstance(only, int) else None):
                # Identical copies (Megatron TP/DP replicas) take turns by destination and box to share the load.
                copies = held.ranks[i]
                src = copies[(dst.replica + dst.rank + i) % len(copies)]
                if only is None or isinstance(only, EngineRank) or src == only:
                    pieces.append(
                        Transfer(
                            name=name,
                            src_rank=src,
                            dst=dst,
                            src_box=_shift(g, held.boxes[i]),
                            dst_box=_shift(g, need),
                            global_box=g,
                            nbytes=g.numel * esize,
                        )
                    )
            plan.extend(sorted(pieces, key=lambda t: (t.src_rank, t.global_box.dims)))
    return plan


def sends_of(plan: Iterable[Transfer], src: int) -> list[Transfer]:
    """Trainer rank ``src``'s isends, in plan order."""
    return [t for t in plan if t.src_rank == src]


def recvs_of(plan: Iterable[Transfer], dst: EngineRank) -> list[Transfer]:
    """Engine rank ``dst``'s irecvs, in plan order."""
    return [t for t in plan if t.dst == dst]


def per_rank_ops(plan: Iterable[Transfer], rank: int | EngineRank) -> list[Transfer]:
    """The transfers ``rank`` takes part in: sends for a trainer rank (int), receives for an engine rank."""
    return recvs_of(plan, rank) if isinstance(rank, EngineRank) else sends_of(plan, rank)


def group_rank(rank: int | EngineRank, *, world: int, tp_size: int) -> int:
    """Rank in the p2p process group: trainer ranks ``0..world-1``, then engine ranks replica-major."""
    return world + rank.replica * tp_size + rank.rank if isinstance(rank, EngineRank) else rank


def update_group_ranks(tp_sizes: Sequence[int], senders: int = 1) -> tuple[int, list[int]]:
    """SGLang's weight-update group: the ``senders`` trainer ranks first, then engine ``i``'s TP ranks at
    ``rank_offset_i + tp_rank``; returns (world size, each engine's ``rank_offset``)."""
    if senders < 1 or any(t < 1 for t in tp_sizes):
        raise ValueError(f"senders and every engine's tp size must be >= 1, got {senders}, {list(tp_sizes)}")
    offsets = list(itertools.accumulate(tp_sizes, initial=senders))
    return offsets[-1], offsets[:-1]


def link_bytes(plan: Iterable[Transfer]) -> dict[tuple[int, EngineRank], int]:
    """Bytes per (trainer rank, engine rank) link."""
    out: dict[tuple[int, EngineRank], int] = defaultdict(int)
    for t in plan:
        out[(t.src_rank, t.dst)] += t.nbytes
    return dict(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    total_bytes: int
    transfers: int
    send_bytes: Mapping[int, int]  # per trainer rank that sends anything
    recv_bytes: Mapping[EngineRank, int]  # per engine rank that receives anything
    max_send_bytes: int  # the busiest trainer rank: the p2p sync time is about this over its link bandwidth
    max_recv_bytes: int


def summarize(plan: Iterable[Transfer]) -> PlanSummary:
    send: dict[int, int] = defaultdict(int)
    recv: dict[EngineRank, int] = defaultdict(int)
    n = 0
    for t in plan:
        n += 1
        send[t.src_rank] += t.nbytes
        recv[t.dst] += t.nbytes
    return PlanSummary(
        total_bytes=sum(send.values()),
        transfers=n,
        send_bytes=dict(send),
        recv_bytes=dict(recv),
        max_send_bytes=max(send.values(), default=0),
        max_recv_bytes=max(recv.values(), default=0),
    )
