"""Pipeline parallelism for the megatron-core backend (stage: train; used by `train/megatron.py`): which stage holds
which megatron tensor, and our packed micro-batches through megatron's own pipeline schedule (1F1B,
`get_forward_backward_func`).

Invariants:
- Stages split the decoder layers evenly (megatron's default split: stage s holds layers s*L/P .. (s+1)*L/P - 1,
  named `decoder.layers.<local index>` there); the embedding is on the first stage, the final norm and the output
  layer on the last. With V virtual stages (`megatron.virtual_pipeline`) each stage holds V model chunks of L/(PV)
  layers, chunk v of stage s holding layers (vP + s) L/(PV) onwards (`StageLayout`), run by megatron's
  interleaved 1F1B schedule: a micro-batch passes every stage V times, the bubble shrinks V-fold. With tied embeddings and P > 1 the last stage holds a copy of the embedding as
  `output_layer.weight` (megatron keeps the copies equal by summing their gradients over its embedding group).
- Every stage holds the whole batch (the plan is a pure function of it), so each stage builds the same micro-batches
  and their attention masks; only hidden states travel between stages. Micro-batches differ in length: the
  schedule runs with megatron's `variable_seq_lengths` (shapes are exchanged before each tensor).
- The interleaved schedule runs micro-batches in groups of P per chunk (megatron's default
  `microbatch_group_size_per_vp_stage`): their number is padded to a multiple of P with one-token dummy
  micro-batches (zero loss, `logprobs.dummy_microbatch`; `interleaved_count`), and to at least 2 P: with fewer,
  stages run every micro-batch in the warm-up, a path of megatron-core 0.16 that deadlocked on gloo at P = 4 with
  4 micro-batches (P = 3 with 3 passed; not investigated further).
- Virtual stages need P >= 3 (`StageLayout`): at P = 2 a stage's previous and next stage are the same rank, and
  megatron-core 0.16's steady state posts its sends to that rank as (gradient, activation) while the peer posts
  its receives as (activation, gradient); point-to-point messages between two ranks match in order, so they cross
  (seen on gloo: a chunk received another micro-batch's shapes).
- Losses and log-probs exist on the last stage only; the schedule divides each micro-batch's loss by the number of
  micro-batches, which `run_schedule` multiplies back, so the gradient is that of the sum of `loss_of`'s values
  (times the CP size, which megatron's schedule multiplies in: its DDP averages over DP x CP ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core.parallel_state import get_pipeline_model_parallel_world_size
from megatron.core.pipeline_parallel import get_forward_backward_func

from miles_hpc.planner.mcore_layout import StageLayout
from miles_hpc.train.logprobs import PackedMicroBatch, dummy_microbatch

__all__ = ["StageLayout", "interleaved_count", "run_schedule"]


def interleaved_count(num_microbatches: int, pp: int) -> int:
    """Micro-batches the interleaved schedule runs for `num_microbatches` of ours (the rest are dummies): a multiple
    of the `pp` stages (megatron's default group of P micro-batches per chunk), and at least 2 P, so that no stage
    runs all of its micro-batches in the warm-up (at most 2 (P - 1) + (V - 1) P of the 2 P V chunk forwards)."""
    return max(-(-num_microbatches // pp) * pp, 2 * pp)


def run_schedule(
    chunks: list[Any],
    mbs: list[PackedMicroBatch],
    forward: Callable[[Any, PackedMicroBatch], torch.Tensor],
    on_output: Callable[[PackedMicroBatch, torch.Tensor], torch.Tensor],
    *,
    forward_only: bool,
    loss_scale: float = 1.0,
) -> None:
    """megatron's pipeline schedule over `mbs` (every stage passes the same list) and this stage's model `chunks`
    (one, or one per virtual stage: the interleaved schedule). `forward(chunk, mb)` runs a chunk (megatron feeds
    it the previous chunk's hidden states); on the last chunk `on_output(mb, logits)` gives the micro-batch's loss
    (anything when `forward_only`), whose gradient the schedule backpropagates through all stages times
    `loss_scale`."""
    if len(chunks) > 1:
        pp = get_pipeline_model_parallel_world_size()
        device = mbs[0].input_ids.device
        mbs = mbs + [dummy_microbatch(device) for _ in range(interleaved_count(len(mbs), pp) - len(mbs))]
    n = len(mbs)

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
        data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs),  # each chunk walks them all
        model=chunks,
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
