"""Packing plans (pure functions): nothing lost, budgets respected, no padding, balanced ranks."""

from __future__ import annotations

import random

import pytest
import torch

from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.logprobs import pack_samples
from miles_hpc.train.packing import pack_microbatches, split_across_ranks, split_minibatches


@pytest.mark.parametrize("seed", range(20))
def test_pack_microbatches_properties(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(0, 40) for _ in range(rng.randint(0, 30))]
    budget = rng.randint(1, 60)
    subset = sorted(rng.sample(range(len(lengths)), k=rng.randint(0, len(lengths))))
    bins = pack_microbatches(subset, lengths, budget)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == subset  # every sample exactly once
    for b in bins:
        assert b and b == sorted(b)
        load = sum(lengths[i] for i in b)
        assert load <= budget or len(b) == 1  # only an oversize sample may exceed, and then alone
    assert bins == pack_microbatches(subset, lengths, budget)  # deterministic


def test_pack_oversize_gets_own_microbatch() -> None:
    assert pack_microbatches([0, 1, 2], [50, 3, 4], 10) == [[0], [1, 2]]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_split_across_ranks_balanced(world: int) -> None:
    rng = random.Random(world)
    lengths = [rng.randint(1, 100) for _ in range(25)]
    parts = split_across_ranks(list(range(25)), lengths, world)
    assert len(parts) == world
    assert sorted(i for p in parts for i in p) == list(range(25))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # greedy LPT bound


def test_split_minibatches_contiguous() -> None:
    assert split_minibatches(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_minibatches(1, 2) == [[0], []]
    with pytest.raises(ValueError):
        split_minibatches(3, 0)


def test_pack_samples_no_padding() -> None:
    toks = [[5, 6, 7], [8], [9, 10, 11, 12]]
    batch = TrainBatch(
        tokens=toks,
        loss_mask=[[1] * len(t) for t in toks],
        rollout_logprobs=[[0.0] * len(t) for t in toks],
        advantages=[[float(i)] * len(t) for i, t in enumerate(toks)],
    )
    mb = pack_samples(batch, [0, 2], torch.device("cpu"))
    assert mb.input_ids.tolist() == [[5, 6, 7, 9, 10, 11, 12]]
    assert mb.cu_seqlens.tolist() == [0, 3, 7]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert mb.seq_ids.tolist() == [0, 0, 0, 1, 1, 1, 1]
    # A sequence's first token has no logits before it: never carries loss.
    assert mb.loss_mask.tolist() == [0, 1, 1, 0, 1, 1, 1]
    assert mb.advantages.tolist() == [0, 0, 0, 2, 2, 2, 2]
