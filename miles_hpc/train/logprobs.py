"""Packed micro-batch tensors and per-token log-probs/entropy from logits (stage: train; no process groups).

Alignment (the convention of `TrainBatch` and `policy_loss`): the value at token t is about token t, computed from
the logits at t-1 of the same sequence; the first token of every sequence has no logits before it and gets 0.0
(and never carries loss: its mask is forced to 0 here).

Zero-KL mode (`token_logprobs(..., batch_invariant=True)`): log-probs from `models.invariant.token_log_softmax`,
each logits row's `invariant.log_softmax` entry at the token: the function and the tiles the engine reports its
log-probs with, so a token's value is the engine's bit for bit; no float32 [T, vocab] tensor (one pass per row on
the Triton path, row chunks on the tiles); entropy and the backward as in the normal mode.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from miles_hpc.models import invariant
from miles_hpc.train.batch import TrainBatch

__all__ = ["PackedMicroBatch", "pack_samples", "dummy_microbatch", "token_logprobs"]


@dataclass(frozen=True, slots=True)
class PackedMicroBatch:
    """Sequences concatenated into one row (no padding); everything per token is 1-D of length T."""

    sample_ids: tuple[int, ...]  # batch indices, in packing order
    input_ids: torch.Tensor  # long [1, T]
    position_ids: torch.Tensor  # long [1, T], restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # int32 [n+1], on the host (the model reads the bounds; no device sync)
    seq_ids: torch.Tensor  # long [T], 0..n-1: which sequence of this micro-batch a token belongs to
    is_start: torch.Tensor  # bool [T], the first token of each sequence
    loss_mask: torch.Tensor  # float32 [T] (0 on each sequence's first token)
    advantages: torch.Tensor  # float32 [T]
    rollout_logprobs: torch.Tensor  # float32 [T]
    ref_logprobs: torch.Tensor | None  # float32 [T]
    routing: torch.Tensor | None = None  # long [1, T, moe_layers, top_k] (R3), -1 rows where no record
    indexer: torch.Tensor | None = None  # long [1, T, indexer_layers, index_topk] (DSA replay), -1 where no record

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
    # Built on the host with numpy (torch's small CPU ops wake its thread pool: ms each on a busy or virtualised
    # host, while the GPU waits) as one integer and one float table: two host-to-device copies per micro-batch.
    total = sum(lengths)
    ints_np = np.empty((3, total), dtype=np.int64)
    ints_np[0] = [t for i in sample_ids for t in batch.tokens[i]]
    ints_np[1] = np.arange(total) - np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
    ints_np[2] = np.repeat(np.arange(len(lengths)), lengths)
    ints = torch.from_numpy(ints_np).to(device)
    rows = [batch.loss_mask, batch.advantages, batch.rollout_logprobs]
    if batch.ref_logprobs is not None:
        rows.append(batch.ref_logprobs)
    floats_np = np.empty((len(rows), total), dtype=np.float32)
    for j, r in enumerate(rows):
        floats_np[j] = [v for i in sample_ids for v in r[i]]
    floats = torch.from_numpy(floats_np).to(device)
    routing = _pack_records(batch.routed_experts, sample_ids, lengths, device)
    indexer = _pack_records(batch.indexer_topk, sample_ids, lengths, device)
    is_start = ints[1] == 0
    return PackedMicroBatch(
        sample_ids=tuple(sample_ids),
        input_ids=ints[0].unsqueeze(0),
        position_ids=ints[1].unsqueeze(0),
        cu_seqlens=torch.from_numpy(np.cumsum([0, *lengths], dtype=np.int32)),
        seq_ids=ints[2],
        is_start=is_start,
        loss_mask=floats[0].masked_fill(is_start, 0.0),
        advantages=floats[1],
        rollout_logprobs=floats[2],
        ref_logprobs=floats[3] if batch.ref_logprobs is not None else None,
        routing=routing,
        indexer=indexer,
    )


def _pack_records(
    records: Sequence[np.ndarray | None] | None, sample_ids: Sequence[int], lengths: list[int], device: torch.device
) -> torch.Tensor | None:
    """Per-token records ([rows <= tokens, ...] per sample, None: none) packed as the tokens are, long
    [1, T, ...], -1 where a token has no record; None when no sample of the micro-batch has one."""
    if records is None or all(records[i] is None for i in sample_ids):
        return None
    shape = next(r.shape[1:] for i in sample_ids if (r := records[i]) is not None)
    table = np.full((sum(lengths), *shape), -1, dtype=np.int64)
    o = 0
    for i, n in zip(sample_ids, lengths):
        r = records[i]
        if r is not None:
            table[o : o + r.shape[0]] = r
        o += n
    return torch.from_numpy(table).to(device)[None]


def dummy_microbatch(device: torch.device) -> PackedMicroBatch:
    """One token, no loss: run by a rank with fewer micro-batches than another, so that FSDP's per-forward
    all-gathers and per-backward reduce-scatters stay matched across ranks."""
    z = torch.zeros(1, dtype=torch.float32, device=device)
    return PackedMicroBatch(
        sample_ids=(),
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        seq_ids=torch.zeros(1, dtype=torch.long, device=device),
        is_start=torch.ones(1, dtype=torch.bool, device=device),
        loss_mask=z,
        advantages=z,
        rollout_logprobs=z,
        ref_logprobs=None,
    )


def token_logprobs(
    logits: torch.Tensor,
    mb: PackedMicroBatch,
    *,
    with_entropy: bool,
    entropy_grad: bool = True,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t | < t) per token, float32 [T] (0 at sequence starts), and the entropy of the distribution
    that scored token t (also 0 at starts) when asked. Differentiable (the entropy only with `entropy_grad`: as a
    metric alone it adds nothing to backward).

    Row t-1 of `logits` scores token t; rows that cross a sequence boundary are computed and then masked (one
    wasted row per sequence, which keeps the op dense). The float32 math runs in row chunks (`LogProbEntropy`), so
    a step never holds a float32 [T, vocab] tensor: at T = 8192 and a 152k vocabulary that is 5 GB per copy.
    `batch_invariant`: zero-KL mode (module docstring).
    """
    # Every row, the last one scoring a placeholder target: slicing (or indexing) the [1, T, vocab] logits instead
    # would make autograd zero-fill and copy a full-size gradient; the unused row gets a zero gradient from the
    # [T] slice below.
    ids = mb.input_ids[0]
    target = torch.cat([ids[1:], ids[:1]])
    fn = InvariantLogProbEntropy if batch_invariant else LogProbEntropy
    lp, ent = fn.apply(logits.flatten(0, 1), target, with_entropy)  # a view: backward is one too
    return rows_to_tokens(lp, ent if with_entropy else None, mb, entropy_grad=entropy_grad)


