"""Packed micro-batch tensors and per-token log-probs/entropy from logits (stage: train; no process groups).

Alignment (the convention of `TrainBatch` and `policy_loss`): the value at token t is about token t, computed from
the logits at t-1 of the same sequence; the first token of every sequence has no logits before it and gets 0.0
(and never carries loss: its mask is forced to 0 here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_hpc.train.batch import TrainBatch

__all__ = ["PackedMicroBatch", "pack_samples", "dummy_microbatch", "token_logprobs"]


@dataclass(frozen=True, slots=True)
class PackedMicroBatch:
    """Sequences concatenated into one row (no padding); everything per token is 1-D of length T."""

    sample_ids: tuple[int, ...]  # batch indices, in packing order
    input_ids: torch.Tensor  # long [1, T]
    position_ids: torch.Tensor  # long [1, T], restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # int32 [n+1]
    seq_ids: torch.Tensor  # long [T], 0..n-1: which sequence of this micro-batch a token belongs to
    is_start: torch.Tensor  # bool [T], the first token of each sequence
    loss_mask: torch.Tensor  # float32 [T] (0 on each sequence's first token)
    advantages: torch.Tensor  # float32 [T]
    rollout_logprobs: torch.Tensor  # float32 [T]
    ref_logprobs: torch.Tensor | None  # float32 [T]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def is_dummy(self) -> bool:
        return not self.sample_ids

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-token 1-D `values` cut back into one tensor per sample (in `sample_ids` order)."""
        sizes = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        return list(torch.split(values, sizes))


def pack_samples(batch: TrainBatch, sample_ids: Sequence[int], device: torch.device) -> PackedMicroBatch:
    if not sample_ids:
        raise ValueError("pack_samples needs at least one sample (use dummy_microbatch)")
    lengths = [len(batch.tokens[i]) for i in sample_ids]

    def flat(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([v for i in sample_ids for v in rows[i]], dtype=dtype, device=device)

    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    is_start = positions == 0
    mask = flat(batch.loss_mask, torch.float32)
    mask = mask.masked_fill(is_start.to(device), 0.0)
    return PackedMicroBatch(
        sample_ids=tuple(sample_ids),
        input_ids=flat(batch.tokens, torch.long).unsqueeze(0),
        position_ids=positions.to(device).unsqueeze(0),
        cu_seqlens=cu.to(device=device, dtype=torch.int32),
        seq_ids=seq_ids.to(device),
        is_start=is_start.to(device),
        loss_mask=mask,
        advantages=flat(batch.advantages, torch.float32),
        rollout_logprobs=flat(batch.rollout_logprobs, torch.float32),
        ref_logprobs=flat(batch.ref_logprobs, torch.float32) if batch.ref_logprobs is not None else None,
    )


def dummy_microbatch(device: torch.device) -> PackedMicroBatch:
    """One token, no loss: run by a rank with fewer micro-batches than another, so that FSDP's per-forward
    all-gathers and per-backward reduce-scatters stay matched across ranks."""
    z = torch.zeros(1, dtype=torch.float32, device=device)
    return PackedMicroBatch(
        sample_ids=(),
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_ids=torch.zeros(1, dtype=torch.long, device=device),
        is_start=torch.ones(1, dtype=torch.bool, device=device),
        loss_mask=z,
        advantages=z,
        rollout_logprobs=z,
        ref_logprobs=None,
    )


def token_logprobs(
    logits: torch.Tensor, mb: PackedMicroBatch, *, with_entropy: bool, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t | < t) per token, float32 [T] (0 at sequence starts), and the entropy of the distribution
    that scored token t (also 0 at starts) when asked. Differentiable (the entropy only with `entropy_grad`: as a
    metric alone it must not keep a [T, vocab] float32 tensor alive for backward).

    Row t-1 of `logits` scores token t; rows that cross a sequence boundary are computed and then masked (one
    wasted row per sequence, which keeps the op a single dense log_softmax).
    """
    # TODO(perf): chunk over T for large vocabularies: [T, V] float32 is the peak activation of a step.
    rows = logits[0, :-1].float()
    logp = torch.log_softmax(rows, dim=-1)
    target = mb.input_ids[0, 1:].unsqueeze(-1)
    lp = torch.cat([rows.new_zeros(1), logp.gather(-1, target).squeeze(-1)])
    lp = lp.masked_fill(mb.is_start, 0.0)
    if not with_entropy:
        return lp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(logp.exp() * logp).sum(-1)
    ent = torch.cat([rows.new_zeros(1), ent]).masked_fill(mb.is_start, 0.0)
    return lp, ent
