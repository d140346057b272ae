"""The attention kernel, kept behind one small replaceable interface.

Stage: shared model code. The trainer uses the default; the engine substitutes a paged-KV-cache backend.

Contract (`AttentionBackend`): called once per layer per forward with q [B, Hq, T, D] and k, v [B, Hkv, T, D],
already projected, QK-normed and rotated (RoPE at the caller's `position_ids`); returns [B, Hq, T, D]. GQA
grouping (Hq // Hkv query heads per kv head) is the backend's job, so a cache stores only Hkv heads.

How to substitute one: pass `attn_backend=` to `CausalLM.forward`. A paged-KV engine builds a backend object per
step that knows, for the tokens of this call, their cache slots and each sequence's cached prefix (block tables);
its `__call__` writes k, v into the cache of layer `layer_idx`, then attends q over the prefix plus the new keys.
The engine passes absolute `position_ids` (prefix length + offset) to `forward` so RoPE matches. Nothing in the
model keeps state between calls, so one model object serves trainer-style and engine-style calls alike.

Default (`sdpa_attention`): causal torch SDPA per row; with `cu_seqlens` (B == 1, several sequences packed into
the row) a loop over the sequences, so attention never crosses a boundary and costs sum(t_i^2), not T^2.
`CausalLM.forward` validates `cu_seqlens` once and hands the layers a host (CPU) copy, so reading the bounds costs
no device sync per layer. Under `torch.compile` (the trainer's `train.compile`) the default backend stays eager:
its loop depends on the bounds, which change every micro-batch, and would otherwise re-specialise the graph.

Every SDPA call of ours (trainer and engine) runs under `no_cudnn_sdpa()`: torch prefers cuDNN's attention on
Hopper, and cuDNN builds an execution plan for every new shape, 4-5 ms of host time per call, while packed RL
batches bring new sequence lengths every step. Measured on one H200 (torch 2.11, tiny Qwen3, 64 packed sequences
of 26-58 tokens): a train step took 1.1-1.6 s with cuDNN, 0.04 s with flash attention, whose GPU time it was.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def no_cudnn_sdpa() -> Any:
    """Context in which `F.scaled_dot_product_attention` picks flash, memory-efficient or math kernels, never
    cuDNN's (module docstring). Sets torch's process-wide backend flags and restores them on exit."""
    return sdpa_kernel(_SDPA_BACKENDS)


class AttentionBackend(Protocol):
    """Computes causal attention for one layer; see the module docstring for shapes and the engine use."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer_idx: int,
        scale: float,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor: ...


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> list[int]:
    """Validate packed-sequence boundaries and return them as a list (one host sync)."""
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (sequences packed into one row), got B={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [n+1] with n >= 1, got shape {tuple(cu_seqlens.shape)}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != seq_len or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={seq_len}, got {bounds}")
    return bounds


@torch.compiler.disable
def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer_idx: int,
    scale: float,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Default `AttentionBackend`: causal scaled-dot-product attention, block-diagonal over packed sequences."""
    del layer_idx  # stateless: every layer is computed the same way
    gqa = q.shape[1] != k.shape[1]
    with no_cudnn_sdpa():
        if cu_seqlens is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        bounds = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2])
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scale, enable_gqa=gqa
            )
            for s, e in zip(bounds, bounds[1:])
            if e > s
        ]
    return torch.cat(parts, dim=2)
