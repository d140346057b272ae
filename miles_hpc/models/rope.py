"""Rotary position embedding with the HF scaling variants: default, linear, dynamic (NTK), llama3, yarn.

Stage: shared model code.

Invariants:
- Inverse frequencies are computed in float32 with the same ops, in the same order, as transformers 5.24
  `modeling_rope_utils.py`, so cos/sin agree bit for bit in float32.
- The frequencies live in a plain tensor attribute, not a buffer: `model.to(bfloat16)` and `to_empty()` must not
  touch them (a bf16 inv_freq would shift every angle), and they are not part of the checkpoint.
- "dynamic" is computed statelessly from the largest position in the call; transformers caches the grown
  frequencies across calls, so the two agree on each call's own positions only for the first long call after
  a short one, which is what a fresh model (and a fresh engine step) sees.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig, RopeScaling


def _default_inv_freq(base: float | torch.Tensor, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3(inv_freq: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    assert rs.factor and rs.low_freq_factor and rs.high_freq_factor and rs.original_max_position_embeddings
    factor, low, high = rs.factor, rs.low_freq_factor, rs.high_freq_factor
    old_len = rs.original_max_position_embeddings
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(config: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    rs = config.rope_scaling
    assert rs is not None and rs.original_max_position_embeddings is not None
    base = config.rope_theta
    old_len = rs.original_max_position_embeddings
    factor = rs.factor if rs.factor is not None else config.max_position_embeddings / old_len

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.attention_factor
    if attention_factor is None:
        if rs.mscale and rs.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rs.mscale) / get_mscale(factor, rs.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rs.beta_fast or 32
    beta_slow = rs.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.truncate if rs.truncate is not None else True:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _dynamic_inv_freq(config: ModelConfig, dim: int, seq_len: torch.Tensor) -> torch.Tensor:
    # NTK-aware base growth, in transformers' tensor arithmetic (seq_len is a 0-d int64 tensor there too).
    assert config.rope_scaling is not None and config.rope_scaling.factor is not None
    factor = config.rope_scaling.factor
    max_pos = config.max_position_embeddings
    seq_len = torch.maximum(seq_len, torch.tensor(max_pos, dtype=seq_len.dtype, device="cpu"))
    base = config.rope_theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim)


def compute_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [rotary_dim // 2] on CPU, attention_scaling) for the config's RoPE at its native length."""
    dim = config.rotary_dim
    rs = config.rope_scaling
    if rs is None or rs.rope_type == "dynamic":
        return _default_inv_freq(config.rope_theta, dim), 1.0
    if rs.rope_type == "linear":
        assert rs.factor is not None
        return _default_inv_freq(config.rope_theta, dim) / rs.factor, 1.0
    if rs.rope_type == "llama3":
        return _llama3(_default_inv_freq(config.rope_theta, dim), rs), 1.0
    if rs.rope_type == "yarn":
        return _yarn(config, dim)
    raise ValueError(f"unsupported rope_type {rs.rope_type!r}")


class RotaryEmbedding(nn.Module):
    """position_ids [B, T] -> (cos, sin) [B, T, rotary_dim] in the activation dtype, computed once per forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dynamic = config.rope_scaling is not None and config.rope_scaling.rope_type == "dynamic"
        inv_freq, self.attention_scaling = compute_inv_freq(config)
        self._inv_freq_cpu = inv_freq
        self._device_cache: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        device = position_ids.device
        if self.dynamic:
            seq_len = position_ids.max().cpu() + 1
            if int(seq_len) > self.config.max_position_embeddings:
                return _dynamic_inv_freq(self.config, self.config.rotary_dim, seq_len).to(device)
        cached = self._device_cache.get(device)
        if cached is None:
            cached = self._device_cache[device] = self._inv_freq_cpu.to(device)
        return cached

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self._inv_freq(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, R] (broadcast over heads), R <= D: the first R dims of each head rotate (HF's
    half-split convention), the rest pass through (partial rotary, glm4_moe)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :r], x[..., r:]
    return torch.cat([head * cos + rotate_half(head) * sin, rest], dim=-1)
