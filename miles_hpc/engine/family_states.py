"""Per-sequence decode state of the families whose backbone keeps its own (`families.FAMILY_MODULES` modules whose
backbone has `new_state`: DeepSeek-V4's window, compressed entries and partial blocks; Inkling's window and global
keys and values and its convolutions' last inputs). Issue 30.

Stage: engine (the runner's `StepExecutor` hands `FamilyStates.for_step(...)` to the model's forward as its
`family_states`).

Invariants:
- One state per block-table row, made by the backbone: a running request's state lives at its `row` while it runs
  and holds exactly the tokens computed for it (`state.length`), as KV does for the other families.
- A step's sequence whose first new token is at position 0 gets a new state; any later one continues its row's
  state, which must hold exactly `start` tokens (a mismatch is a bug, raised, never a silent wrong answer).
- Hence no prefix reuse for these families (a prefix-cache hit would give tokens no state holds): the engine turns
  the prefix cache off for them, and a retracted request re-prefills from its first token.
- The states are dense per-sequence tensors on the model's device, not paged: `nbytes()` says what they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_hpc.models import CausalLM


def keeps_state(model: CausalLM) -> bool:
    """The backbone caches its own attention state between calls (it has `new_state`)."""
    return hasattr(model.model, "new_state")


class FamilyStates:
    """The decode states of `model`'s running sequences, by block-table row."""

    def __init__(self, model: CausalLM) -> None:
        self.new_state = model.model.new_state  # type: ignore[attr-defined]  # keeps_state(model) holds
        self.rows: dict[int, Any] = {}

    def for_step(self, rows: Sequence[int], starts: Sequence[int]) -> list[Any]:
        """The states of one step's sequences, in order: new ones for those starting at 0."""
        out = []
        for row, start in zip(rows, starts, strict=True):
            if start == 0:
                self.rows[row] = self.new_state()
            state = self.rows.get(row)
            if state is None or state.length != start:
                held = None if state is None else state.length
                raise RuntimeError(f"row {row}: its decode state holds {held} tokens, the step starts at {start}")
            out.append(state)
        return out

    def nbytes(self) -> int:
        return sum(int(s.nbytes()) for s in self.rows.values())
