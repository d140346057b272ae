"""DAPO dynamic sampling: zero-variance group filter and the refill accumulator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from miles_hpc.rollout.filters import DynamicSampler, drop_zero_variance_groups, is_zero_variance


@dataclass
class S:
    reward: float


def G(*rewards: float) -> list[S]:
    return [S(r) for r in rewards]


def test_drop_zero_variance_groups() -> None:
    groups = [G(1, 0), G(1, 1), G(0, 0, 0), G(0.5), G(0, 1, 1), []]
    kept, dropped = drop_zero_variance_groups(groups)
    assert kept == [groups[0], groups[4]]
    assert dropped == 4  # all-equal, all-zero, singleton, empty


def test_tolerance() -> None:
    assert not is_zero_variance(G(1.0, 1.0 + 1e-9))
    assert is_zero_variance(G(1.0, 1.0 + 1e-9), tol=1e-6)
    kept, dropped = drop_zero_variance_groups([G(0.3, 0.3000001), G(0, 1)], tol=1e-3)
    assert dropped == 1 and len(kept) == 1


def test_sampler_fills_over_rounds() -> None:
    sampler = DynamicSampler(target_groups=3, max_rounds=3)
    assert sampler.add([G(1, 0), G(1, 1), G(0, 1)]) == 2
    assert not sampler.full and sampler.needed == 1 and not sampler.exhausted
    assert sampler.add([G(0, 0), G(1, 0, 0), G(0.2, 0.8)]) == 2
    assert sampler.full and sampler.needed == 0 and sampler.num_groups == 4
    batch = sampler.take()
    assert [[s.reward for s in g] for g in batch] == [[1, 0], [0, 1], [1, 0, 0]]  # arrival order
    assert sampler.num_groups == 1  # the surplus stays for the next take
    assert sampler.stats() == {"rounds": 2.0, "dropped": 2.0, "seen": 6.0, "kept": 1.0, "drop_frac": 2 / 6}
    sampler.reset()
    assert sampler.stats()["rounds"] == 0.0 and sampler.num_groups == 0


def test_sampler_exhausted_gives_partial_batch() -> None:
    sampler = DynamicSampler(target_groups=4, max_rounds=2)
    rounds = 0
    while not sampler.full and not sampler.exhausted:
        sampler.add([G(1, 1), G(1, 0)])
        rounds += 1
    assert rounds == 2 and sampler.exhausted and not sampler.full
    assert len(sampler.take()) == 2
    assert sampler.take(5) == []
    with pytest.raises(ValueError):
        sampler.take(-1)


def test_sampler_validates() -> None:
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSampler(target_groups=0)
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSampler(target_groups=1, max_rounds=0)
