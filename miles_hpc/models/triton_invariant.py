"""Batch-invariant Triton kernels for zero-KL mode on GPUs: one launch per op where `invariant.py` launches one torch
call per tile (stage: shared model code; issue 31 item 3; docs/lora.md, "Zero-KL mode").

Status: checked in Triton's interpreter on CPU (tests/test_triton_invariant.py): each kernel matches its
`invariant.py` reference to rounding, and a row's bits do not change with the rows computed beside it. Zero-KL mode
uses them on CUDA by default (`invariant.kernels`, MILES_INVARIANT_KERNELS); on an H100 the engine's and the
trainer's log-probs are bitwise equal through them (tests/test_zero_kl_gpu.py).

The rule is `invariant.py`'s, kept by construction instead of by fixed-shape torch calls: every program owns whole
output rows (or an output tile) and walks its reduction in one fixed order, with block sizes that depend on the
row width and dtype only, never on how many rows the call holds. So a token's result has the same bits in a decode
step of one row and in a packed micro-batch of thousands, provided both sides call the same kernel:
- `linear`: a GEMM whose program owns a [BM, BN] output tile and walks K in BK steps in order (no split-K), fp32
  accumulation (`input_precision="ieee"` for fp32 operands: no TF32);
- `rms_norm`, `log_softmax`: one program per row, the row walked in BLOCK chunks into per-lane float32
  accumulators, reduced once at the end (a fixed tree for a given BLOCK); `token_log_softmax` is the same kernel
  storing only the row's entry at its target (the trainer's token log-probs, no float32 [rows, vocab] tensor);
- `attention`: variable-length causal attention over packed sequences (the trainer's layout; the engine's eager
  step gathers each sequence's keys from its cache into the same layout), a program per (query tile of one
  sequence, head), `invariant.attention`'s algorithm: the row maximum over all key chunks up to the tile's last
  position, then chunk by chunk in key order exp(score - max) summed and multiplied into the output. Chunks past a
  row's own position add exact zeros, so a row's bits do not depend on the other queries of its tile;
- `paged_attention`: the same kernel (`PAGED`) for one decode query per row, reading keys through the row's block
  table and placing the query in the tile where the packed call puts it, with no host-built table: the engine's
  zero-KL decode step in a CUDA graph (engine/invariant_decode.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["attention", "linear", "log_softmax", "paged_attention", "rms_norm", "token_log_softmax"]

BM, BN, BK = 32, 64, 32  # GEMM tiles: fixed, so a row's K walk is the same in any batch
ROW_BLOCK = 1024  # rms_norm / log_softmax: elements per step along a row
ROW_LEVELS = ROW_BLOCK.bit_length() - 1  # _tree_sum's levels over ROW_BLOCK lanes
QUERY_TILE, KEY_CHUNK = 16, 64  # attention, as invariant.QUERY_TILE / KEY_CHUNK


def _precision(t: torch.Tensor) -> str:
    """tl.dot's input precision: "ieee" for float32 inputs; for 16-bit inputs (products exact in TF32) "tf32" on
    CUDA, "ieee" on ROCm, whose Triton back end takes TF32 on gfx942 only."""
    return "ieee" if t.dtype == torch.float32 or torch.version.hip else "tf32"


@triton.jit
def _linear_kernel(x, w, b, out, M, N, K, sx, sw, so, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)  # rows x N passes 2**31 at LM-head widths
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * sx + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        bt = tl.load(w + rn[None, :] * sw + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, bt, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out + rm[:, None] * so + rn[None, :], acc.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (x [..., K], weight [N, K]) in x's dtype, fp32 accumulation."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    w = weight.contiguous()
    n = w.shape[0]
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], BM), triton.cdiv(n, BN))
        _linear_kernel[grid](rows, w, w if bias is None else bias.contiguous(), out, rows.shape[0], n, k,
                             rows.stride(0), w.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                             PREC=_precision(x), BM=BM, BN=BN, BK=BK)  # fmt: skip
    return out.reshape(*lead, n)


@triton.jit
def _tree_sum(x, N: tl.constexpr, LEVELS: tl.constexpr):
    """The sum of x [N] (N = 2**LEVELS) by a fixed pairwise tree: level by level, element 2j plus element 2j+1.
    `tl.sum`'s order follows the layout the compiler gives x, which follows the loads that fed it (a bfloat16 row is
    read 8 to a thread, a float32 row 4), so the same values summed by two compilations of one kernel could round
    differently; each step here adds exactly two numbers, which IEEE addition gives the same bits in either order."""
    for i in tl.static_range(LEVELS):
        x = tl.reshape(x, (N >> (i + 1), 2))
        a, b = tl.split(x)
        x = a + b
    return tl.reshape(x, ())


@triton.jit
def _rms_norm_kernel(x, w, out, width, eps, BLOCK: tl.constexpr, LEVELS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * width
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, width, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        v = tl.load(x + row + cols, mask=cols < width, other=0.0).to(tl.float32)
        acc += v * v
    inv = 1.0 / tl.sqrt(_tree_sum(acc, BLOCK, LEVELS) / width + eps)
    for c in range(0, width, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        v = tl.load(x + row + cols, mask=cols < width, other=0.0).to(tl.float32)
        g = tl.load(w + cols, mask=cols < width, other=0.0)
        tl.store(out + row + cols, (v * inv).to(out.dtype.element_ty) * g, mask=cols < width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as `models.layers.RMSNorm` computes it: float32 statistics, normalised row cast back, times weight."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), out, rows.shape[1], eps, BLOCK=ROW_BLOCK, LEVELS=ROW_LEVELS
        )
    return out.reshape(x.shape)


@triton.jit
def _log_softmax_kernel(x, out, target, width, BLOCK: tl.constexpr, LEVELS: tl.constexpr, TOKEN: tl.constexpr):
    """out[row] = log_softmax(x[row]); with TOKEN, out[row] (one float32) = that row's value at column
    target[row] only, by the same arithmetic (the row's lse, then one subtraction)."""
    r = tl.program_id(0).to(tl.int64)
    row = r * width
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for c in range(0, width, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(x + row + cols, mask=cols < width, other=float("-inf")).to(tl.float32))
    top = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, width, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        v = tl.load(x + row + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        s += tl.exp(v - top)
    lse = top + tl.log(_tree_sum(s, BLOCK, LEVELS))
    if TOKEN:
        v = tl.load(x + row + tl.load(target + r)).to(tl.float32)
        tl.store(out + r, v - lse)
    else:
        for c in range(0, width, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            v = tl.load(x + row + cols, mask=cols < width, other=0.0).to(tl.float32)
            tl.store(out + row + cols, v - lse, mask=cols < width)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the last dim (the log-probs both sides report)."""
    rows = logits.reshape(-1, logits.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    if rows.shape[0]:
        _log_softmax_kernel[(rows.shape[0],)](rows, out, out, rows.shape[1], BLOCK=ROW_BLOCK, LEVELS=ROW_LEVELS,
                                              TOKEN=False)  # fmt: skip
    return out.reshape(logits.shape)


def token_log_softmax(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)` at column target[i] of each row i (logits [N, V], target int [N]): float32 [N], the same
    bits as the full call's entries, without the float32 [N, V] tensor (the trainer's token log-probs)."""
    rows = logits.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    if rows.shape[0]:
        tgt = target.to(torch.int64).contiguous()
        _log_softmax_kernel[(rows.shape[0],)](rows, out, tgt, rows.shape[1], BLOCK=ROW_BLOCK, LEVELS=ROW_LEVELS,
                                              TOKEN=True)  # fmt: skip
    return out


@triton.jit
def _attention_kernel(q, k, v, out, tile_q, tile_k, tile_n, tile_p, table, tstride, scale, sq, sk, sv, so, rep,
                      D: tl.constexpr, DV: tl.constexpr, QT: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr,
                      PAGED: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, QT)
    if PAGED:  # query row t alone, at its position's place in the tile the packed call puts it in; keys via table
        pos = tl.load(tile_p + t)
        p0 = pos - pos % QT
        live = rows == pos % QT
        qrow = t.to(tl.int64) + 0 * rows.to(tl.int64)
        last = pos
        k0 = pos * 0
        trow = table + t.to(tl.int64) * tstride
    else:  # the tile table's tile t: consecutive queries of one sequence, its keys from row k0 on
        q0, k0, nq, p0 = tl.load(tile_q + t), tl.load(tile_k + t), tl.load(tile_n + t), tl.load(tile_p + t)
        live = rows < nq
        qrow = q0 + rows
        last = p0 + nq - 1
        trow = table
    p = tl.where(live, p0 + rows, -1)  # the tile's queries sit at consecutive positions from p0
    qt = tl.load(q + qrow[:, None] * sq + h * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
    qt = qt.to(tl.float32)
    hk = h // rep
    d, dv, kc = tl.arange(0, D), tl.arange(0, DV), tl.arange(0, KC)
    m = tl.full((QT,), float("-inf"), dtype=tl.float32)
    for c in range(0, last + 1, KC):
        keys = c + kc
        krow = _key_rows(keys, last, k0, trow, PAGED, BS)
        kt = tl.load(k + krow[None, :] * sk + hk * D + d[:, None], mask=(keys <= last)[None, :], other=0.0)
        s = tl.dot(qt, kt.to(tl.float32), input_precision=PREC) * scale
        s = tl.where(keys[None, :] <= p[:, None], s, float("-inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
    m = tl.where(m == float("-inf"), 0.0, m)  # padding rows: all masked
    denom = tl.zeros((QT,), dtype=tl.float32)
    acc = tl.zeros((QT, DV), dtype=tl.float32)
    for c in range(0, last + 1, KC):
        keys = c + kc
        krow = _key_rows(keys, last, k0, trow, PAGED, BS)
        kt = tl.load(k + krow[None, :] * sk + hk * D + d[:, None], mask=(keys <= last)[None, :], other=0.0)
        s = tl.dot(qt, kt.to(tl.float32), input_precision=PREC) * scale
        s = tl.where(keys[None, :] <= p[:, None], s, float("-inf"))
        e = tl.exp(s - m[:, None])
        denom += tl.sum(e, axis=1)
        vt = tl.load(v + krow[:, None] * sv + hk * DV + dv[None, :], mask=(keys <= last)[:, None], other=0.0)
        acc += tl.dot(e, vt.to(tl.float32), input_precision=PREC)
    acc = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out + qrow[:, None] * so + h * DV + dv[None, :], acc.to(out.dtype.element_ty), mask=live[:, None])


@triton.jit
def _key_rows(keys, last, k0, trow, PAGED: tl.constexpr, BS: tl.constexpr):
    """Rows of k/v holding the keys at positions `keys` (those <= last are read): k0 + keys for a packed
    sequence; through the block table row `trow` (int32 blocks of BS slots) for a paged cache."""
    if PAGED:
        blk = tl.load(trow + keys // BS, mask=keys <= last, other=0).to(tl.int64)
        rows = blk * BS + keys % BS
    else:
        rows = (k0 + keys).to(tl.int64)
    return rows


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: list[int],
    cu_q: list[int],
    cu_k: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed sequences: q [Tq, Hq, D] (sequence i's queries at rows cu_q[i]..cu_q[i+1]-1, at
    consecutive positions from starts[i]: a decode query, a prefill chunk after a cached prefix, or a whole sequence
    from 0), k [Tk, Hkv, D] and v [Tk, Hkv, Dv] (sequence i's keys at positions 0.. at rows cu_k[i]..cu_k[i+1]-1,
    at least up to its last query's position). Returns [Tq, Hq, Dv] in q's dtype. D and Dv are powers of two
    (Triton's block shapes); Hq a multiple of Hkv. The layout is host integers, so a call never waits on the device;
    its tile table is built once per layout (the layers of one forward share it)."""
    tq, hq, dim = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    if hq % hkv or dim & (dim - 1) or dv & (dv - 1):
        raise ValueError(f"attention: {hq} query heads over {hkv} KV heads, head dims {dim}/{dv} (powers of two)")
    out = torch.empty(tq, hq, dv, dtype=q.dtype, device=q.device)
    cols = _tile_table(tuple(starts), tuple(cu_q), tuple(cu_k), q.device)
    if not cols[0].numel():
        return out
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    _attention_kernel[(cols[0].numel(), hq)](qc, kc, vc, out, *cols, cols[0], 0, scale, qc.stride(0), kc.stride(0),
                                             vc.stride(0), out.stride(0), hq // hkv, D=dim, DV=dv, QT=QUERY_TILE,
                                             KC=KEY_CHUNK, PREC=_precision(q), PAGED=False, BS=1)  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """One query per row over a paged cache, each with the bits `attention` gives that query in any packed call:
    q [n, Hq, D], row i at positions[i] (int64 [n], on the device), over the keys at positions 0..positions[i] in
    cache slots block_tables[i, p // block_size] * block_size + p % block_size (k_cache [slots, Hkv, D], v_cache
    [slots, Hkv, Dv]; every such slot written). The query sits in its tile where the packed call puts it (row
    p % QUERY_TILE of the tile from p - p % QUERY_TILE), so the tile's arithmetic is the packed call's with the
    other rows masked. No host read and a grid of n x Hq: a CUDA graph can hold it (the engine's zero-KL decode)."""
    n, hq, dim = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if hq % hkv or dim & (dim - 1) or dv & (dv - 1):
        raise ValueError(f"paged_attention: {hq} query heads over {hkv} KV heads, head dims {dim}/{dv} (powers of two)")
    out = torch.empty(n, hq, dv, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    qc, kc, vc = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    pos = positions.to(torch.int64)
    _attention_kernel[(n, hq)](qc, kc, vc, out, pos, pos, pos, pos, block_tables, block_tables.stride(0), scale,
                               qc.stride(0), kc.stride(0), vc.stride(0), out.stride(0), hq // hkv, D=dim, DV=dv,
                               QT=QUERY_TILE, KC=KEY_CHUNK, PREC=_precision(q), PAGED=True,
                               BS=block_size)  # fmt: skip
    return out


@functools.lru_cache(maxsize=8)
def _tile_table(
    starts: tuple[int, ...], cu_q: tuple[int, ...], cu_k: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Each tile is QUERY_TILE consecutive queries of one sequence: (first query row, the sequence's first key row,
    queries in the tile, the tile's first position), one int64 tensor per column; from the sequence lengths alone."""
    if not len(starts) == len(cu_q) - 1 == len(cu_k) - 1:
        raise ValueError(f"attention: {len(starts)} starts for {len(cu_q) - 1} / {len(cu_k) - 1} sequences")
    tiles: list[tuple[int, int, int, int]] = []
    for i, p0 in enumerate(starts):
        nq, nk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if nq and p0 + nq > nk:
            raise ValueError(f"sequence {i}: a query at position {p0 + nq - 1} needs keys up to it; {nk} given")
        for t in range(0, nq, QUERY_TILE):
            tiles.append((cu_q[i] + t, cu_k[i], min(QUERY_TILE, nq - t), p0 + t))
    columns = list(zip(*tiles, strict=True)) if tiles else [(), (), (), ()]
    return tuple(torch.tensor(c, dtype=torch.int64, device=device) for c in columns)
