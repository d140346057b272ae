"""Pipeline parallelism for the megatron-core backend (stage: train; used by `train/megatron.py`): which stage holds
which megatron tensor, and our packed micro-batches through megatron's own pipeline schedule (1F1B,
`get_forward_backward_func`).

Invariants:
- Stages split the decoder layers evenly (megatron's default split: stage s holds layers s*L/P .. (s+1)*L/P - 1,
  named `decoder.layers.<local index>` there); the embedding is on the first stage, the final norm and the output
  layer on the last. With tied embeddings and P > 1 the last stage holds a copy of the embedding as
  `output_layer.weight` (megatron keeps the copies equal by summing their gradients over its embedding group).
- Every stage holds the whole batch (the plan is a pure function of it), so each stage builds the same micro-batches
  and their attention masks; only hidden states travel between stages. Micro-batches differ in length: the
  schedule runs with megatron's `variable_seq_lengths` (shapes are exchanged before each tensor).
- Losses and log-probs exist on the last stage only; the schedule divides each micro-batch's loss by the number of
  micro-batches, which `run_schedule` multiplies back, so the gradient is that of the sum of `loss_of`'s values.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from miles_hpc.train.logprobs import PackedMicroBatch

__all__ = ["StageLayout", "run_schedule"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Where megatron's tensors live over `pp` pipeline stages of a `num_layers`-layer model (names as
    `mcore_weights.mcore_rules` gives them: global layer indices)."""

    pp: int
    num_layers: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_layers % self.pp:
            raise ValueError(
                f"megatron.pipeline_parallel={self.pp} does not divide num_hidden_layers="
                f"{self.num_layers} (stages hold equal numbers of layers)"
            )

    @property
    def per_stage(self) -> int:
        return self.num_layers // self.pp

    def stage_of(self, name: str) -> int:
        """The stage holding megatron tensor `name` (global layer index)."""
        m = _LAYER.match(name)
        if m:
            return int(m.group(1)) // self.per_stage
        return 0 if name.startswith("embedding.") else self.pp - 1

    def local_name(self, name: str) -> str:
        """`name` as its stage's module calls it (the layer index relative to the stage)."""
        return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) % self.per_stage}.", name, count=1)

    def layer_index(self, stage: int, local: int) -> int:
        return stage * self.per_stage + local

    def copies(self, name: str, stage: int) -> list[str]:
        """Local names under which `stage` holds megatron tensor `name`: the tensor itself on its stage, and the
        last stage's copy of a tied embedding."""
        out = [self.local_name(name)] if self.stage_of(name) == stage else []
        tied_copy = self.tied_embeddings and self.pp > 1 and name == "embedding.word_embeddings.weight"
        if tied_copy and stage == self.pp - 1:
            out.append("output_layer.weight")
        return out


def run_schedule(
    model: Any,
    mbs: list[PackedMicroBatch],
    forward: Callable[[Any, PackedMicroBatch], torch.Tensor],
    on_output: Callable[[PackedMicroBatch, torch.Tensor], torch.Tensor],
    *,
    forward_only: bool,
    loss_scale: float = 1.0,
) -> None:
    """megatron's pipeline schedule over `mbs` (every stage passes the same list). `forward(model, mb)` runs this
    stage (megatron feeds it the previous stage's hidden states); on the last stage `on_output(mb, logits)` gives the
    micro-batch's loss (anything when `forward_only`), whose gradient the schedule backpropagates through all stages
    times `loss_scale`."""
    n = len(mbs)
    it = iter(mbs)

    def loss_func(mb: PackedMicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = on_output(mb, output)
        if forward_only:
            return torch.zeros((), device=output.device), {}
        return loss * (loss_scale * n), {}  # megatron divides by the number of micro-batches

    def step(data_iterator: Any, m: Any) -> tuple[torch.Tensor, Callable]:
        mb = next(data_iterator)
        return forward(m, mb), partial(loss_func, mb)

    schedule = get_forward_backward_func()
    kwargs = dict(
        forward_step_func=step,
        data_iterator=it,
        model=[model],
        num_microbatches=n,
        seq_length=max(mb.num_tokens for mb in mbs),
        micro_batch_size=1,
        forward_only=forward_only,
    )
    if forward_only:
        with torch.no_grad():
            schedule(**kwargs)
    else:
        schedule(**kwargs)
