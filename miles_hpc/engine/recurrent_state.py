"""Per-sequence recurrent state of a hybrid model's recurrent layers (Gated DeltaNet, Mamba-2), beside the paged KV
cache of its attention layers. Issue 29.

Stage: engine (the runner's `StepExecutor` hands `RecurrentStates.backend(...)` to the model's forward as its
`linear_backend`).

Invariants:
- One slot per block-table row: a running request's state lives at its `row` for as long as it runs; per recurrent
  layer, the short convolution's last W - 1 inputs (model dtype) and the scan's state (float32): the delta rule's
  [n_v, d_k, d_v] matrix, or Mamba-2's [heads, head_dim, state].
- A step's sequence whose first new token is at position 0 starts from zeros; any later one continues from its
  row's state, which the previous step of the same request left there (a prefill chunk or a decode token). So
  state exists exactly for the computed tokens, as KV does.
- Hence no prefix reuse for hybrid models: a prefix-cache hit would give KV for tokens whose state no row holds,
  so the engine turns the prefix cache off for them (docs/engine.md). A retracted request re-prefills from its first
  token, its state recomputed with it.
- After each layer, the state of each of the step's sequences is written back to its row; the other rows are
  untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from miles_hpc.models import CausalLM
from miles_hpc.models.linear_attn import LinearState


class RecurrentStates:
    """The state slots of every recurrent layer of `model`, `rows` of them (the block table's rows)."""

    def __init__(self, model: CausalLM, rows: int, device: torch.device) -> None:
        dtype = next(model.parameters()).dtype
        self.conv: dict[int, torch.Tensor] = {}
        self.rule: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
            mixer = getattr(layer, "recurrent", None)  # Gated DeltaNet, Mamba-2 or None (transformer.py)
            if mixer is None:
                continue
            conv, scan = mixer.state_shapes()
            self.conv[i] = torch.zeros(rows, *conv, dtype=dtype, device=device)
            self.rule[i] = torch.zeros(rows, *scan, dtype=torch.float32, device=device)

    @property
    def bytes_per_sequence(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.conv.values(), *self.rule.values()))

    def backend(self, rows: Sequence[int], continuing: Sequence[bool]) -> StateBackend:
        """The step's linear backend: sequence i is at block-table row ``rows[i]`` and continues from its state when
        ``continuing[i]`` (its first new token is not its first token)."""
        return StateBackend(self, rows, continuing)


class StateBackend:
    """Runs a linear-attention layer over the step's sequences from their rows' states and stores the new ones."""

    def __init__(self, states: RecurrentStates, rows: Sequence[int], continuing: Sequence[bool]) -> None:
        self.states = states
        device = next(iter(states.rule.values())).device if states.rule else torch.device("cpu")
        self.rows = torch.tensor(list(rows), dtype=torch.int64, device=device)
        self.keep = torch.tensor(list(continuing), dtype=torch.bool, device=device)

    def __call__(
        self, layer_idx: int, module: nn.Module, h: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor:
        if cu_seqlens is None:
            raise ValueError("the engine's linear backend runs packed steps (cu_seqlens)")
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if len(lengths) != len(self.rows):
            raise ValueError(f"{len(lengths)} sequences in the step, {len(self.rows)} state rows")
        conv, rule = self.states.conv[layer_idx], self.states.rule[layer_idx]
        start = LinearState(
            torch.where(self.keep[:, None, None], conv[self.rows], 0.0),
            torch.where(self.keep[:, None, None, None], rule[self.rows], 0.0),
        )
        out, end = module(h, lengths=lengths, state=start)
        conv[self.rows] = end.conv.to(conv.dtype)
        rule[self.rows] = end.rule
        return out
