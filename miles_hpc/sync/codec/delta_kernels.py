"""The class layout of `sync.codec.delta_codec` as Triton kernels on CUDA (stage: sync; pure).

The codec splits elements into context classes by the exponent field of the old value (class c holds the
exponents in [lows[c-1], lows[c]), lows[-1] = 0) and codes, per class, the ranks of the changed elements among the
class's elements in flat index order. On the CPU the codec gets those ranks from a stable sort by exponent; here
three passes over the tensor give the same numbers without a sort (a GPU test checks they are equal):
1. `block_counts`: per program of `BLOCK` elements, how many elements of each class it holds (and how many of them
   changed); torch turns those into per-block bases with exclusive sums over the blocks.
2. `class_ranks` (encoder): each changed element's rank within its class (block base + in-block exclusive count)
   and its ulp difference, written class-major at their place in the output (bases of the changed counts).
3. `apply_dense` (decoder): each element's index in the class-major order, a gather from the dense array of
   differences the decoder scattered there (0: unchanged), and the new bit pattern.
Bit patterns arrive as the same-width signed integer view (int16 for bf16/fp16, int32 for fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # < 2^16: in-block counts fit the 16-bit fields of the packed scans
NUM_WARPS = 4


@triton.jit
def _classes(o, lows_ptr, EXP_SHIFT: tl.constexpr, EXP_MASK: tl.constexpr, C: tl.constexpr):
    e = (o >> EXP_SHIFT) & EXP_MASK
    cls = tl.zeros_like(e)
    for t in tl.static_range(C - 1):
        cls += (e >= tl.load(lows_ptr + t)).to(cls.dtype)
    return cls


@triton.jit
def _key(o, TOP: tl.constexpr, FULL: tl.constexpr, SW: tl.constexpr):
    u = o.to(tl.int64) & FULL
    return u ^ (TOP + (u >> SW) * (TOP - 1))


@triton.jit
def _packed(sel, cls, g):
    """int64 with a 1 in the 16-bit field (cls % 4) of the elements of class group g (cls // 4 == g) in `sel`."""
    return tl.where(sel & ((cls >> 2) == g), tl.full(cls.shape, 1, tl.int64) << ((cls & 3) * 16).to(tl.int64), 0)


@triton.jit
def _field(packed, cls):
    return (packed >> ((cls & 3) * 16).to(tl.int64)) & 0xFFFF


@triton.jit
def _unpack4(total):
    """The four 16-bit fields of one packed int64 sum, as int32 [4]."""
    return ((total >> (tl.arange(0, 4) * 16).to(tl.int64)) & 0xFFFF).to(tl.int32)


@triton.jit
def _block_counts(
    o_ptr,
    n_ptr,
    lows_ptr,
    cnt_ptr,
    N,
    EXP_SHIFT: tl.constexpr,
    EXP_MASK: tl.constexpr,
    C: tl.constexpr,
    HAS_NEW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Per-class counts are sums of one-hot 16-bit fields, four classes per int64 (BLOCK < 2^16: no carries).
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    o = tl.load(o_ptr + offs, mask=valid, other=0).to(tl.int32)
    cls = _classes(o, lows_ptr, EXP_SHIFT, EXP_MASK, C)
    if HAS_NEW:
        chg = valid & (o != tl.load(n_ptr + offs, mask=valid, other=0).to(tl.int32))
    for g in tl.static_range((C + 3) // 4):
        lanes = 4 * g + tl.arange(0, 4)
        tl.store(cnt_ptr + pid * (2 * C) + lanes, _unpack4(tl.sum(_packed(valid, cls, g), axis=0)), mask=lanes < C)
        if HAS_NEW:
            tl.store(
                cnt_ptr + pid * (2 * C) + C + lanes, _unpack4(tl.sum(_packed(chg, cls, g), axis=0)), mask=lanes < C
            )


@triton.jit
def _class_ranks(
    o_ptr,
    n_ptr,
    lows_ptr,
    base_ptr,
    ranks_ptr,
    d_ptr,
    N,
    EXP_SHIFT: tl.constexpr,
    EXP_MASK: tl.constexpr,
    TOP: tl.constexpr,
    FULL: tl.constexpr,
    SW: tl.constexpr,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    o = tl.load(o_ptr + offs, mask=valid, other=0).to(tl.int32)
    nw = tl.load(n_ptr + offs, mask=valid, other=0).to(tl.int32)
    chg = valid & (o != nw)
    cls = _classes(o, lows_ptr, EXP_SHIFT, EXP_MASK, C)
    r_in = tl.zeros([BLOCK], dtype=tl.int64)
    p_in = tl.zeros([BLOCK], dtype=tl.int64)
    for g in tl.static_range((C + 3) // 4):  # in-block exclusive counts per class: one scan per four classes
        a = _packed(valid, cls, g)
        b = _packed(chg, cls, g)
        mine = (cls >> 2) == g
        r_in = tl.where(mine, _field(tl.cumsum(a, axis=0) - a, cls), r_in)
        p_in = tl.where(mine, _field(tl.cumsum(b, axis=0) - b, cls), p_in)
    row = base_ptr + pid * (2 * C) + cls
    rank = tl.load(row, mask=chg, other=0) + r_in
    pos = tl.load(row + C, mask=chg, other=0) + p_in
    d = _key(nw, TOP, FULL, SW) - _key(o, TOP, FULL, SW)
    tl.store(ranks_ptr + pos, rank, mask=chg)
    tl.store(d_ptr + pos, d, mask=chg)


@triton.jit
def _apply_dense(
    o_ptr,
    out_ptr,
    lows_ptr,
    base_ptr,
    dense_ptr,
    bad_ptr,
    N,
    EXP_SHIFT: tl.constexpr,
    EXP_MASK: tl.constexpr,
    TOP: tl.constexpr,
    FULL: tl.constexpr,
    SW: tl.constexpr,
    W: tl.constexpr,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    ow = tl.load(o_ptr + offs, mask=valid, other=0)
    o = ow.to(tl.int32)
    cls = _classes(o, lows_ptr, EXP_SHIFT, EXP_MASK, C)
    r_in = tl.zeros([BLOCK], dtype=tl.int64)
    for g in tl.static_range((C + 3) // 4):
        a = _packed(valid, cls, g)
        r_in = tl.where((cls >> 2) == g, _field(tl.cumsum(a, axis=0) - a, cls), r_in)
    g_idx = tl.load(base_ptr + pid * C + cls, mask=valid, other=0) + r_in
    d = tl.load(dense_ptr + g_idx, mask=valid, other=0).to(tl.int64)
    key = _key(o, TOP, FULL, SW) + d
    hit = valid & (d != 0)
    tl.store(bad_ptr + pid, tl.sum((hit & ((key < 0) | (key > FULL))).to(tl.int32), axis=0))
    u = key ^ (FULL - (key >> SW) * (TOP - 1))
    signed = u - ((u >> SW) << W)  # into the signed range of the view
    tl.store(out_ptr + offs, tl.where(hit, signed.to(ow.dtype), ow), mask=valid)


def _excl_cumsum_blocks(cnt: torch.Tensor) -> torch.Tensor:
    """Exclusive sums over the blocks (dim 0) of int64 [blocks, k], scanned along contiguous rows (a scan over
    the outer dimension of a tall tensor is ~100x slower on CUDA)."""
    t = cnt.t().contiguous()
    return (torch.cumsum(t, 1) - t).t()


def _consts(width: int, exp_shift: int, n_exp: int) -> dict[str, int]:
    return {
        "EXP_SHIFT": exp_shift,
        "EXP_MASK": n_exp - 1,
        "TOP": 1 << (width - 1),
        "FULL": (1 << width) - 1,
        "SW": width - 1,
    }


def padded_lows(lows: list[int], n_exp: int, device: torch.device) -> torch.Tensor:
    """int32 class bounds padded with empty classes (bound `n_exp`: no exponent reaches it) to a multiple of four
    classes, the kernels' group size: four compiled variants per kernel instead of one per class count."""
    pad = -(len(lows) + 1) % 4
    return torch.tensor([*lows, *[n_exp] * pad], dtype=torch.int32, device=device)


def block_counts(
    ob: torch.Tensor, nb: torch.Tensor | None, lows: torch.Tensor, exp_shift: int, n_exp: int
) -> torch.Tensor:
    """int64 [blocks, C] elements per class and block (`nb` None), or [blocks, 2C]: then also the changed ones."""
    c = lows.numel() + 1
    blocks = triton.cdiv(ob.numel(), BLOCK)
    out = torch.empty(blocks, 2 * c, dtype=torch.int32, device=ob.device)
    _block_counts[(blocks,)](
        ob,
        ob if nb is None else nb,
        lows,
        out,
        ob.numel(),
        EXP_SHIFT=exp_shift,
        EXP_MASK=n_exp - 1,
        C=c,
        HAS_NEW=nb is not None,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return out[:, :c].long() if nb is None else out.long()


def class_ranks(
    ob: torch.Tensor, nb: torch.Tensor, lows: torch.Tensor, width: int, exp_shift: int, n_exp: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ranks, differences, elements per class, changed per class): the changed elements class-major, each class
    in flat index order."""
    c = lows.numel() + 1
    cnt = block_counts(ob, nb, lows, exp_shift, n_exp)
    cnt_all, cnt_chg = cnt[:, :c], cnt[:, c:]
    k_c = cnt_chg.sum(0)
    starts = torch.cumsum(k_c, 0) - k_c
    base = _excl_cumsum_blocks(cnt)
    base[:, c:] += starts
    k = int(k_c.sum())
    ranks = torch.empty(k, dtype=torch.int64, device=ob.device)
    d = torch.empty(k, dtype=torch.int64, device=ob.device)
    _class_ranks[(cnt.shape[0],)](
        ob,
        nb,
        lows,
        base.contiguous(),
        ranks,
        d,
        ob.numel(),
        C=c,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
        **_consts(width, exp_shift, n_exp),
    )
    return ranks, d, cnt_all.sum(0), k_c


def class_sizes(ob: torch.Tensor, lows: torch.Tensor, exp_shift: int, n_exp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements per class int64 [C], per-block counts int64 [blocks, C]) of the old tensor."""
    cnt = block_counts(ob, None, lows, exp_shift, n_exp)
    return cnt.sum(0), cnt


def apply_dense(
    ob: torch.Tensor,
    lows: torch.Tensor,
    cnt_all: torch.Tensor,
    dense: torch.Tensor,
    width: int,
    exp_shift: int,
    n_exp: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new bit patterns, number of differences that left the dtype's patterns: a device scalar, read by the
    caller with its other checks) given `dense`: the class-major differences (0 where unchanged) and the per-block
    class counts of `class_sizes`."""
    n_c = cnt_all.sum(0)
    base = (torch.cumsum(n_c, 0) - n_c)[None, :] + _excl_cumsum_blocks(cnt_all)
    out = torch.empty_like(ob)
    bad = torch.empty(cnt_all.shape[0], dtype=torch.int32, device=ob.device)
    _apply_dense[(cnt_all.shape[0],)](
        ob,
        out,
        lows,
        base.contiguous(),
        dense,
        bad,
        ob.numel(),
        W=width,
        C=lows.numel() + 1,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
        **_consts(width, exp_shift, n_exp),
    )
    return out, bad.sum()