def rows_to_tokens(
    lp: torch.Tensor, ent: torch.Tensor | None, mb: PackedMicroBatch, *, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row log-probs (and entropies) [T] of the packed row, row t scoring token t + 1, as per-token values:
    shifted by one, 0 at sequence starts; the entropy detached unless `entropy_grad` under grad."""
    zero = lp.new_zeros(1)
    lp = torch.cat([zero, lp[:-1]]).masked_fill(mb.is_start, 0.0)
    if ent is None:
        return lp, None
    if not (entropy_grad and torch.is_grad_enabled()):
        ent = ent.detach()
    return lp, torch.cat([zero, ent[:-1]]).masked_fill(mb.is_start, 0.0)


CHUNK_ELEMENTS = 1 << 28
"""float32 elements of one chunk's temporaries (1 GiB): rows per chunk = this // vocab."""


def _chunks(n: int, vocab: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # float32, or float64 for float64 logits (gradcheck)


class LogProbEntropy(torch.autograd.Function):
    """(logits [N, V] any float dtype, target [N]) -> (log_softmax(logits)[target], entropy) in float32. On CUDA
    with Triton: one pass per row each way (logprob_kernels.py); elsewhere torch by row chunks in float32 (float64
    for float64 logits). Saves the logits as given (bf16 under mixed precision) plus two float32 [N] vectors; the
    backward recomputes the softmax per chunk and writes the logits' gradient in their dtype:
      d lp / dz = onehot(target) - p,      d H / dz = -p * (log p + H).
    Without `with_entropy` the entropy output is an empty tensor."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, with_entropy: bool):  # type: ignore[override]
        kernels = _kernels(logits)
        if kernels is not None:
            lse, lp, ent = kernels.forward(logits, target, with_entropy)
        else:
            lse, lp, ent = _forward_torch(logits, target, with_entropy)
        ctx.save_for_backward(logits, target, lse, ent)
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):  # type: ignore[override]
        logits, target, lse, ent = ctx.saved_tensors
        g_ent = g_ent if ctx.with_entropy else None
        kernels = _kernels(logits)
        if kernels is not None:
            return kernels.backward(logits, target, lse, ent, g_lp, g_ent), None, None
        return _backward_torch(logits, target, lse, ent, g_lp, g_ent), None, None


class InvariantLogProbEntropy(LogProbEntropy):
    """`LogProbEntropy` whose log-probs are `invariant.token_log_softmax`'s: the engine's bits in zero-KL mode. The
    log-sum-exp kept for the backward, the entropy and the backward are LogProbEntropy's (the gradient of the same
    function up to rounding), so the mode holds no float32 [N, vocab] tensor either."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, with_entropy: bool):  # type: ignore[override]
        _, ent = LogProbEntropy.forward(ctx, logits, target, with_entropy)
        return invariant.token_log_softmax(logits, target), ent


def _kernels(logits: torch.Tensor) -> types.ModuleType | None:
    """The Triton implementation (logprob_kernels.py) for CUDA logits with unit stride along the vocabulary."""
    if logits.device.type != "cuda" or logits.stride(-1) != 1 or importlib.util.find_spec("triton") is None:
        return None
    from miles_hpc.train import logprob_kernels

    return logprob_kernels


def _forward_torch(
    logits: torch.Tensor, target: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, vocab = logits.shape
    lse = torch.empty(n, dtype=_math_dtype(logits), device=logits.device)
    picked = torch.empty_like(lse)
    ent = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
    for a, b in _chunks(n, vocab):
        z = logits[a:b].to(lse.dtype)
        lse[a:b] = torch.logsumexp(z, dim=-1)
        picked[a:b] = z.gather(1, target[a:b, None]).squeeze(1)
        if with_entropy:  # H = lse - sum(p * z)
            ent[a:b] = lse[a:b] - (torch.softmax(z, dim=-1) * z).sum(-1)
    return lse, picked - lse, ent


def _backward_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
) -> torch.Tensor:
    grad = torch.empty_like(logits)
    for a, b in _chunks(*logits.shape):
        z = logits[a:b].to(lse.dtype)
        logp = z - lse[a:b, None]
        p = logp.exp()
        g = torch.zeros_like(z)
        if g_lp is not None:
            g = (-p * g_lp[a:b, None]).scatter_add_(1, target[a:b, None], g_lp[a:b, None])
        if g_ent is not None:
            g -= p * (logp + ent[a:b, None]) * g_ent[a:b, None]
        grad[a:b] = g
    return grad
