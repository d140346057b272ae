"""Tensor-parallel layout of an embedded engine: the model each TP rank runs and its part of each HF tensor.

Stage: engine. What a rank holds is `planner.transfer.engine_layout`'s box, the same function the p2p plan and the
planner use (SGLang's split: column-parallel q/k/v, gate/up and the experts' by output rows, k/v per KV head with
heads replicated when the ranks outnumber them; row-parallel o_proj/down_proj by input columns; the vocabulary in
blocks of ceil(vocab / tp) rows; everything else, norms, routers, MLA's down projections, the DSA indexer,
replicated). This module adds what the engine needs around it:
- `local_config`: the rank's model (heads, KV heads, FFN widths and the vocabulary divided), whose HF tensors have
  the shapes `local_shape` gives;
- `take`: a rank's local tensor of a full one (the box's elements at the start, zeros where the box is shorter:
  the last vocabulary block);
- row-parallel biases (`o_proj`, `down_proj`) are held whole but applied by rank 0 only (`row_bias`), since the
  ranks' partial outputs are summed.

Invariants: `local_config(c, tp)` with tp 1 is `c`; a config tp does not fit is refused naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from miles_hpc.models import ModelConfig
from miles_hpc.models.hf_io import hf_parts
from miles_hpc.planner.transfer import Box, engine_layout

__all__ = ["check_tp", "is_fused", "layout", "local_config", "local_shape", "per_expert", "row_bias", "take"]

_ROW_BIAS = re.compile(r"\.(o_proj|down_proj)\.bias$")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def check_tp(config: ModelConfig, tp: int) -> None:
    """ValueError naming the config field that `tp` does not fit (or the tp size itself)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp!r}")
    if tp == 1:
        return
    c = config
    if c.num_attention_heads % tp:
        raise ValueError(f"tp_size {tp} does not divide num_attention_heads={c.num_attention_heads}")
    if c.num_key_value_heads % tp and tp % c.num_key_value_heads:
        raise ValueError(
            f"tp_size {tp} and num_key_value_heads={c.num_key_value_heads}: one must divide the other "
            "(KV heads are split, or each replicated on tp / kv_heads ranks)"
        )
    if any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers)) and c.intermediate_size % tp:
        raise ValueError(f"tp_size {tp} does not divide intermediate_size={c.intermediate_size}")
    if c.num_experts and c.moe_intermediate_size % tp:
        raise ValueError(f"tp_size {tp} does not divide moe_intermediate_size={c.moe_intermediate_size}")


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The model one of `tp` ranks runs."""
    check_tp(config, tp)
    if tp == 1:
        return config
    c = config
    changes = {
        "num_attention_heads": c.num_attention_heads // tp,
        # MLA configs carry num_key_value_heads = num_attention_heads (they have no K/V heads of their own).
        "num_key_value_heads": max(c.num_key_value_heads // tp, 1),
        "vocab_size": -(-c.vocab_size // tp),
    }
    if c.intermediate_size % tp == 0:  # an all-MoE model's unused dense width may not divide
        changes["intermediate_size"] = c.intermediate_size // tp
    if c.num_experts:
        changes["moe_intermediate_size"] = c.moe_intermediate_size // tp
    return c.replace(**changes)


def layout(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], tp: int) -> dict[str, dict[int, Box]]:
    """HF name -> {tp rank: the box of the full tensor it holds} (ranks holding nothing are absent)."""
    kv = None if config.is_mla else config.num_key_value_heads
    experts = config.num_experts or None
    needs = engine_layout(shapes, tp, 1, kv_heads=kv, num_experts=experts)
    return {name: {r.rank: box for r, box in by_rank.items()} for name, by_rank in needs.items()}


def local_shape(full: tuple[int, ...], box: Box | None, name: str, config: ModelConfig, tp: int) -> tuple[int, ...]:
    """The rank-local shape of tensor `name`: its box's, or a whole vocabulary block for the vocabulary tensors."""
    if re.search(r"(^|\.)(embed_tokens|lm_head)\.weight$", name) and tp > 1:
        return (-(-config.vocab_size // tp), *full[1:])
    if box is None:
        raise ValueError(f"tensor {name!r}: no part of it on this rank")
    return box.shape


def take(full: torch.Tensor, box: Box | None, shape: tuple[int, ...]) -> torch.Tensor:
    """The local tensor of shape `shape` holding `full[box]` at its start (a view when the box fills it)."""
    if box is not None and box.shape == tuple(shape):
        return full[box.slices()]
    out = full.new_zeros(shape)
    if box is not None:
        out[tuple(slice(0, n) for n in box.shape)] = full[box.slices()]
    return out


def row_bias(name: str) -> bool:
    """A row-parallel layer's bias: rank 0 adds it, the other ranks hold zeros."""
    return _ROW_BIAS.search(name) is not None


def is_fused(name: str) -> bool:
    """A fused expert tensor's name (all experts of a layer in one tensor)."""
    return _FUSED.search(name) is not None


def per_expert(config: ModelConfig, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused expert tensors (`mlp.experts.gate_up_proj`, as some checkpoints store them) as the per-expert HF names
    the layout splits; everything else unchanged."""
    for name, t in named:
        if is_fused(name):
            yield from ((n, t[idx]) for n, idx in hf_parts(config, name, t.shape))
        else:
            yield name, t
