"""How a batch's samples are split over mini-batches, ranks and micro-batches (stage: train; pure functions).

Invariants (tested as properties):
- Every sample index appears exactly once in the output; nothing is padded: a micro-batch is its samples'
  tokens concatenated, and `cu_seqlens` marks the boundaries.
- A micro-batch holds at most `max_tokens` tokens, except a sample longer than the budget, which gets a
  micro-batch of its own (never split: attention needs the whole sequence).
- The functions are deterministic in their inputs, so every rank computes the same plan without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["split_minibatches", "split_across_ranks", "pack_microbatches"]


def split_minibatches(num_samples: int, num_minibatches: int) -> list[list[int]]:
    """Contiguous chunks of sample indices, sizes differing by at most one (empty chunks when there are fewer
    samples than mini-batches). Contiguous keeps groups (GRPO) together when they are adjacent in the batch."""
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    base, extra = divmod(num_samples, num_minibatches)
    out, start = [], 0
    for k in range(num_minibatches):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def split_across_ranks(indices: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Assign samples to ranks balancing total tokens (longest first, each to the least-loaded rank; ties to the
    lower rank). Each rank's list keeps batch order. A rank may get nothing when samples < ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


def pack_microbatches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of samples into micro-batches of at most `max_tokens` tokens.

    `lengths[i]` is the token count of sample i (indexed by the values in `indices`). Samples longer than the
    budget get a micro-batch of their own. Zero-length samples are kept (in the first micro-batch that fits).
    Returns lists of sample indices, each in ascending order; micro-batches ordered by their first sample.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
