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
  micro-batches, which `run_schedule` multiplies back, so the gradient is that of the sum of `loss_of`'s values
  (times the CP size, which megatron's schedule multiplies in: its DDP averages over DP x CP ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from miles_hpc.planner.mcore_layout import StageLayout
from miles_hpc.train.logprobs import PackedMicroBatch

__all__ = ["StageLayout", "run_schedule"]


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
