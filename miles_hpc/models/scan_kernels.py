"""Triton kernels for the hybrid families' recurrent layers: the gated delta rule (deltanet.py; Qwen3-Next and
Qwen3.5) and Mamba-2's SSD scan (mamba2.py; Nemotron-H), each as a fused recurrent step (decode) and a chunked scan
(prefill), plus dispatchers with the torch references' signatures: the kernels on CUDA tensors where Triton
imports and no gradient is asked for, else the references themselves (so a CPU result never changes).

Stage: shared model code (the engine's decode and prefill; the trainer's no-grad forwards). Forward only: a call
that needs a gradient takes the torch path, whose autograd the trainer's backward uses.

Contracts are the references' (module docstrings of deltanet.py and mamba2.py): float32 inside whatever the input
dtype, the state float32, the delta rule's output in the value dtype, SSD's output float32. Each recurrent kernel
runs one program per (sequence, head, block of state columns): the rule's update is independent column by column
of the state (the delta rule's value columns, SSD's head_dim rows), so a program loads its [d_k, BLOCK_V] (or
[BLOCK_P, N]) tile once, walks the tokens (one for decode) in registers and writes it back once.

Chunked delta rule, two launches. `_gdn_chunk_prep` (all chunks in parallel) does the state-free work of a chunk:
``T = (I + A)^-1`` by forward substitution on the identity, ``W = T diag(beta) V``, ``KD = T diag(beta exp(G)) K``,
the masked scores ``L o Q K^T`` and the cumulative log-decay ``G``, into float32 scratch. `_gdn_chunk_scan` then
walks each sequence's chunks in order per (sequence, head, value block): ``U = W - KD S``, ``O = exp(G) Q S + Attn
U``, ``S <- exp(G_C) S + (exp(G_C - G) K)^T U``. The chunked SSD scan needs no solve: one launch walks the chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import deltanet  # mamba2 is imported where used: it imports linear_attn, which may import this module

try:  # the dev extra, and every CUDA machine's torch; without it the dispatchers run the torch references
    import triton
    import triton.language as tl

    jit: Callable[[Any], Any] = triton.jit
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

    def jit(fn: Any) -> Any:
        return fn


EPS = 1e-6  # deltanet.l2_normalize's
SSD_CHUNK = 128  # mamba2.CHUNK (a test checks they agree)
# The kernels' chunk (tile of tokens): the chunked forms are exact at every chunk size, so a tile smaller than the
# reference's chunk changes float32 rounding only; 128 would take ~225 KB of shared memory in the SSD kernel.
MAX_CHUNK = 64
BLOCK_V = 32  # delta rule: value columns per program (the state tile is [d_k, BLOCK_V] float32)
BLOCK_P = 32  # SSD: head_dim rows per program (the state tile is [BLOCK_P, N] float32)
# tl.dot's input precision per chunked kernel. "tf32x3": three TF32 tensor-core passes (hi*hi + hi*lo + lo*hi),
# float32-accurate here (the same largest differences from the references as "ieee" at Qwen3.5's and Nemotron-H's
# sizes) and ~18x faster than "ieee" for the delta rule on an H100 (benchmarks/bench_scan_kernels.py, 2026-12-06:
# 1.86 ms against 33.3 ms at 4,096 tokens; the torch reference 15.6 ms). SSD stays on "ieee" (float32 FMA): its
# scan under tf32x3 hit an illegal memory access on a head of 3 x 5 on that H100 (Triton's bug or ours, not found).
GDN_PRECISION = "tf32x3"
SSD_PRECISION = "ieee"
# ROCm: Triton's AMD back end refuses "tf32x3" (and every TF32 form on gfx950), so the delta rule runs "ieee" there
# (`gdn_precision`); not timed on an AMD GPU.
GDN_PRECISION_ROCM = "ieee"
DOT_PRECISION = "ieee"  # the interpreter's (it computes every precision as float32 FMA)
WARPS = 4
PREP_WARPS = 8  # the prep kernel holds several [C, d] tiles and the [C, C] inverse
# Software-pipelining stages of the chunk loops (Triton's num_stages): each stage buffers another chunk's tiles in
# shared memory; at d_k = 128 with float32 inputs the default 3 needs ~279 KB, over Hopper's 227 KB (H100, 2026-12-06).
SCAN_STAGES = 1


@jit
def _unit_lower_inverse(a, C: tl.constexpr):
    """``(I + a)^-1`` for strictly lower-triangular ``a`` [C, C]: row r of the inverse is ``e_r - a[r] inv``, whose
    rows above r are final by then (forward substitution on the identity, as the reference's triangular solve)."""
    i = tl.arange(0, C)
    inv = (i[:, None] == i[None, :]).to(tl.float32)
    for r in range(1, C):
        sel = i[:, None] == r
        row = tl.sum(tl.where(sel, a, 0.0), 0)  # a[r, :], zero from column r on
        new = (i == r).to(tl.float32) - tl.sum(row[:, None] * inv, 0)
        inv = tl.where(sel, new[None, :], inv)
    return inv


@jit
def _load_qk(Q, K, b, kh, rt, mt, rk, mk, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, eps, scale):
    """Rows ``rt`` of one key head's q and k, float32, L2-normalised, q times ``scale`` (deltanet._prepare)."""
    m = mt[:, None] & mk[None, :]
    q = tl.load(Q + b * sq_b + rt[:, None] * sq_t + kh * sq_h + rk[None, :], mask=m, other=0.0).to(tl.float32)
    k = tl.load(K + b * sk_b + rt[:, None] * sk_t + kh * sk_h + rk[None, :], mask=m, other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, 1) + eps) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
    return q, k


