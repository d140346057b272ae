"""Multi-head latent attention (MLA) of the DeepSeek-V3 family (also Kimi-K2), as transformers 5.24 computes it.

Stage: shared model code (the trainer's forward; the embedded engine does not serve MLA yet, engine/core.py says so).

Per token: the query is `q_proj(x)` or, with `q_lora_rank`, `q_b_proj(RMSNorm(q_a_proj(x)))`, split per head into a
part without position (`qk_nope_head_dim`) and a rotary part (`qk_rope_head_dim` = `config.head_dim`).
`kv_a_proj_with_mqa(x)` gives the compressed latent (`kv_lora_rank`, RMS-normed) and ONE rotary key part shared by
all heads; `kv_b_proj(latent)` expands it per head into the key's nope part and the value (`v_head_dim`). Keys are
[nope | rope], queries likewise, so q.k spans qk_head_dim = nope + rope; values are narrower. RoPE rotates either
the two halves (as Llama) or interleaved pairs (`rope_interleave`, DeepSeek's released layout). The softmax scale is
qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn RoPE (transformers' `yarn_apply_mscale`).

Parameter names are the HF ones: `q_proj` | `q_a_proj`, `q_a_layernorm`, `q_b_proj`; `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig
from .layers import RMSNorm
from .rope import apply_rotary


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...; the output lists the rotated evens, then the odds (what
    transformers' `apply_rotary_pos_emb_interleave` returns). cos/sin: [B, T, D] halves-duplicated as usual."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def softmax_scale(config: ModelConfig) -> float:
    scale = config.qk_head_dim**-0.5
    rs = config.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        factor = rs.factor or 1.0
        m = 1.0 if factor <= 1 else 0.1 * rs.mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.interleave = config.rope_interleave
        self.scale = softmax_scale(config)
        h, qk = config.hidden_size, self.num_heads * (self.nope + self.rope)
        bias = config.qkv_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.num_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        k_rot = k_rot.view(b, 1, t, self.rope)
        if self.interleave:
            q_rot, k_rot = rope_interleaved(q_rot, cos, sin), rope_interleaved(k_rot, cos, sin)
        else:
            q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        out = backend(q, k, v.contiguous(), layer_idx=self.layer_idx, scale=self.scale, cu_seqlens=cu_seqlens)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))


__all__ = ["MLAttention", "rope_interleaved", "softmax_scale"]
