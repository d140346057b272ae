"""Sequence parallelism in the megatron-core backend (stage: train; used by `train/mcore_model.py` and
`train/megatron.py`): megatron runs MoE layers under TP only with sequence parallelism (each TP rank holds T / TP
tokens of the packed row between blocks); what this backend adds around it (docs/megatron.md, "MoE under tensor
parallelism"): norms that take SP without Transformer Engine, expert gradients summed over the TP ranks, and the
row's padding and per-rank slices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from miles_hpc.train.mcore_mla import without_sequence_parallel

__all__ = [
    "SequenceParallelNorm",
    "experts_reduce_over_tp",
    "sequence_parallel",
    "sp_length",
    "sp_norms",
    "sp_slice",
]


class SequenceParallelNorm:
    """megatron's torch norm (`WrappedTorchNorm`: RMSNorm or LayerNorm by the config) for sequence parallelism,
    which megatron's own refuses without Transformer Engine: under SP a norm sees only its TP rank's chunk of the
    tokens, so its weight's gradient is a partial sum; `sequence_parallel` on the weight makes megatron's
    `finalize_model_grads` sum it over the TP ranks, as it does for TE's norms."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        norm = WrappedTorchNorm(config=without_sequence_parallel(config), hidden_size=hidden_size, eps=eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def sp_norms(spec: Any) -> Any:
    """`spec` (a layer or block spec, nested) with megatron's torch norms replaced by `SequenceParallelNorm`. The QK
    norms too (megatron refuses its own under SP): their gradients are partial sums over the heads, and megatron
    sums them over the TP ranks once, by name or by the attribute."""
    if spec is WrappedTorchNorm:
        return SequenceParallelNorm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=sp_norms(spec.submodules))
    if isinstance(spec, list):
        return [sp_norms(x) for x in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: sp_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def experts_reduce_over_tp(model: torch.nn.Module) -> None:
    """Under sequence parallelism each TP rank runs the (whole, expert TP 1) experts on its own chunk of tokens, so
    their gradients are partial sums to be added over the TP ranks. megatron reduces expert-parallel parameters
    over the expert-data-parallel group, which holds the TP ranks (TP x DP / EP ranks); with expert_parallel=1 it
    takes experts for dense parameters (reduced over data-parallel ranks only). Marking them expert-parallel
    (`allreduce` False, as EP > 1 does) gives them that reduction at every EP size."""
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False  # type: ignore[attr-defined]


def sequence_parallel(model: Any) -> bool:
    """Whether `model` (a GPTModel or megatron's DDP around one) runs with sequence parallelism (MoE under TP)."""
    return bool(getattr(model.config, "sequence_parallel", False))


def sp_length(tokens: int, sp: bool) -> int:
    """The packed row's length as the model runs it: `tokens` rounded up to a multiple of the TP size under
    sequence parallelism `sp` (megatron splits the row evenly over the TP ranks)."""
    if not sp:
        return tokens
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return -(-tokens // tp) * tp


def sp_slice(rows: torch.Tensor, sp: bool, fill: int = -1) -> torch.Tensor:
    """This TP rank's share of per-token `rows` [T, ...] under sequence parallelism `sp` (the tokens its MoE layers
    route: T padded with `fill` rows to `sp_length`, then the rank's contiguous chunk); `rows` itself without."""
    if not sp:
        return rows
    t = rows.shape[0]
    padded = sp_length(t, sp)
    if padded > t:
        rows = torch.cat([rows, rows.new_full((padded - t, *rows.shape[1:]), fill)])
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunk = padded // tp
    r = parallel_state.get_tensor_model_parallel_rank()
    return rows[r * chunk : (r + 1) * chunk]