@jit
def _gdn_recurrent(
    Q, K, V, G, Beta, S0, Out, S1,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, eps, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
):  # fmt: skip
    """The rule token by token for one (sequence, value head, block of value columns); the state stays in
    registers across the tokens (T = 1: a decode step)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    kh = h // GROUP
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    tile = bh * DK * DV + rk[:, None] * DV + rv[None, :]
    tmask = mk[:, None] & mv[None, :]
    if HAS_S0:
        s = tl.load(S0 + tile, mask=tmask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(T):
        q = tl.load(Q + b * sq_b + t * sq_t + kh * sq_h + rk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(K + b * sk_b + t * sk_t + kh * sk_h + rk, mask=mk, other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + eps) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        v = tl.load(V + b * sv_b + t * sv_t + h * sv_h + rv, mask=mv, other=0.0).to(tl.float32)
        row = (b * T + t) * HV + h
        gt = tl.load(G + row).to(tl.float32)
        bt = tl.load(Beta + row).to(tl.float32)
        s = s * tl.exp(gt)
        write = bt * (v - tl.sum(s * k[:, None], 0))  # the part of v the state does not predict
        s = s + k[:, None] * write[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(Out + row * DV + rv, o.to(Out.dtype.element_ty), mask=mv)
    tl.store(S1 + tile, s, mask=tmask)


@jit
def _gdn_chunk_prep(
    Q, K, V, G, Beta, Wb, KDb, Ab, Gb,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    T, NT, eps, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One chunk of one (sequence, value head): everything of the chunked form that does not depend on the state
    (module docstring), into the scratch rows of its padded tokens. Padded tokens load as zeros: beta 0 and g 0,
    as the reference pads."""
    c = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // HV, bh % HV
    i = tl.arange(0, C)
    rt = c * C + i
    mt = rt < T
    rk, rv = tl.arange(0, BK), tl.arange(0, BVF)
    mk, mv = rk < DK, rv < DV
    q, k = _load_qk(Q, K, b, h // GROUP, rt, mt, rk, mk, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, eps, scale)
    v = tl.load(V + b * sv_b + rt[:, None] * sv_t + h * sv_h + rv[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
    g = tl.load(G + (b * T + rt) * HV + h, mask=mt, other=0.0).to(tl.float32)
    beta = tl.load(Beta + (b * T + rt) * HV + h, mask=mt, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, 0)  # G_i
    causal = i[:, None] >= i[None, :]
    # exp(G_i - G_j) where j <= i, else 0 (masked before exp: above the diagonal the difference is positive)
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    a = tl.where(i[:, None] > i[None, :], beta[:, None] * decay * kk, 0.0)
    inv = _unit_lower_inverse(a, C)
    w = tl.dot(inv, beta[:, None] * v.to(tl.float32), input_precision=PREC)
    kd = tl.dot(inv, (beta * tl.exp(cum))[:, None] * k, input_precision=PREC)
    attn = decay * tl.dot(q, tl.trans(k), input_precision=PREC)
    row = bh * NT * C + rt  # this head's scratch rows (padded token index)
    tl.store(Wb + row[:, None] * DV + rv[None, :], w, mask=mv[None, :])
    tl.store(KDb + row[:, None] * DK + rk[None, :], kd, mask=mk[None, :])
    tl.store(Ab + row[:, None] * C + i[None, :], attn)
    tl.store(Gb + row, cum)


@jit
def _gdn_chunk_scan(
    Q, K, Wb, KDb, Ab, Gb, S0, Out, S1,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
    T, NT, eps, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HAS_S0: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One (sequence, value head, block of value columns): its chunks in order, the state in registers."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    i = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    tile = bh * DK * DV + rk[:, None] * DV + rv[None, :]
    tmask = mk[:, None] & mv[None, :]
    if HAS_S0:
        s = tl.load(S0 + tile, mask=tmask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(NT):
        rt = c * C + i
        mt = rt < T
        q, k = _load_qk(Q, K, b, h // GROUP, rt, mt, rk, mk, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, eps, scale)
        row = bh * NT * C + rt
        cum = tl.load(Gb + row)
        last = tl.load(Gb + bh * NT * C + c * C + C - 1)  # G_C
        kd = tl.load(KDb + row[:, None] * DK + rk[None, :], mask=mk[None, :], other=0.0)
        w = tl.load(Wb + row[:, None] * DV + rv[None, :], mask=mv[None, :], other=0.0)
        attn = tl.load(Ab + row[:, None] * C + i[None, :])
        u = w - tl.dot(kd, s, input_precision=PREC)  # the values the chunk writes
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PREC) + tl.dot(attn, u, input_precision=PREC)
        tl.store(Out + ((b * T + rt[:, None]) * HV + h) * DV + rv[None, :], o.to(Out.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])  # fmt: skip
        k_to_end = k * tl.exp(last - cum)[:, None]
        s = tl.exp(last) * s + tl.dot(tl.trans(k_to_end), u, input_precision=PREC)
    tl.store(S1 + tile, s, mask=tmask)


@jit
def _ssd_recurrent(
    X, DT, A, Bm, Cm, S0, Y, S1,
    sx_b, sx_t, sx_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g,
    T,
    H: tl.constexpr, HPG: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, HAS_S0: tl.constexpr,
):  # fmt: skip
    """SSD token by token for one (sequence, head, block of head_dim rows): S <- exp(dt A) S + dt x B^T, y = S C."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    grp = h // HPG
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    tile = bh * P * N + rp[:, None] * N + rn[None, :]
    tmask = mp[:, None] & mn[None, :]
    if HAS_S0:
        s = tl.load(S0 + tile, mask=tmask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BP, BN], dtype=tl.float32)
    a = tl.load(A + h).to(tl.float32)
    for t in range(T):
        row = (b * T + t) * H + h
        dt = tl.load(DT + row).to(tl.float32)
        x = tl.load(X + b * sx_b + t * sx_t + h * sx_h + rp, mask=mp, other=0.0).to(tl.float32)
        bt = tl.load(Bm + b * sb_b + t * sb_t + grp * sb_g + rn, mask=mn, other=0.0).to(tl.float32)
        ct = tl.load(Cm + b * sc_b + t * sc_t + grp * sc_g + rn, mask=mn, other=0.0).to(tl.float32)
        s = tl.exp(dt * a) * s + (dt * x)[:, None] * bt[None, :]
        tl.store(Y + row * P + rp, tl.sum(s * ct[None, :], 1), mask=mp)
    tl.store(S1 + tile, s, mask=tmask)


@jit
def _ssd_chunk_scan(
    X, DT, A, Bm, Cm, S0, Y, S1,
    sx_b, sx_t, sx_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g,
    T, NT,
    H: tl.constexpr, HPG: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, C: tl.constexpr, HAS_S0: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """SSD a chunk at a time for one (sequence, head, block of head_dim rows), chunks in order (mamba2's chunked
    form). Padded tokens load dt 0: no decay, no write."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    grp = h // HPG
    i = tl.arange(0, C)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    tile = bh * P * N + rp[:, None] * N + rn[None, :]
    tmask = mp[:, None] & mn[None, :]
    if HAS_S0:
        s = tl.load(S0 + tile, mask=tmask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BP, BN], dtype=tl.float32)
    a = tl.load(A + h).to(tl.float32)
    causal = i[:, None] >= i[None, :]
    for c in range(NT):
        rt = c * C + i
        mt = rt < T
        dt = tl.load(DT + (b * T + rt) * H + h, mask=mt, other=0.0).to(tl.float32)
        x = tl.load(X + b * sx_b + rt[:, None] * sx_t + h * sx_h + rp[None, :], mask=mt[:, None] & mp[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        bm = tl.load(Bm + b * sb_b + rt[:, None] * sb_t + grp * sb_g + rn[None, :], mask=mt[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        cm = tl.load(Cm + b * sc_b + rt[:, None] * sc_t + grp * sc_g + rn[None, :], mask=mt[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        cum = tl.cumsum(dt * a, 0)  # G_i
        last = tl.sum(tl.where(i == C - 1, cum, 0.0), 0)  # G_C, the cumsum's own last value
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        written = dt[:, None] * x  # dt_j x_j
        scores = decay * tl.dot(cm, tl.trans(bm), input_precision=PREC)
        y = tl.exp(cum)[:, None] * tl.dot(cm, tl.trans(s), input_precision=PREC)
        y += tl.dot(scores, written, input_precision=PREC)
        tl.store(Y + ((b * T + rt[:, None]) * H + h) * P + rp[None, :], y, mask=mt[:, None] & mp[None, :])
        to_end = written * tl.exp(last - cum)[:, None]
        s = tl.exp(last) * s + tl.dot(tl.trans(to_end), bm, input_precision=PREC)
    tl.store(S1 + tile, s, mask=tmask)


def _check_chunk(chunk: int) -> None:
    if chunk & (chunk - 1) or not 16 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be a power of two in [16, {MAX_CHUNK}], got {chunk}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride along its last dim (the kernels take the other strides as arguments)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(*ts: torch.Tensor) -> list[int]:
    return [s for t in ts for s in t.stride()[:3]]


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())  # tl.dot wants every side >= 16


def _state_in(state: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    if state is None:
        return None
    if tuple(state.shape) != shape:
        raise ValueError(f"state of shape {tuple(state.shape)}, expected {shape}")
    return state.float().contiguous()


def _state_out(out_state: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out_state is None:
        return torch.empty(shape, dtype=torch.float32, device=like.device)
    if tuple(out_state.shape) != shape or out_state.dtype != torch.float32 or not out_state.is_contiguous():
        raise ValueError(f"out_state must be a contiguous float32 tensor of shape {shape}")
    return out_state


def _gdn_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if q.shape != k.shape or q.shape[:2] != v.shape[:2] or v.shape[2] % k.shape[2]:
        raise ValueError(f"q, k [B, T, n_k, d_k] and v [B, T, n_v, d_v] (n_k | n_v): {q.shape}, {k.shape}, {v.shape}")
    return _rows(q), _rows(k), _rows(v)


def gated_delta_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    out_state: torch.Tensor | None = None,
    block_v: int = BLOCK_V,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltanet.gated_delta_recurrent` in one launch (any T; a decode step is T = 1). ``out_state``: where the
    final state goes (a contiguous float32 tensor, ``state`` itself allowed: each program reads its tile before it
    writes it); default a new one."""
    q, k, v = _gdn_args(q, k, v)
    (bsz, t, n_k, dk), (n_v, dv) = q.shape, v.shape[2:]
    shape = (bsz, n_v, dk, dv)
    s0 = _state_in(state, shape)
    s1 = _state_out(out_state, shape, v)
    o = torch.empty(bsz, t, n_v, dv, dtype=v.dtype, device=v.device)
    bv = min(block_v, _pow2(dv))
    _gdn_recurrent[(bsz * n_v, triton.cdiv(dv, bv))](
        q, k, v, g.contiguous(), beta.contiguous(), s1 if s0 is None else s0, o, s1,
        *_strides(q, k, v), t, EPS, dk**-0.5,
        HV=n_v, GROUP=n_v // n_k, DK=dk, DV=dv, BK=_pow2(dk), BV=bv, HAS_S0=s0 is not None, num_warps=WARPS,
    )  # fmt: skip
    return o, s1


def gdn_precision() -> str:
    """The delta rule's tl.dot precision on this build's GPUs: GDN_PRECISION on CUDA, GDN_PRECISION_ROCM on ROCm."""
    return GDN_PRECISION_ROCM if torch.version.hip else GDN_PRECISION


def gated_delta_chunked_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = deltanet.CHUNK,
    *,
    block_v: int = BLOCK_V,
    precision: str | None = None,
    stages: int = SCAN_STAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltanet.gated_delta_chunked` in two launches (module docstring); ``chunk`` a power of two in [16, 64];
    ``precision`` tl.dot's (None: `gdn_precision()`). Scratch: float32, per value head and padded token,
    d_k + d_v + chunk + 1 values."""
    _check_chunk(chunk)
    precision = precision or gdn_precision()
    q, k, v = _gdn_args(q, k, v)
    (bsz, t, n_k, dk), (n_v, dv) = q.shape, v.shape[2:]
    shape = (bsz, n_v, dk, dv)
    s0 = _state_in(state, shape)
    s1 = torch.empty(shape, dtype=torch.float32, device=v.device)
    o = torch.empty(bsz, t, n_v, dv, dtype=v.dtype, device=v.device)
    nt = triton.cdiv(t, chunk)
    rows = bsz * n_v * nt * chunk
    w, kd, attn, cum = (torch.empty(rows, n, dtype=torch.float32, device=v.device) for n in (dv, dk, chunk, 1))
    g, beta = g.contiguous(), beta.contiguous()
    heads = dict(HV=n_v, GROUP=n_v // n_k, DK=dk, DV=dv, BK=_pow2(dk), C=chunk, PREC=precision)
    _gdn_chunk_prep[(nt, bsz * n_v)](
        q, k, v, g, beta, w, kd, attn, cum, *_strides(q, k, v), t, nt, EPS, dk**-0.5,
        BVF=_pow2(dv), num_warps=PREP_WARPS, **heads,
    )  # fmt: skip
    bv = min(block_v, _pow2(dv))
    _gdn_chunk_scan[(bsz * n_v, triton.cdiv(dv, bv))](
        q, k, w, kd, attn, cum, s1 if s0 is None else s0, o, s1, *_strides(q, k), t, nt, EPS, dk**-0.5,
        BV=bv, HAS_S0=s0 is not None, num_warps=WARPS, num_stages=stages, **heads,
    )  # fmt: skip
    return o, s1


def _ssd_args(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    heads, groups = x.shape[2], b.shape[2]
    if b.shape != c.shape or heads % groups or dt.shape != x.shape[:3] or a.shape != (heads,):
        raise ValueError("x [B, T, heads, P], dt [B, T, heads], a [heads], b, c [B, T, groups, N] (groups | heads)")
    return _rows(x), dt.float().contiguous(), a.float().contiguous(), _rows(b), _rows(c)


def ssd_recurrent_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor | None,
    *,
    out_state: torch.Tensor | None = None,
    block_p: int = BLOCK_P,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mamba2.ssd_recurrent` in one launch (any T; a decode step is T = 1); ``out_state`` as in
    :func:`gated_delta_recurrent_triton`."""
    x, dt, a, b, c = _ssd_args(x, dt, a, b, c)
    (bsz, t, heads, p), n = x.shape, b.shape[-1]
    shape = (bsz, heads, p, n)
    s0 = _state_in(state, shape)
    s1 = _state_out(out_state, shape, x)
    y = torch.empty(bsz, t, heads, p, dtype=torch.float32, device=x.device)
    bp = min(block_p, _pow2(p))
    _ssd_recurrent[(bsz * heads, triton.cdiv(p, bp))](
        x, dt, a, b, c, s1 if s0 is None else s0, y, s1, *_strides(x, b, c), t,
        H=heads, HPG=heads // b.shape[2], P=p, N=n, BP=bp, BN=_pow2(n), HAS_S0=s0 is not None, num_warps=WARPS,
    )  # fmt: skip
    return y, s1


def ssd_chunked_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = MAX_CHUNK,
    *,
    block_p: int = BLOCK_P,
    precision: str = SSD_PRECISION,
    stages: int = SCAN_STAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mamba2.ssd_chunked` in one launch: each (sequence, head, block of head_dim rows) walks its chunks in order;
    ``chunk`` a power of two in [16, 64]."""
    _check_chunk(chunk)
    x, dt, a, b, c = _ssd_args(x, dt, a, b, c)
    (bsz, t, heads, p), n = x.shape, b.shape[-1]
    shape = (bsz, heads, p, n)
    s0 = _state_in(state, shape)
    s1 = torch.empty(shape, dtype=torch.float32, device=x.device)
    y = torch.empty(bsz, t, heads, p, dtype=torch.float32, device=x.device)
    bp = min(block_p, _pow2(p))
    _ssd_chunk_scan[(bsz * heads, triton.cdiv(p, bp))](
        x, dt, a, b, c, s1 if s0 is None else s0, y, s1, *_strides(x, b, c), t, triton.cdiv(t, chunk),
        H=heads, HPG=heads // b.shape[2], P=p, N=n, BP=bp, BN=_pow2(n), C=chunk, HAS_S0=s0 is not None,
        PREC=precision, num_warps=PREP_WARPS, num_stages=stages,
    )  # fmt: skip
    return y, s1


MAX_DIM = 256  # the widest head dimension a program's tiles take (d_k, d_v; SSD's state size)


def _fits(chunk: int, *dims: int) -> bool:
    return max(dims) <= MAX_DIM and chunk >= 16 and not chunk & (chunk - 1)


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels may run on these tensors: Triton imported, every tensor on a CUDA (or ROCm) device, none
    empty, and no gradient asked for (the kernels are forward only)."""
    ts = [t for t in tensors if t is not None]
    if triton is None or not all(t.device.type == "cuda" for t in ts) or any(t.numel() == 0 for t in ts):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltanet.gated_delta_recurrent` (same arguments and results), on the fused kernel where :func:`use_triton`
    allows it."""
    if use_triton(q, k, v, g, beta, state) and max(q.shape[-1], v.shape[-1]) <= MAX_DIM:
        return gated_delta_recurrent_triton(q, k, v, g, beta, state)
    return deltanet.gated_delta_recurrent(q, k, v, g, beta, state)


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = deltanet.CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltanet.gated_delta_chunked` (same arguments and results up to float32 rounding), on the chunked kernels
    (chunks of min(chunk, MAX_CHUNK) tokens) where :func:`use_triton` allows it and ``chunk`` is a power of two
    >= 16."""
    if _fits(chunk, q.shape[-1], v.shape[-1]) and use_triton(q, k, v, g, beta, state):
        return gated_delta_chunked_triton(q, k, v, g, beta, state, min(chunk, MAX_CHUNK))
    return deltanet.gated_delta_chunked(q, k, v, g, beta, state, chunk)


def ssd_recurrent(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mamba2.ssd_recurrent` (same arguments and results), on the fused kernel where :func:`use_triton` allows."""
    if use_triton(x, dt, a, b, c, state) and b.shape[-1] <= MAX_DIM:
        return ssd_recurrent_triton(x, dt, a, b, c, state)
    from . import mamba2

    return mamba2.ssd_recurrent(x, dt, a, b, c, state)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = SSD_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mamba2.ssd_chunked` (same arguments and results up to float32 rounding), on the chunked kernel (chunks of
    min(chunk, MAX_CHUNK) tokens) where :func:`use_triton` allows it and ``chunk`` is a power of two >= 16."""
    if _fits(chunk, b.shape[-1]) and use_triton(x, dt, a, b, c, state):
        return ssd_chunked_triton(x, dt, a, b, c, state, min(chunk, MAX_CHUNK))
    from . import mamba2

    return mamba2.ssd_chunked(x, dt, a, b, c, state, chunk)
