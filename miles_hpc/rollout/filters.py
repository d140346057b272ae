"""DAPO dynamic sampling: drop prompt groups whose rewards carry no signal, keep sampling until the batch is full.

Stage: rollout (the loop calls it between generation and training). A *group* is the list of samples of one prompt;
a sample is anything with a numeric ``.reward`` (duck-typed, so this module imports nothing from ``train``).
Invariants:

- A group is dropped iff its rewards all lie within ``tol`` of each other (zero variance: every GRPO advantage
  would be 0, so it only dilutes the batch; DAPO, Yu et al. 2025, section 3.2). A one-sample group is therefore
  dropped, and so is an empty one.
- :class:`DynamicSampler` keeps groups in arrival order and hands out exactly the groups it kept; its counters only
  grow until :meth:`DynamicSampler.reset`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

__all__ = ["HasReward", "is_zero_variance", "drop_zero_variance_groups", "DynamicSampler"]


class HasReward(Protocol):
    reward: float


S = TypeVar("S", bound=HasReward)


def is_zero_variance(group: Sequence[HasReward], tol: float = 0.0) -> bool:
    """True when max reward - min reward <= ``tol`` (or the group is empty)."""
    if not group:
        return True
    rewards = [float(s.reward) for s in group]
    return max(rewards) - min(rewards) <= tol


def drop_zero_variance_groups(groups: Sequence[Sequence[S]], tol: float = 0.0) -> tuple[list[Sequence[S]], int]:
    """Return (the groups with some reward variance, in order; how many were dropped)."""
    kept = [g for g in groups if not is_zero_variance(g, tol)]
    return kept, len(groups) - len(kept)


@dataclass(slots=True)
class DynamicSampler:
    """Accumulates informative groups over sampling rounds until ``target_groups`` are there.

    Loop usage::

        sampler = DynamicSampler(target_groups=cfg.rollout.prompts_per_step, max_rounds=cfg.algo.max_sampling_rounds)
        while not sampler.full and not sampler.exhausted:
            sampler.add(generate(sampler.needed))
        batch = sampler.take()  # may hold fewer than target_groups when exhausted
    """

    target_groups: int
    max_rounds: int = 1
    tol: float = 0.0
    rounds: int = 0  # calls to add()
    dropped: int = 0  # zero-variance groups dropped so far
    seen: int = 0  # groups offered so far
    _kept: list[Sequence[HasReward]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"DynamicSampler: target_groups must be >= 1, got {self.target_groups}")
        if self.max_rounds < 1:
            raise ValueError(f"DynamicSampler: max_rounds must be >= 1, got {self.max_rounds}")

    def add(self, groups: Sequence[Sequence[HasReward]]) -> int:
        """Filter one round of generated groups, keep the informative ones; return how many were kept."""
        kept, dropped = drop_zero_variance_groups(groups, self.tol)
        self.rounds += 1
        self.seen += len(groups)
        self.dropped += dropped
        self._kept.extend(kept)
        return len(kept)

    @property
    def num_groups(self) -> int:
        return len(self._kept)

    @property
    def needed(self) -> int:
        """Groups still missing to fill the batch (0 when full)."""
        return max(self.target_groups - len(self._kept), 0)

    @property
    def full(self) -> bool:
        return len(self._kept) >= self.target_groups

    @property
    def exhausted(self) -> bool:
        """No sampling rounds left (``rounds >= max_rounds``)."""
        return self.rounds >= self.max_rounds

    def take(self, n_groups: int | None = None) -> list[Sequence[HasReward]]:
        """Remove and return the first ``n_groups`` kept groups (default ``target_groups``; fewer if not there).

        Groups beyond the batch stay for the next :meth:`take` (a caller that wants them gone calls :meth:`reset`).
        """
        n = self.target_groups if n_groups is None else n_groups
        if n < 0:
            raise ValueError(f"DynamicSampler.take: n_groups must be >= 0, got {n}")
        out, self._kept = self._kept[:n], self._kept[n:]
        return out

    def stats(self) -> dict[str, float]:
        """Counters for logging: rounds, dropped, seen, kept (still held), drop_frac."""
        return {
            "rounds": float(self.rounds),
            "dropped": float(self.dropped),
            "seen": float(self.seen),
            "kept": float(len(self._kept)),
            "drop_frac": self.dropped / self.seen if self.seen else 0.0,
        }

    def reset(self) -> None:
        """Start a new batch: forget held groups and zero the counters."""
        self.rounds = self.dropped = self.seen = 0
        self._kept = []
