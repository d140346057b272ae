"""Fused Triton kernels for a decode step: (residual add +) RMSNorm, QK-norm + RoPE + KV-cache write, SiLU * up.

Stage: engine (`TritonDecodeOps` is the GPU `DecodeOps`; `decode_ops.TorchDecodeOps` is its reference). Imported
only where Triton is installed.

Why: a decode step of a small model is launch-bound. The model's torch code spends ~60 kernels per layer on
elementwise work (RMSNorm alone is 8); these kernels do it in 4, so a captured graph has ~12 nodes per layer.
Each kernel rounds to the activation dtype exactly where the torch code rounds (decode_ops.py's contract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_ops import DecodeOps
from .triton_decode import paged_decode, tuned_tiles


@triton.jit
def _round(x, MODE: tl.constexpr):
    """float32 x rounded to the activation dtype and back (MODE 0: float32, 1: bfloat16, 2: float16). bfloat16 is
    rounded to nearest-even on the bits: a convert pair could be folded or fused by the compiler, this cannot."""
    if MODE == 1:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif MODE == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _add_rms_norm_kernel(
    X,
    Delta,
    W,
    Y,
    stride_x,
    stride_d,
    stride_y,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    MODE: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = Y.dtype.element_ty
    h = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(Delta + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        h = _round(h + d, MODE)
        tl.store(X + row * stride_x + offs, h.to(dt), mask=mask)
    r = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    hn = _round(h * r, MODE)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (w * hn).to(dt), mask=mask)


@triton.jit
def _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps, D: tl.constexpr, HAS_NORM: tl.constexpr, MODE: tl.constexpr):
    """One head split in halves: RMSNorm over both (optional), then HF's half-split RoPE, torch's roundings.
    Returns float32 values already rounded to the activation dtype."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / D + eps)
        a = _round(w1 * _round(a * r, MODE), MODE)
        b = _round(w2 * _round(b * r, MODE), MODE)
    o1 = _round(_round(a * c1, MODE) - _round(b * s1, MODE), MODE)
    o2 = _round(_round(b * c2, MODE) + _round(a * s2, MODE), MODE)
    return o1, o2


