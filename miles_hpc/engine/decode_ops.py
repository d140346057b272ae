"""The few ops of a decode step that are worth fusing, behind one interface: torch reference and Triton versions.

Stage: engine (`DecodeForward` runs a dense model's decode step through a `DecodeOps`). `TorchDecodeOps` is the
reference: the model's own torch formulas (models/layers.py, models/rope.py), so the fused kernels of
`triton_ops.TritonDecodeOps` are tested against it, and it runs the same forward on CPU.

Numerics contract (every implementation): results are rounded to the activation dtype exactly where the model's
torch code rounds (after the residual add, after normalising and before the weight multiply, after each RoPE
product), so in bfloat16 a fused op differs from the torch code only by float32 reduction order.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from miles_hpc.models.attention import no_cudnn_sdpa
from miles_hpc.models.rope import rotate_half


class DecodeOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] -> RMSNorm(x) [T, H]."""
        ...

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta (in place, rounded as `residual + delta`); returns RMSNorm(residual)."""
        ...

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
        """q [T, Hq*D], k/v [T, Hkv*D] (projections); per-head RMSNorm of q and k (when the weights are given),
        RoPE with cos/sin [T, D]; k, v written to the caches [slots, Hkv, D] at `slots` [T]. Returns q [T, Hq, D]."""
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up."""
        ...

    def greedy_sample(self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Per row of logits [N, V]: the first index of the largest value into tokens (int64 [N]) and its
        log-prob under the float32 log-softmax into logprobs (float32 [N]), as `sampling.sample` does greedily."""
        ...

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
        """One query per row over its paged context: q [N, Hq, D] -> [N, Hq, D] (see triton_decode.py)."""
        ...


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Torch formula of `triton_decode.paged_decode`: gather each row's keys by slot, masked SDPA (one host sync)."""
    n, hq, _ = q.shape
    if n == 0:
        return torch.empty_like(q)
    lens = context_lens.to(torch.int64)
    kpos = torch.arange(int(lens.max()), device=q.device)
    blk = (kpos // block_size).clamp(max=block_tables.shape[1] - 1)
    mask = kpos[None, :] < lens[:, None]
    slots = (block_tables.to(torch.int64)[:, blk] * block_size + kpos % block_size).masked_fill(~mask, 0)
    k = k_cache[slots].transpose(1, 2)  # [N, Hkv, ctx, D]
    v = v_cache[slots].transpose(1, 2)
    with no_cudnn_sdpa():
        o = F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask[:, None, None], scale=scale, enable_gqa=hq != k.shape[1]
        )
    return o[:, :, 0]


def greedy_sample_reference(logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """`sampling.sample`'s greedy case, op for op: argmax of the float32 logits, log_softmax gathered there."""
    lf = logits.to(torch.float32)
    tok = lf.argmax(dim=-1)
    tokens.copy_(tok)
    logprobs.copy_(torch.log_softmax(lf, dim=-1).gather(1, tok[:, None]).squeeze(1))


class TorchDecodeOps:
    """`DecodeOps` in plain torch, op for op the model's code."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * _rms(x, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        residual.copy_(residual + delta)
        return weight * _rms(residual, eps)

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
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm * _rms(q, eps), k_norm * _rms(k, eps)
        c, s = cos[:, None], sin[:, None]
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        return q

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def greedy_sample(self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        greedy_sample_reference(logits, tokens, logprobs)

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
        return paged_decode_reference(
            q, k_cache, v_cache, block_tables, context_lens, block_size=block_size, scale=scale
        )
