"""What each trainer rank holds of every HF-named tensor, for the p2p weight sync (stage: train; docs/design.md section 6).

FSDP2 shards every parameter along dim 0 like ``torch.chunk``: with ``c = ceil(n / world)`` rank ``r`` holds rows
``[r*c, (r+1)*c)`` clipped to ``n`` (the last ranks may hold fewer rows, or none). Our HF names carve some
parameters into several HF tensors (fused MoE experts: expert ``j`` is row ``j``, ``models/hf_io.hf_parts``), so a
rank holds either all of such an HF tensor or nothing of it. Tensors outside FSDP (plain tensors, buffers) are
held whole by every rank; the transfer plan then lets the copies take turns.

:func:`shard_layout` gives every rank's boxes from the global shapes alone (every process computes the same
answer, no communication); :func:`local_shards` gives this rank's data as views of its local shards (no copy, no
collective). A test checks the two against the gathered tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from miles_hpc.models.hf_io import hf_parts
from miles_hpc.planner.transfer import Box, ShardMap

__all__ = ["ShardMap", "local_shards", "shard_layout", "shard_map"]


def _rows(n: int, world: int) -> list[tuple[int, int]]:
    c = -(-n // world)
    return [(min(n, r * c), min(n, (r + 1) * c)) for r in range(world)]


def _is_sharded(t: torch.Tensor) -> bool:
    if not isinstance(t, DTensor):
        return False
    if tuple(t.placements) != (Shard(0),):
        raise ValueError(f"p2p sync expects FSDP2's Shard(0) placement, got {t.placements}")
    return True


def shard_layout(model: torch.nn.Module, world: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[Box, ...]]]:
    """(HF name -> global shape, HF name -> the box each of ``world`` ranks holds), in Hub order."""
    config = model.config  # type: ignore[attr-defined]
    shapes: dict[str, tuple[int, ...]] = {}
    layout: dict[str, tuple[Box, ...]] = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        rows = _rows(shape[0], world) if shape and _is_sharded(t) else [(0, shape[0] if shape else 1)] * world
        for hf_name, index in hf_parts(config, name, shape):
            if not index:
                full = Box.full(shape)
                shapes[hf_name] = shape
                layout[hf_name] = tuple(full.with_dim(0, lo, hi) if shape else full for lo, hi in rows)
                continue
            part_shape = tuple(torch.empty(shape[1:], device="meta")[index[1:]].shape)
            full, j = Box.full(part_shape), index[0]
            none = full.with_dim(0, 0, 0) if part_shape else full
            shapes[hf_name] = part_shape
            layout[hf_name] = tuple(full if lo <= j < hi else none for lo, hi in rows)
    return shapes, layout


def local_shards(model: torch.nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    """HF name -> this rank's held part (a view of its local shard), for the HF tensors it holds any of."""
    config = model.config  # type: ignore[attr-defined]
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        sharded = bool(shape) and _is_sharded(t)
        local = t.to_local() if sharded else t
        lo, hi = _rows(shape[0], world)[rank] if sharded else (0, shape[0] if shape else 1)
        if sharded and local.shape[0] != hi - lo:
            raise ValueError(f"{name}: rank {rank} holds {local.shape[0]} rows, chunk layout says {hi - lo}")
        for hf_name, index in hf_parts(config, name, shape):
            if not index:
                if hi > lo:
                    out[hf_name] = local.detach()
            elif lo <= index[0] < hi:
                out[hf_name] = local.detach()[(index[0] - lo, *index[1:])]
    return out


def shard_map(model: torch.nn.Module, rank: int, world: int) -> ShardMap:
    shapes, layout = shard_layout(model, world)
    return ShardMap(shapes, layout, local_shards(model, rank, world))
