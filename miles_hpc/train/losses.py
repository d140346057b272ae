"""Policy-gradient losses on a packed micro-batch (stage: train).

Every tensor argument is 1-D over the N packed tokens of S sequences; ``seq_ids[t]`` in ``0..S-1`` says which
sequence token t belongs to. Values are already aligned: ``logprobs[t]`` is log pi(token t | prefix), i.e. the
trainer has applied the logits shift. Invariants:

- Only ``loss_mask`` tokens carry loss. MIS/icepop zeroes the loss of out-of-range tokens but does *not* change the
  normaliser (icepop's 1/sum|y| counts every response token), so the trainer's ``total_tokens`` stays the plain
  loss-mask count.
- With global normalisers (``total_tokens`` = masked tokens of the mini-batch, ``num_seqs`` = its sequences) the
  sum of the micro-batch losses equals the loss of the whole mini-batch computed at once, for every ``loss_agg``
  (a sequence is never split across micro-batches).
- ``old_logprobs``, ``rollout_logprobs``, ``ref_logprobs`` and ``advantages`` are constants (detached here); the
  gradient flows through ``logprobs`` (and ``entropy`` when the trainer computed it with grad).
- The loss is computed in float32 whatever the input dtype; metrics stay on the device (`DeviceMetrics`) until
  first read, then all come to the host in one sync: a trainer reads them after launching backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Literal

import torch

from miles_hpc.config import AlgoConfig

__all__ = ["policy_loss", "kl_penalty", "aggregate", "sequence_log_ratio", "DeviceMetrics", "LossAgg", "KLType"]

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLType = Literal["k1", "k2", "k3"]


class DeviceMetrics(Mapping[str, float]):
    """Named float metrics held as one device tensor until first read; the first read syncs once for all."""

    def __init__(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        self._names, self._values = names, values
        self._floats: dict[str, float] | None = None

    def _read(self) -> dict[str, float]:
        if self._floats is None:
            self._floats = dict(zip(self._names, self._values.tolist()))
        return self._floats

    def __getitem__(self, key: str) -> float:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimator of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence", 2020).

    With d = logp - ref:  k1 = d;  k2 = d^2 / 2;  k3 = exp(-d) - (-d) - 1 = exp(ref - logp) - (ref - logp) - 1.
    k1 is unbiased but can be negative; k2 and k3 are >= 0; k3 is unbiased with low variance (GRPO's choice).
    """
    d = logp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        # Clamp the exponent so a far-off reference cannot overflow to inf (then inf - inf = NaN in the gradient).
        neg = (-d).clamp(max=20.0)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"kl_penalty: unknown kind {kind!r} (expected 'k1', 'k2' or 'k3')")


def _num_seqs(seq_ids: torch.Tensor, num_seqs: int | None) -> int:
    if num_seqs is not None:
        return num_seqs
    return int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0