@triton.jit
def _qk_norm_rope_store_kernel(
    Q,
    K,
    V,
    QW,
    KW,
    Cos,
    Sin,
    Slots,
    QOut,
    KC,
    VC,
    stride_q,
    stride_k,
    stride_v,
    stride_cs,
    stride_qo_t,
    stride_qo_h,
    stride_kc_t,
    stride_kc_h,
    stride_vc_t,
    stride_vc_h,
    eps,
    HQ: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    MODE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..HQ-1: query heads; HQ..: kv heads
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    D: tl.constexpr = 2 * HALF
    c1 = tl.load(Cos + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + t * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + t * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if h < HQ:
        src = Q + t * stride_q + h * D
        x1 = tl.load(src + offs, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
        w1 = tl.load(QW + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(QW + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps, D, HAS_NORM, MODE)
        dst = QOut + t * stride_qo_t + h * stride_qo_h
        tl.store(dst + offs, o1.to(QOut.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, o2.to(QOut.dtype.element_ty), mask=mask)
    else:
        kh = h - HQ
        slot = tl.load(Slots + t).to(tl.int64)
        src = K + t * stride_k + kh * D
        x1 = tl.load(src + offs, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
        w1 = tl.load(KW + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(KW + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps, D, HAS_NORM, MODE)
        dst = KC + slot * stride_kc_t + kh * stride_kc_h
        tl.store(dst + offs, o1.to(KC.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, o2.to(KC.dtype.element_ty), mask=mask)
        vsrc = V + t * stride_v + kh * D
        vdst = VC + slot * stride_vc_t + kh * stride_vc_h
        tl.store(vdst + offs, tl.load(vsrc + offs, mask=mask, other=0.0).to(VC.dtype.element_ty), mask=mask)
        vhi = tl.load(vsrc + HALF + offs, mask=mask, other=0.0)
        tl.store(vdst + HALF + offs, vhi.to(VC.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, stride_o, N: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), MODE)
    tl.store(Out + row * stride_o + offs, (s * u).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _greedy_kernel(L, Tok, Lp, stride_l, V, BLOCK: tl.constexpr):
    """One row: running max, first index of the max, and sum of exp(x - max) in one pass over the row."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = L + row.to(tl.int64) * stride_l
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # per lane: max, its first index, sum of exp(x - max)
    idx = tl.zeros([BLOCK], dtype=tl.int32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        bigger = x > m
        m_new = tl.maximum(m, x)
        alpha = tl.where(m == m_new, 1.0, tl.exp(m - m_new))  # 1 also while both are -inf
        s = s * alpha + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        idx = tl.where(bigger, cols, idx)
        m = m_new
    row_max = tl.max(m, 0)
    s = tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max))
    first = tl.min(tl.where(m == row_max, idx, V), 0)  # lanes hold the first index of their max
    tl.store(Tok + row, first.to(tl.int64))
    tl.store(Lp + row, -tl.log(tl.sum(s, 0)))


def greedy_sample(logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """`decode_ops.greedy_sample_reference` in one pass over the logits (any float dtype): the same tokens; the
    log-prob of the max is -log(sum(exp(x - max))) with its own float32 summation order."""
    n, v = _rows(logits).shape
    if n:
        _greedy_kernel[(n,)](logits, tokens, logprobs, logits.stride(0), v, BLOCK=2048, num_warps=8)


def _mode(dtype: torch.dtype) -> int:
    """The `_round` mode of an activation dtype."""
    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a [T, N] tensor with contiguous rows, got shape {tuple(x.shape)}")
    return x


class TritonDecodeOps(DecodeOps):
    """`DecodeOps` as fused Triton kernels (CUDA, any float dtype) plus the paged-decode attention kernel
    (`tuned_tiles`: its tiles by batch size, `triton_decode.tuned_tiles`; default: the kernel's fixed tiles)."""

    def __init__(self, tuned_tiles: bool = False) -> None:
        self.tuned_tiles = tuned_tiles

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(_rows(x), None, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self._norm(_rows(residual), _rows(delta), weight, eps)

    @staticmethod
    def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        t, n = x.shape
        y = torch.empty_like(x)
        d = delta if delta is not None else x
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(t,)](
            x,
            d,
            weight,
            y,
            x.stride(0),
            d.stride(0),
            y.stride(0),
            eps,
            N=n,
            BLOCK=block,
            HAS_DELTA=delta is not None,
            MODE=_mode(x.dtype),
            num_warps=max(1, min(16, block // 256)),
        )
        return y

    def qk_norm_rope_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        t, d = q.shape[0], cos.shape[-1]
        hq, hkv = q.shape[1] // d, k.shape[1] // d
        _rows(q), _rows(k), _rows(v), _rows(cos), _rows(sin)
        if cos.stride(0) != sin.stride(0) or d % 2:
            raise ValueError("cos/sin must share strides and head_dim must be even")
        q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        has_norm = q_norm is not None and k_norm is not None
        half = d // 2
        _qk_norm_rope_store_kernel[(t, hq + hkv)](
            q,
            k,
            v,
            q_norm if has_norm else q,
            k_norm if has_norm else k,
            cos,
            sin,
            slots,
            q_out,
            k_cache,
            v_cache,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            cos.stride(0),
            q_out.stride(0),
            q_out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            eps,
            HQ=hq,
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half),
            HAS_NORM=has_norm,
            MODE=_mode(q.dtype),
            num_warps=1,
        )
        return q_out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        t, n = _rows(gate).shape
        _rows(up)
        out = torch.empty_like(gate)
        block = min(4096, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            gate,
            up,
            out,
            gate.stride(0),
            up.stride(0),
            out.stride(0),
            N=n,
            BLOCK=block,
            MODE=_mode(gate.dtype),
            num_warps=4,
        )
        return out

    def greedy_sample(self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        greedy_sample(logits, tokens, logprobs)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        tiles = tuned_tiles(q.shape[0]) if self.tuned_tiles else (None, None, None)
        return paged_decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            block_size=block_size,
            scale=scale,
            block_n=tiles[0],
            num_warps=tiles[1],
            num_stages=tiles[2],
        )
