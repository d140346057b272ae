"""Advantage estimators on per-sample rewards (stage: train, run by the loop before building the TrainBatch).

Shapes: every input is a list with one entry per sample (B samples); ``group_ids[i]`` names the prompt group of
sample i (samples of one prompt share an id; ids need not be contiguous or sorted); ``response_lens[i]`` is the
number of loss tokens of sample i. The output has one scalar advantage per sample, which the loop broadcasts over
that sample's response tokens. Invariants:

- Pure Python floats in and out, computed in float64; no NaN for a group of one sample or with zero variance
  (the advantage is then 0, or the batch normalisation's eps keeps it finite).
- The group std is the sample std (Bessel, ddof=1, as verl/TRL's ``torch.std``); a one-sample group has std 0.
"""

from __future__ import annotations

import math
from collections import defaultdict

from miles_hpc.config import AlgoConfig

__all__ = ["compute_advantages", "group_baseline", "overlong_penalty", "EPS"]

EPS = 1e-6  # added to a std before dividing


def _mean_std(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = math.fsum(xs) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))


def group_baseline(rewards: list[float], group_ids: list[int], *, std_normalize: bool) -> list[float]:
    """A_i = r_i - mean_{g(i)}(r), divided by (std_{g(i)}(r) + EPS) when ``std_normalize``."""
    members: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_ids, strict=True):
        members[g].append(float(r))
    stats = {g: _mean_std(rs) for g, rs in members.items()}
    out = []
    for r, g in zip(rewards, group_ids):
        mean, std = stats[g]
        a = float(r) - mean
        out.append(a / (std + EPS) if std_normalize else a)
    return out


def _whiten_tokens(adv: list[float], response_lens: list[int]) -> list[float]:
    # Token-weighted batch mean/std: each sample counts once per response token, i.e. the statistics of the
    # per-token advantage tensor (OpenRLHF whitens the masked token advantages). All-empty responses: equal weights.
    weights = [max(int(n), 0) for n in response_lens]
    if sum(weights) == 0:
        weights = [1] * len(adv)
    total = sum(weights)
    mean = math.fsum(w * a for w, a in zip(weights, adv)) / total
    var = math.fsum(w * (a - mean) ** 2 for w, a in zip(weights, adv)) / total
    std = math.sqrt(var)
    return [(a - mean) / (std + EPS) for a in adv]


def compute_advantages(
    rewards: list[float], group_ids: list[int], response_lens: list[int], cfg: AlgoConfig
) -> list[float]:
    """One advantage per sample, by ``cfg.advantage``:

    - ``grpo`` (Shao et al. 2024, DeepSeekMath, outcome supervision): A_i = (r_i - mean_g) / (std_g + eps), the
      division only when ``cfg.std_normalize``.
    - ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr.GRPO): A_i = r_i - mean_g, never divided
      by the std; the length normalisation is removed in the loss (``loss_agg = seq_mean_token_sum``).
    - ``reinforce_pp`` (Hu et al. 2025, "REINFORCE++", arXiv:2501.03262, the *REINFORCE++-baseline* variant for
      group sampling, as OpenRLHF's ``reinforce_baseline``): a_i = r_i - mean_g, then batch (global) whitening
      A_i = (a_i - mu) / (sigma + eps) with mu, sigma the mean and population std over all response tokens of the
      batch (sample i weighted by ``response_lens[i]``). ``std_normalize`` does not apply.

    Empty input gives an empty list.
    """
    if not (len(rewards) == len(group_ids) == len(response_lens)):
        raise ValueError(
            f"compute_advantages: {len(rewards)} rewards, {len(group_ids)} group ids, {len(response_lens)} lengths"
        )
    if not rewards:
        return []
    if cfg.advantage == "grpo":
        return group_baseline(rewards, group_ids, std_normalize=cfg.std_normalize)
    if cfg.advantage == "dr_grpo":
        return group_baseline(rewards, group_ids, std_normalize=False)
    if cfg.advantage == "reinforce_pp":
        return _whiten_tokens(group_baseline(rewards, group_ids, std_normalize=False), response_lens)
    raise ValueError(f"compute_advantages: unknown estimator {cfg.advantage!r}")


def overlong_penalty(response_len: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO soft overlong punishment (Yu et al. 2025, DAPO, eq. 13), added to the reward.

    With L = ``max_new_tokens``, B = ``buffer``: 0 for len <= L - B; -penalty * (len - (L - B)) / B for
    L - B < len <= L (a linear ramp to -penalty at L); -penalty beyond L. ``buffer == 0`` turns it off.
    """
    if buffer <= 0:
        return 0.0
    excess = response_len - (max_new_tokens - buffer)
    if excess <= 0:
        return 0.0
    return -penalty * min(excess / buffer, 1.0)
