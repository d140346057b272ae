"""Inkling's per-sequence decode cache: what one sequence's past leaves behind for the tokens that continue it
(`InklingBackbone.new_state`, filled and extended in place by `InklingBackbone.run(..., states=...)`).

Stage: shared model code (the engine holds one state per running sequence; the trainer never builds one).

Layout, per layer (`LayerState`):
- `k`, `v` [1, Hkv, L, D] of the layer's own head layout: keys after k_sconv and k_norm, values after v_sconv,
  of the sequence's last L tokens. A global layer keeps every past token (L == length); a sliding layer only the
  last `sliding_window_size - 1` (the most any later query can still see), so it stops growing.
- `conv[name]` [K - 1, C]: the last K - 1 inputs of each short convolution ("k" / "v": the raw k_proj / v_proj
  outputs, "attn" / "mlp": the attention and MLP outputs before the residual branch's convolution), zeros
  standing for the positions before the sequence's start. Absent until the first call: a fresh sequence.
- Nothing for the relative logits (a query's own r_proj state and the distances make them) nor for the log
  scaling (the query's absolute position, `length` + its offset).

Invariants:
- `length` counts the tokens every layer's cache has consumed; all layers advance together (the backbone bumps it
  once per call, after every layer ran).
- Tensors are detached and hold the dtype the forward computed them in (the model's); nothing needs gradients.
- `state_bytes` says what a state holds from the config and its length alone (the planner's rollout cache,
  planner/measure.py), however the tokens came in calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import ModelConfig

CONV_NAMES = ("k", "v", "attn", "mlp")
"""The four short convolutions of a layer whose last inputs a state keeps."""


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(eq=False)
class LayerState:
    """One layer's cache (module docstring); None / absent entries: nothing seen yet."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    conv: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return _bytes(self.k) + _bytes(self.v) + sum(_bytes(t) for t in self.conv.values())


@dataclass(eq=False)
class InklingState:
    """One sequence's cache over every layer; `length` tokens consumed so far."""

    layers: list[LayerState]
    length: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> InklingState:
        return cls([LayerState() for _ in range(num_layers)])

    def nbytes(self) -> int:
        """Bytes of the tensors held (keys, values, convolution inputs of every layer)."""
        return sum(layer.nbytes() for layer in self.layers)


def state_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """`InklingState.nbytes()` of a sequence of `tokens` tokens whose tensors hold `dtype_bytes` per element (the
    model's dtype): per layer its keys and values (a sliding layer's last window - 1, a global layer's all) and,
    once a token has come, the last K - 1 inputs of its four convolutions (module docstring)."""
    if tokens <= 0:
        return 0
    s = cfg.spec
    elements = 0
    for kind in s.layer_types:
        if kind == "hybrid_sliding":
            width, held = s.swa_num_key_value_heads * s.swa_head_dim, min(tokens, max(s.sliding_window_size - 1, 0))
        else:
            width, held = cfg.num_key_value_heads * cfg.head_dim, tokens
        elements += 2 * width * held + (s.conv_kernel_size - 1) * 2 * (width + cfg.hidden_size)
    return elements * dtype_bytes