def _seq_sum(values: torch.Tensor, seq_ids: torch.Tensor, size: int) -> torch.Tensor:
    """Per-sequence sums: out[s] = sum_{t: seq_ids[t] = s} values[t]  (differentiable)."""
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    mode: LossAgg,
    *,
    num_seqs: int | None = None,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` [N] over ``mask`` [N] tokens to one scalar.

    - ``token_mean``: sum_t m_t v_t / T, T = ``total_tokens`` or sum_t m_t here (DAPO token-level loss).
    - ``seq_mean_token_mean``: (1/S) sum_s (sum_{t in s} m_t v_t / sum_{t in s} m_t) (GRPO paper's form);
      S = ``num_seqs`` or the local max(seq_ids)+1; a sequence with no masked token contributes 0.
    - ``seq_mean_token_sum``: (1/S) sum_s sum_{t in s} m_t v_t (Dr.GRPO: no per-sequence length division).

    Normalisers are floored at 1, so an all-masked micro-batch gives 0 (with a gradient of 0), never NaN.
    """
    m = mask.to(values.dtype)
    masked = values * m
    if mode == "token_mean":
        denom = float(total_tokens) if total_tokens is not None else m.sum().item()
        return masked.sum() / max(denom, 1.0)
    n_seq = _num_seqs(seq_ids, num_seqs)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(n_seq, 1)
    if mode == "seq_mean_token_mean":
        size = max(n_seq, int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0)
        per_seq = _seq_sum(masked, seq_ids, size) / _seq_sum(m, seq_ids, size).clamp(min=1.0)
        return per_seq.sum() / max(n_seq, 1)
    raise ValueError(f"aggregate: unknown mode {mode!r}")


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor
) -> torch.Tensor:
    """GSPO per-token log ratio in the straight-through GSPO-token form.

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), the GSPO-token objective.

    log s_i = (1/|y_i|) sum_{t in i, masked} (logp_t - old_t); returned per token t of sequence i:
    log s_{i,t} = sg(log s_i) + logp_t - sg(logp_t). Its value is log s_i, its gradient d logp_t, so
    exp(.) = sg(s_i) * pi_t / sg(pi_t) and tokens get per-token gradients scaled by s_i.
    """
    m = mask.to(logprobs.dtype)
    size = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
    diff = (logprobs - old_logprobs).detach() * m
    log_s = _seq_sum(diff, seq_ids, size) / _seq_sum(m, seq_ids, size).clamp(min=1.0)
    return log_s[seq_ids] + logprobs - logprobs.detach()


def _masked_mean(x: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / n


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_seqs: int | None = None,
    total_tokens: int | None = None,
) -> tuple[torch.Tensor, Mapping[str, float]]:
    """The policy loss of one packed micro-batch and its metrics. Long: the formula below term by term, each with
    its metric beside it (split, the terms would hand a dozen tensors between helpers).

    Per token (r = ratio, A = advantage, eps_l/eps_h = ``clip_low``/``clip_high``, c = ``dual_clip``):
      ppo_clip: r_t = exp(logp_t - old_t)                                  (Schulman et al. 2017, PPO)
      gspo:     r_t = sg(s_i) * exp(logp_t - sg(logp_t)), s_i the sequence ratio (see :func:`sequence_log_ratio`)
      pg_t   = max(-A r_t, -A clip(r_t, 1-eps_l, 1+eps_h))                  (asymmetric: DAPO clip-higher)
      if A<0:  pg_t = min(pg_t, -c A)                                       (dual-clip PPO, Ye et al. 2020)
      pg_t  *= min(exp(old_t - rollout_t), tis_cap)                         (TIS, Yao et al. 2025; detached)
      pg_t   = 0 where exp(old_t - rollout_t) outside [mis_low, mis_high]  (MIS / icepop, Ring-1T 2025)
      loss_t = pg_t + kl_coef * KL_kind(logp_t, ref_t) - entropy_coef * H_t
    and loss = aggregate(loss_t, loss_mask, seq_ids, cfg.loss_agg, num_seqs, total_tokens).

    TIS and MIS need ``rollout_logprobs``; they weight the policy-gradient term only (slime/verl do the same), the
    KL and entropy terms are regularisers of the current policy and are not importance-corrected.
    Metrics (float, averaged over this micro-batch's masked tokens): pg_loss (aggregated like the loss), clip_frac,
    dual_clip_frac, ratio_mean, ratio_max, kl, entropy, tis_mean, mis_masked_frac, approx_kl (k3 of old vs new).
    """
    f32 = torch.float32
    logprobs = logprobs.to(f32)
    old = old_logprobs.detach().to(f32)
    adv = advantages.detach().to(f32)
    mask = loss_mask.to(f32)
    n_masked = mask.sum().clamp(min=1.0)

    if cfg.policy_loss == "ppo_clip":
        log_ratio = logprobs - old
    elif cfg.policy_loss == "gspo":
        log_ratio = sequence_log_ratio(logprobs, old, mask, seq_ids)
    else:
        raise ValueError(f"policy_loss: unknown cfg.policy_loss {cfg.policy_loss!r}")
    # Clamp the exponent: a token far off-policy must not give inf (it is clipped away anyway when A != 0).
    ratio = torch.exp(log_ratio.clamp(max=20.0))

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).to(f32)
    dual_active = torch.zeros_like(pg)
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv  # > 0 where A < 0
        dual_active = ((adv < 0) & (pg > cap)).to(f32)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)

    tis = torch.ones_like(pg)
    keep = torch.ones_like(pg)
    if cfg.tis_cap is not None or cfg.mis_low is not None or cfg.mis_high is not None:
        if rollout_logprobs is None:
            raise ValueError("policy_loss: tis_cap/mis_low/mis_high need rollout_logprobs (the engine's log-probs)")
        is_ratio = torch.exp((old - rollout_logprobs.detach().to(f32)).clamp(max=20.0))
        if cfg.tis_cap is not None:
            tis = is_ratio.clamp(max=cfg.tis_cap)
        if cfg.mis_low is not None:
            keep = keep * (is_ratio >= cfg.mis_low).to(f32)
        if cfg.mis_high is not None:
            keep = keep * (is_ratio <= cfg.mis_high).to(f32)
        pg = pg * tis * keep

    token_loss = pg
    kl = torch.zeros_like(pg)
    if cfg.kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logprobs")
    if ref_logprobs is not None:  # logged even when kl_coef == 0
        kl = kl_penalty(logprobs, ref_logprobs.detach().to(f32), cfg.kl_type)
    if cfg.kl_coef > 0.0:
        token_loss = token_loss + cfg.kl_coef * kl
    ent = torch.zeros_like(pg) if entropy is None else entropy.to(f32)
    if cfg.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("policy_loss: entropy_coef != 0 needs the per-token entropy")
        token_loss = token_loss - cfg.entropy_coef * ent

    agg = dict(mode=cfg.loss_agg, num_seqs=num_seqs, total_tokens=total_tokens)
    loss = aggregate(token_loss, mask, seq_ids, **agg)

    with torch.no_grad():
        pg_loss = aggregate(pg, mask, seq_ids, **agg)
        masked_ratio = torch.where(mask > 0, ratio, torch.full_like(ratio, -torch.inf))
        ratio_max = masked_ratio.max() if ratio.numel() else ratio.new_zeros(())
        ratio_max = torch.where(torch.isfinite(ratio_max), ratio_max, ratio_max.new_zeros(()))
        values = torch.stack(
            [
                pg_loss,
                _masked_mean(clip_active, mask, n_masked),
                _masked_mean(dual_active, mask, n_masked),
                _masked_mean(ratio, mask, n_masked),
                ratio_max,
                _masked_mean(kl, mask, n_masked),
                _masked_mean(ent.detach(), mask, n_masked),
                _masked_mean(tis, mask, n_masked),
                _masked_mean(1.0 - keep, mask, n_masked),
                _masked_mean(kl_penalty(logprobs.detach(), old, "k3"), mask, n_masked),
            ]
        )
    names = (
        "pg_loss",
        "clip_frac",
        "dual_clip_frac",
        "ratio_mean",
        "ratio_max",
        "kl",
        "entropy",
        "tis_mean",
        "mis_masked_frac",
        "approx_kl",
    )
    return loss, DeviceMetrics(names, values)


def mtp_loss_sum(
    mtp_logits: list[torch.Tensor], input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, target count) of the multi-token-prediction depths over one packed micro-batch.

    Depth d's row i predicts token i + d + 1 of the same sequence (models/mtp.py); it is a target when that token
    is a loss token (a response token: `loss_mask` 1), so the draft layers learn the policy's own tokens. Summed
    over depths; the caller scales by the mini-batch's loss-token count and `train.mtp_loss_coef`.
    """
    total = loss_mask.new_zeros((), dtype=torch.float32)
    count = loss_mask.new_zeros((), dtype=torch.float32)
    t = input_ids.shape[-1]
    ids, mask = input_ids.reshape(t), loss_mask.reshape(t)
    for depth, logits in enumerate(mtp_logits, start=1):
        k = depth + 1
        if t <= k:
            continue
        valid = (seq_ids[k:] == seq_ids[:-k]) & (mask[k:] > 0)
        ce = torch.nn.functional.cross_entropy(logits.reshape(t, -1)[:-k].float(), ids[k:], reduction="none")
        total = total + (ce * valid).sum()
        count = count + valid.sum()
    return total, count
