"""Advantage estimators and the overlong penalty on hand-computed groups."""

from __future__ import annotations

import math

import pytest

from miles_hpc.config import AlgoConfig
from miles_hpc.train.advantages import EPS, compute_advantages, group_baseline, overlong_penalty

# group 0: rewards [1, 0, 0, 1] -> mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.5773503
# group 1: [1, 1] (zero variance); group 2: [0.5] (one sample)
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5]
GROUPS = [0, 0, 0, 0, 1, 1, 2]
LENS = [2, 1, 1, 2, 1, 1, 2]


def test_grpo_hand_computed() -> None:
    adv = compute_advantages(REWARDS, GROUPS, LENS, AlgoConfig(advantage="grpo"))
    a = 0.5 / (math.sqrt(1 / 3) + EPS)  # 0.866024...
    assert adv == pytest.approx([a, -a, -a, a, 0.0, 0.0, 0.0], rel=1e-9, abs=1e-12)


def test_grpo_without_std_equals_dr_grpo() -> None:
    expected = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]
    assert compute_advantages(REWARDS, GROUPS, LENS, AlgoConfig(advantage="dr_grpo")) == pytest.approx(expected)
    # Dr.GRPO never divides, whatever std_normalize says
    dr = AlgoConfig(advantage="dr_grpo", std_normalize=True)
    assert compute_advantages(REWARDS, GROUPS, LENS, dr) == pytest.approx(expected)
    plain = AlgoConfig(advantage="grpo", std_normalize=False)
    assert compute_advantages(REWARDS, GROUPS, LENS, plain) == pytest.approx(expected)


def test_reinforce_pp_baseline_hand_computed() -> None:
    # a = r - group mean = [.5, -.5, -.5, .5, 0, 0, 0]; token weights LENS (total 10)
    # mu = (.5*2 - .5 - .5 + .5*2) / 10 = 0.1
    # var = (2*.4^2 + .6^2 + .6^2 + 2*.4^2 + (1+1+2)*.1^2) / 10 = (.32 + .72 + .32 + .04) / 10 = 0.14
    std = math.sqrt(0.14)  # 0.3741657
    adv = compute_advantages(REWARDS, GROUPS, LENS, AlgoConfig(advantage="reinforce_pp"))
    hi, lo, zero = 0.4 / (std + EPS), -0.6 / (std + EPS), -0.1 / (std + EPS)
    assert adv == pytest.approx([hi, lo, lo, hi, zero, zero, zero], rel=1e-9)
    assert hi == pytest.approx(1.069045, rel=1e-5) and lo == pytest.approx(-1.603567, rel=1e-5)


def test_group_order_does_not_matter() -> None:
    # Interleaved, non-contiguous ids give the same per-sample values.
    perm = [6, 0, 4, 1, 5, 2, 3]
    cfg = AlgoConfig(advantage="grpo")
    base = compute_advantages(REWARDS, GROUPS, LENS, cfg)
    shuffled = compute_advantages(
        [REWARDS[i] for i in perm], [GROUPS[i] * 7 + 3 for i in perm], [LENS[i] for i in perm], cfg
    )
    assert shuffled == pytest.approx([base[i] for i in perm])


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "reinforce_pp"])
def test_degenerate_groups_no_nan(kind: str) -> None:
    cfg = AlgoConfig(advantage=kind)
    for rewards, groups, lens in [
        ([1.0], [0], [3]),  # one sample
        ([1.0, 1.0, 1.0], [0, 0, 0], [1, 2, 3]),  # zero variance
        ([0.0, 1.0], [0, 1], [4, 4]),  # every group a singleton
        ([1.0, 0.0], [0, 0], [0, 0]),  # empty responses
    ]:
        adv = compute_advantages(rewards, groups, lens, cfg)
        assert len(adv) == len(rewards)
        assert all(math.isfinite(a) for a in adv)
    assert compute_advantages([1.0, 1.0], [0, 0], [2, 2], cfg) == [0.0, 0.0]
    assert compute_advantages([], [], [], cfg) == []


def test_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages([1.0, 0.0], [0], [1, 1], AlgoConfig())
    with pytest.raises(ValueError):
        group_baseline([1.0], [0, 1], std_normalize=True)


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (80, 0.0), (85, -0.25), (90, -0.5), (99, -0.95), (100, -1.0), (120, -1.0)],
)
def test_overlong_penalty_ramp(length: int, expected: float) -> None:
    # max 100, buffer 20: free up to 80, then -(len - 80) / 20, capped at -1
    assert overlong_penalty(length, 100, 20, 1.0) == pytest.approx(expected)


def test_overlong_penalty_scale_and_off() -> None:
    assert overlong_penalty(95, 100, 20, 0.5) == pytest.approx(-0.375)  # 0.5 * 15/20
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0
    # a buffer longer than the budget: the ramp starts before length 0 (8 - 16 = -8)
    assert overlong_penalty(10, 8, 16, 1.0) == -1.0
    assert overlong_penalty(4, 8, 16, 1.0) == pytest.approx(-(4 + 8) / 16)
