"""Zero-KL mode for a model (stage: shared model code; issue 12; docs/lora.md, "Zero-KL mode").

`make_batch_invariant(model)` switches an existing `CausalLM` in place to the batch-invariant primitives of
`invariant.py`, so a token's logits are bit-identical whether the engine computes it in a decode step of 1 row, in
a prefill chunk after a cached prefix, or the trainer in a packed micro-batch of thousands:
- every `nn.Linear`, `RMSNorm` and the SwiGLU MLP get an instance `forward` over fixed-shape row tiles (parameter
  names, hooks and checkpoints are unchanged: nothing is wrapped, only the instance's `forward` is replaced, and
  it reads the module's parameters at call time, so FSDP's gathered parameters and in-place weight updates are
  what it uses);
- RoPE's cos/sin (transcendental elementwise kernels, whose vector path depends on where an element sits in the
  tensor) are computed on tiles of one position per row;
- attention is the caller's: `packed_attention` here for the trainer (per packed sequence), the engine's paged
  backend in its invariant mode. The rest (embedding lookup, residual adds, RoPE's multiply-adds, casts) is
  elementwise IEEE arithmetic, exact whatever the batch.

MoE and MLA models are refused (NotImplementedError naming the model type): the routers' top-k and the grouped
expert GEMMs are not tiled yet.
"""

from __future__ import annotations

import logging

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .attention import check_cu_seqlens
from .layers import RMSNorm, SwiGLUMLP
from .transformer import CausalLM

__all__ = ["is_batch_invariant", "make_batch_invariant", "packed_attention"]

_FLAG = "_miles_batch_invariant"


def is_batch_invariant(model: nn.Module) -> bool:
    return bool(getattr(model, _FLAG, False))


log = logging.getLogger(__name__)
MAX_CPU_THREADS = 8


def cap_cpu_threads(device: torch.device) -> None:
    """On the CPU, at most MAX_CPU_THREADS intra-op threads for this process: with more (16 measured), torch's
    multithreaded CPU GEMM gives a row different bits depending on its place in a fixed-shape tile (docs/lora.md,
    Zero-KL mode), which would break the mode; 1-8 threads were invariant in every check."""
    if device.type == "cpu" and torch.get_num_threads() > MAX_CPU_THREADS:
        log.warning("zero-KL mode: %d CPU threads capped to %d (batch invariance of the CPU GEMM)",
                    torch.get_num_threads(), MAX_CPU_THREADS)  # fmt: skip
        torch.set_num_threads(MAX_CPU_THREADS)


def make_batch_invariant(model: CausalLM) -> CausalLM:
    """Switch `model`'s forward pieces to batch-invariant ones, in place (idempotent); returns `model`."""
    cfg = model.config
    if cfg.is_mla or model.num_moe_layers:
        raise NotImplementedError(f"zero-KL mode (batch-invariant kernels) supports the dense families (llama, "
                                  f"qwen2, qwen3); model_type {cfg.model_type!r} has "
                                  f"{'MLA attention' if cfg.is_mla else 'MoE layers'}")  # fmt: skip
    if is_batch_invariant(model):
        return model
    cap_cpu_threads(next(model.parameters()).device)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            _set_forward(module, _linear_forward(module))
        elif isinstance(module, RMSNorm):
            _set_forward(module, _rms_norm_forward(module))
        elif isinstance(module, SwiGLUMLP):
            _set_forward(module, _mlp_forward(module))
    _set_forward(model.rotary, _rope_forward(model.rotary))
    setattr(model, _FLAG, True)
    return model


def _set_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.forward = forward  # type: ignore[method-assign]


def _linear_forward(m: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: invariant.linear(x, m.weight, m.bias)


def _rms_norm_forward(m: RMSNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: invariant.rms_norm(x, m.weight, m.eps)


def _mlp_forward(m: SwiGLUMLP) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = m.gate_proj(x), m.up_proj(x)  # already tiled linears
        if m.act is F.silu:
            h = invariant.silu_mul(gate, up)
        else:  # gelu variants: the same tiling as silu_mul, with the model's activation
            w = gate.shape[-1]
            h = invariant.tiled(lambda t: m.act(t[:, :w]) * t[:, w:], torch.cat([gate, up], dim=-1), width=2 * w)
        return m.down_proj(h)

    return forward


def _rope_forward(rot: nn.Module) -> Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]:
    """`RotaryEmbedding.forward` with cos/sin on fixed-shape tiles (one position per row). The angle itself is one
    float32 multiply per element, exact anywhere."""

    def forward(position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * rot._inv_freq(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)
        r = emb.shape[-1]
        both = invariant.tiled(lambda t: torch.cat([t.cos(), t.sin()], dim=-1), emb)
        cos, sin = both[..., :r] * rot.attention_scaling, both[..., r:] * rot.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    return forward


@torch.compiler.disable
def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer_idx: int,
    scale: float,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Batch-invariant `AttentionBackend` for the trainer: `invariant.attention` per sequence (each row of the batch,
    or each packed sequence of `cu_seqlens`), positions 0..n-1 within it, as the engine attends over its cache."""
    del layer_idx
    b, _, t, _ = q.shape
    if cu_seqlens is None:
        spans = [(row, 0, t) for row in range(b)]
    else:
        bounds = check_cu_seqlens(cu_seqlens, b, t)
        spans = [(0, s, e) for s, e in pairwise(bounds) if e > s]
    outs: list[list[torch.Tensor]] = [[] for _ in range(b)]
    for row, s, e in spans:
        pos = torch.arange(e - s, device=q.device)
        outs[row].append(invariant.attention(q[row, :, s:e], k[row, :, s:e], v[row, :, s:e], pos, scale))
    return torch.stack([torch.cat(parts, dim=1) for parts in outs])
