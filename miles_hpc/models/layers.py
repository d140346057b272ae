"""Building blocks shared by every family: RMSNorm (and qwen3_next's zero-centred one), SwiGLU MLP, GQA
self-attention with optional QK-norm and output gate.

Stage: shared model code.

Invariants:
- Parameter names equal the HF module names (`q_proj`, `q_norm`, `gate_proj`, ...), so a dense model's
  `state_dict()` keys are its HF checkpoint names.
- Numerics follow transformers: RMSNorm normalises in float32 and casts back before the weight multiply; q/k
  are normed per head (over head_dim) before RoPE.
- The attention kernel is not here: `Attention.forward` takes an `AttentionBackend` (see attention.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig
from .rope import apply_rotary

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": lambda x: F.relu(x).square(),  # Nemotron-H's MLPs and experts
    # transformers' ACT2FN formulas for the rest (its NewGELUActivation and QuickGELUActivation written out)
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "tanh": torch.tanh,
    "mish": F.mish,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32  # Nemotron-H: times the weight in float32, then cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * h).to(dtype)
        # Cast before the weight multiply, as transformers does (matters in bf16).
        return self.weight * h.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm (qwen3_next): normalised in float32, times 1 + weight in float32, cast back; the
    weight starts at 0."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The family's RMSNorm: zero-centred (qwen3_next), weight applied in float32 (nemotron_h) or the usual."""
    if config.zero_centered_norms:
        return OffsetRMSNorm(dim, config.rms_norm_eps)
    return RMSNorm(dim, config.rms_norm_eps, weight_in_fp32=config.model_type == "nemotron_h")


class SwiGLUMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections, QK-norm and RoPE around a pluggable attention kernel."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h, d = config.hidden_size, config.head_dim
        self.output_gate = config.attn_output_gate  # q_proj gives [q | gate] per head (qwen3_next)
        self.q_proj = nn.Linear(h, self.num_heads * d * (2 if self.output_gate else 1), bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_bias)
        self.rotary = config.rotary_dim > 0  # Nemotron-H: no position embedding
        self.q_norm = make_norm(config, d) if config.qk_norm else None
        self.k_norm = make_norm(config, d) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        gate = None
        if self.output_gate:
            q, gate = self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend(q, k, v.transpose(1, 2), layer_idx=self.layer_idx, scale=self.scale, cu_seqlens=cu_seqlens)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(out)
