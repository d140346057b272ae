"""megatron-core's core attention replaced by SDPA over packed sequences (stage: training, megatron backend; issue 32
item 1; docs/megatron.md).

megatron's local layer spec (what runs without Transformer Engine) computes attention as a softmax over a
materialised [heads, T, T] score tensor with the packed row's block-diagonal mask: memory and time quadratic in
the micro-batch's tokens, so the backend ran one sequence per micro-batch. `PackedCoreAttention` takes the
sequence bounds instead of the mask and runs causal SDPA per sequence (the flash or memory-efficient kernel on a
GPU), the attention our own model runs (`models.attention.sdpa_attention`).

How the bounds travel: as the `attention_mask` argument itself, a host int64 tensor [n+1] of sequence bounds
(`packed_mask`), which megatron passes unchanged from `GPTModel.forward` to every layer's core attention, also into
activation recompute (it is an argument of the checkpointed function), and which is read without a device sync.
A boolean mask there (a caller that built one) is refused with a message.

Used where the core attention is megatron's local one (dense and MoE layers, MLA's subclass) and context
parallelism is off (`CPCoreAttention` handles CP, DSA's core attention its own masks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from miles_hpc.models.attention import no_cudnn_sdpa
from miles_hpc.planner.accounting import sdpa_core_attention

__all__ = ["PackedCoreAttention", "RowCoreAttention", "packed_mask", "packs_attention", "replace_core_attention"]


def packs_attention(tcfg: Any, dsa: bool) -> bool:
    """Whether a model of megatron config `tcfg` gets `PackedCoreAttention` (its layers take the row's sequence
    bounds, not a mask): the planner's rule (`planner.accounting.sdpa_core_attention`), which sizes its memory."""
    return sdpa_core_attention(dsa, tcfg.context_parallel_size)


def packed_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The `attention_mask` a model with `PackedCoreAttention` takes: the row's sequence bounds [n+1] (0 .. T),
    int64 on the host."""
    return cu_seqlens.to(device="cpu", dtype=torch.int64)


class RowCoreAttention(MegatronModule):
    """What this project's replacements of megatron's local core attention share (its constructor's arguments):
    the softmax scale, megatron's (1 / sqrt(kv_channels) unless given, as MLA gives it), and no dropout (the
    configs here have none). `WHAT` names the subclass in its refusals."""

    WHAT = "core attention"

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **kwargs: Any,  # MLA's k_channels / v_channels: the widths come with the tensors
    ) -> None:
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise NotImplementedError(f"{self.WHAT}: attention dropout is not supported")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5


class PackedCoreAttention(RowCoreAttention):
    """megatron's core-attention interface (the local `DotProductAttention`'s arguments): queries [T, 1, heads, d],
    keys and values [T, 1, kv heads, d / dv] of one packed row, `attention_mask` its bounds (`packed_mask`);
    causal attention within each sequence."""

    WHAT = "packed SDPA attention"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None or query.shape[1] != 1:
            raise NotImplementedError("packed SDPA attention runs one packed row (batch 1), no bias")
        if attention_mask is None or attention_mask.dtype != torch.int64 or attention_mask.dim() != 1:
            got = None if attention_mask is None else (attention_mask.dtype, tuple(attention_mask.shape))
            raise ValueError(f"packed SDPA attention takes the row's sequence bounds as attention_mask, got {got}")
        bounds = attention_mask.tolist()
        t = query.shape[0]
        if bounds[0] != 0 or bounds[-1] != t or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"packed SDPA attention: bounds {bounds[:4]}..{bounds[-2:]} do not cover {t} tokens")
        q, k, v = (x[:, 0].transpose(0, 1)[None] for x in (query, key, value))  # [1, heads, T, d]
        gqa = q.shape[1] != k.shape[1]
        with no_cudnn_sdpa():
            parts = [
                F.scaled_dot_product_attention(
                    q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
                )
                for s, e in zip(bounds, bounds[1:])
                if e > s
            ]
        out = torch.cat(parts, dim=2)[0]  # [heads, T, dv]
        return out.transpose(0, 1).reshape(t, 1, -1)


def replace_core_attention(spec: Any, cls: type) -> Any:
    """`spec` (a layer or block spec, nested) with megatron's local core attention (and MLA's, a subclass of it)
    replaced by `cls`; other core attentions (DSA's) are left alone."""
    if isinstance(spec, type) and issubclass(spec, DotProductAttention):
        return cls
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec,
            module=replace_core_attention(spec.module, cls),
            submodules=replace_core_attention(spec.submodules, cls),
        )
    if isinstance(spec, list):
        return [replace_core_attention(x, cls) for x in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: replace_core_attention(getattr(spec, f.name), cls) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec
