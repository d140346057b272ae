"""Policy losses on hand-computed micro-batches (CPU, pure torch)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_hpc.config import AlgoConfig
from miles_hpc.train.losses import aggregate, kl_penalty, policy_loss, sequence_log_ratio

# The shared example: 2 sequences packed into 6 tokens.
#   seq 0: tokens 0..2, token 0 is prompt (mask 0); advantage +1; ratios r = [-, 1.5, 0.9]
#   seq 1: tokens 3..5, all masked;                  advantage -1; ratios r = [0.5, 1.1, 4.0]
SEQ = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.tensor([0, 1, 1, 1, 1, 1])
ADV = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
RATIOS = [1.0, 1.5, 0.9, 0.5, 1.1, 4.0]
OLD = torch.full((6,), -1.0)


def _logp(ratios: list[float] = RATIOS) -> torch.Tensor:
    # logp = old + log r, so exp(logp - old) = r.
    return (OLD + torch.log(torch.tensor(ratios, dtype=torch.float64)).float()).requires_grad_(True)


def _cfg(**kw) -> AlgoConfig:
    return AlgoConfig(**kw)


def _loss(cfg: AlgoConfig, logp: torch.Tensor | None = None, **kw):
    logp = _logp() if logp is None else logp
    loss, metrics = policy_loss(logp, OLD, ADV, MASK, SEQ, cfg, **kw)
    return loss, metrics, logp


# Per-token PPO-clip loss, clip 0.2 (range [0.8, 1.2]); pg = max(-A r, -A clip(r)):
#   t1: A=+1 r=1.5 -> max(-1.5, -1.2) = -1.2  (clipped)      t2: A=+1 r=0.9 -> -0.9
#   t3: A=-1 r=0.5 -> max( 0.5,  0.8) =  0.8  (clipped)      t4: A=-1 r=1.1 ->  1.1
#   t5: A=-1 r=4.0 -> max( 4.0,  1.2) =  4.0  (unclipped: PPO does not bound a bad action's ratio)
# token_mean:          (-1.2 - 0.9 + 0.8 + 1.1 + 4.0) / 5 = 3.8 / 5 = 0.76
# seq_mean_token_mean: ((-2.1)/2 + (5.9)/3) / 2 = (-1.05 + 1.966667) / 2 = 0.458333
# seq_mean_token_sum:  (-2.1 + 5.9) / 2 = 1.9
@pytest.mark.parametrize(
    ("agg", "expected"),
    [("token_mean", 0.76), ("seq_mean_token_mean", (-1.05 + 5.9 / 3) / 2), ("seq_mean_token_sum", 1.9)],
)
def test_ppo_clip_aggregations(agg: str, expected: float) -> None:
    loss, m, _ = _loss(_cfg(loss_agg=agg))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["pg_loss"] == pytest.approx(expected, rel=1e-5)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["dual_clip_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.9 + 0.5 + 1.1 + 4.0) / 5, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(4.0, rel=1e-5)  # the prompt token is not counted
    assert all(isinstance(v, float) for v in m.values())


def test_ppo_clip_gradient_zero_in_clipped_region() -> None:
    loss, _, logp = _loss(_cfg())
    loss.backward()
    # d/dlogp of -A r / 5 is -A r / 5 for unclipped tokens; 0 for clipped ones and the prompt.
    expected = [0.0, 0.0, -0.9 / 5, 0.0, 1.1 / 5, 4.0 / 5]
    assert logp.grad.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_asymmetric_clip_higher() -> None:
    # clip_high 0.28: t1 -> max(-1.5, -1.28) = -1.28; t3 lower bound unchanged 0.8.
    # (-1.28 - 0.9 + 0.8 + 1.1 + 4.0) / 5 = 3.72 / 5 = 0.744
    loss, m, _ = _loss(_cfg(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(0.744, rel=1e-5)
    # r=1.5 is still above 1.28 and r=0.5 below 0.8: both clipped.
    loss, m, _ = _loss(_cfg(clip_low=0.6, clip_high=0.6))  # range [0.4, 1.6]: nothing clipped
    assert m["clip_frac"] == 0.0
    assert loss.item() == pytest.approx((-1.5 - 0.9 + 0.5 + 1.1 + 4.0) / 5, rel=1e-5)


def test_dual_clip_caps_negative_advantage() -> None:
    # c = 3: t5 (A=-1, r=4) loss min(4.0, -3 * -1) = 3.0; others unchanged.
    # (-1.2 - 0.9 + 0.8 + 1.1 + 3.0) / 5 = 2.8 / 5 = 0.56
    loss, m, logp = _loss(_cfg(dual_clip=3.0))
    assert loss.item() == pytest.approx(0.56, rel=1e-5)
    assert m["dual_clip_frac"] == pytest.approx(1 / 5)
    loss.backward()
    assert logp.grad[5].item() == 0.0  # capped: constant in logp
    assert logp.grad[4].item() == pytest.approx(1.1 / 5, rel=1e-5)


def test_dual_clip_ignores_positive_advantage() -> None:
    # A=+1 with a huge ratio is clipped at 1+eps by PPO itself; dual clip never touches A > 0.
    adv = torch.ones(6)
    logp = _logp([1.0, 10.0, 10.0, 10.0, 10.0, 10.0])
    loss, m = policy_loss(logp, OLD, adv, MASK, SEQ, _cfg(dual_clip=2.0))
    assert loss.item() == pytest.approx(-1.2, rel=1e-5)
    assert m["dual_clip_frac"] == 0.0


# GSPO, all advantages +1, clip 0.2:
#   s0 = exp((log 1.5 + log 0.9) / 2) = sqrt(1.35)        = 1.161895  (inside [0.8, 1.2])
#   s1 = exp((log .5 + log 1.1 + log 4) / 3) = 2.2^(1/3)  = 1.300591  (clipped to 1.2)
#   token_mean: (2 * -1.161895 + 3 * -1.2) / 5 = -5.92379 / 5 = -1.184758
def test_gspo_sequence_ratio_value_and_clip() -> None:
    s0, s1 = math.sqrt(1.35), 2.2 ** (1 / 3)
    log_r = sequence_log_ratio(_logp(), OLD, MASK, SEQ)
    assert torch.exp(log_r)[1:].tolist() == pytest.approx([s0, s0, s1, s1, s1], rel=1e-5)
    adv = torch.ones(6)
    logp = _logp()
    loss, m = policy_loss(logp, OLD, adv, MASK, SEQ, _cfg(policy_loss="gspo"))
    assert loss.item() == pytest.approx((2 * -s0 + 3 * -1.2) / 5, rel=1e-5)
    assert m["clip_frac"] == pytest.approx(3 / 5)
    loss.backward()
    # Straight-through: each token of seq 0 gets -A * s0 / 5; the clipped seq 1 gets nothing.
    assert logp.grad.tolist() == pytest.approx([0.0, -s0 / 5, -s0 / 5, 0.0, 0.0, 0.0], rel=1e-5, abs=1e-7)


def test_gspo_gradient_matches_sequence_objective() -> None:
    # GSPO's objective (1/G) sum_i -A_i s_i(theta) with s_i = exp(mean_t (logp - old)): per-token gradients
    # -A_i s_i / (G |y_i|). The straight-through token form with seq_mean_token_mean must give the same.
    cfg = _cfg(policy_loss="gspo", loss_agg="seq_mean_token_mean", clip_low=0.9, clip_high=9.0)
    logp = _logp()
    loss, _ = policy_loss(logp, OLD, ADV, MASK, SEQ, cfg)
    loss.backward()
    ref = _logp()
    m = MASK.float()
    s = [torch.exp(((ref - OLD) * m)[SEQ == i].sum() / m[SEQ == i].sum()) for i in (0, 1)]
    objective = (-1.0 * s[0] + 1.0 * s[1]) / 2
    objective.backward()
    assert loss.item() == pytest.approx(objective.item(), rel=1e-5)
    assert logp.grad.tolist() == pytest.approx(ref.grad.tolist(), rel=1e-5, abs=1e-7)
    assert logp.grad[1].item() != 0.0 and logp.grad[4].item() != 0.0  # flows per token


def test_kl_estimators() -> None:
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.5, -0.5])  # d = logp - ref = [0.5, -0.5]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -0.5])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.125])
    # k3 = exp(-d) + d - 1: exp(-0.5) - 0.5 = 0.10653066; exp(0.5) - 1.5 = 0.14872127
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([0.10653066, 0.14872127], rel=1e-6)
    assert kl_penalty(logp, logp, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_kl_term_in_loss() -> None:
    # ratio 1 and A = 0: only the KL term. d = 0.5 everywhere, k2 = 0.125, coef 0.1 -> 0.0125.
    logp = torch.full((6,), -1.0, requires_grad=True)
    ref = torch.full((6,), -1.5)
    cfg = _cfg(kl_coef=0.1, kl_type="k2")
    loss, m = policy_loss(logp, OLD, torch.zeros(6), MASK, SEQ, cfg, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.0125, rel=1e-5)
    assert m["kl"] == pytest.approx(0.125, rel=1e-5)
    loss.backward()
    # d/dlogp 0.1 * 0.5 d^2 / 5 = 0.1 * d / 5 = 0.01 per masked token
    assert logp.grad.tolist() == pytest.approx([0.0] + [0.01] * 5, rel=1e-5)


def test_kl_off_needs_no_reference() -> None:
    loss, m, _ = _loss(_cfg(kl_coef=0.0), ref_logprobs=None)
    assert m["kl"] == 0.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        _loss(_cfg(kl_coef=0.1))


def test_entropy_bonus_sign() -> None:
    # A = 0: loss = -0.01 * mean(masked entropy) = -0.01 * (1+2+3+4+5)/5 = -0.03; more entropy -> lower loss.
    ent = torch.tensor([9.0, 1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    loss, m = policy_loss(_logp(), OLD, torch.zeros(6), MASK, SEQ, _cfg(entropy_coef=0.01), entropy=ent)
    assert loss.item() == pytest.approx(-0.03, rel=1e-5)
    assert m["entropy"] == pytest.approx(3.0)
    loss.backward()
    assert ent.grad.tolist() == pytest.approx([0.0] + [-0.002] * 5, rel=1e-5)


def test_tis_weights_pg_term() -> None:
    # ratio 1, A = +1 -> pg = -1 per token.
    # exp(old - rollout) = [-, 2, 0.8, 1, 1, 1.2], cap 1.5 -> w = [1.5, .8, 1, 1, 1.2]
    # loss = -(1.5 + 0.8 + 1 + 1 + 1.2) / 5 = -1.1; gradient of token 1 = -1 * 1.5 / 5 = -0.3
    logp = OLD.clone().requires_grad_(True)
    rollout = OLD - torch.log(torch.tensor([1.0, 2.0, 0.8, 1.0, 1.0, 1.2]))
    loss, m = policy_loss(logp, OLD, torch.ones(6), MASK, SEQ, _cfg(tis_cap=1.5), rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-1.1, rel=1e-5)
    assert m["tis_mean"] == pytest.approx(1.1, rel=1e-5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -0.3, -0.16, -0.2, -0.2, -0.24], rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(logp, OLD, torch.ones(6), MASK, SEQ, _cfg(tis_cap=1.5))


def test_mis_masks_tokens_keeps_normaliser() -> None:
    # exp(old - rollout) = [-, 0.4, 1, 1, 3, 1.5], keep [0.5, 2]: tokens 1 and 4 dropped.
    # loss = (-1 - 1 - 1) / 5 = -0.6 (icepop keeps the 5-token normaliser)
    logp = OLD.clone().requires_grad_(True)
    rollout = OLD - torch.log(torch.tensor([1.0, 0.4, 1.0, 1.0, 3.0, 1.5]))
    cfg = _cfg(mis_low=0.5, mis_high=2.0)
    loss, m = policy_loss(logp, OLD, torch.ones(6), MASK, SEQ, cfg, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-0.6, rel=1e-5)
    assert m["mis_masked_frac"] == pytest.approx(2 / 5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.2, -0.2, 0.0, -0.2], abs=1e-7)


def test_aggregate_modes_and_empty_mask() -> None:
    v = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    # masked: seq0 {2, 3}, seq1 {4, 5, 6}
    assert aggregate(v, MASK, SEQ, "token_mean").item() == pytest.approx(20 / 5)
    assert aggregate(v, MASK, SEQ, "seq_mean_token_mean").item() == pytest.approx((2.5 + 5.0) / 2)
    assert aggregate(v, MASK, SEQ, "seq_mean_token_sum").item() == pytest.approx((5 + 15) / 2)
    # global normalisers override local ones
    assert aggregate(v, MASK, SEQ, "token_mean", total_tokens=10).item() == pytest.approx(2.0)
    assert aggregate(v, MASK, SEQ, "seq_mean_token_sum", num_seqs=4).item() == pytest.approx(5.0)
    zero = torch.zeros(6, dtype=torch.long)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert aggregate(v, zero, SEQ, mode).item() == 0.0


def test_all_masked_no_nan() -> None:
    logp = _logp()
    loss, m = policy_loss(logp, OLD, ADV, torch.zeros(6, dtype=torch.long), SEQ, _cfg(policy_loss="gspo"))
    loss.backward()
    assert loss.item() == 0.0
    assert all(math.isfinite(x) for x in m.values())
    assert torch.isfinite(logp.grad).all()


def test_bf16_inputs_give_float32_loss() -> None:
    logp = _logp().detach().bfloat16().requires_grad_(True)
    loss, _ = policy_loss(logp, OLD.bfloat16(), ADV.bfloat16(), MASK, SEQ, _cfg())
    assert loss.dtype == torch.float32
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16


def test_approx_kl_zero_on_policy() -> None:
    logp = OLD.clone().requires_grad_(True)
    _, m = policy_loss(logp, OLD, ADV, MASK, SEQ, _cfg())
    assert m["approx_kl"] == 0.0 and m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0


# ---- micro-batch split: sum of micro losses (global normalisers) == whole mini-batch loss --------------------


@st.composite
def _minibatch(draw):
    n_seq = draw(st.integers(1, 6))
    lens = [draw(st.integers(1, 5)) for _ in range(n_seq)]
    n = sum(lens)
    floats = st.floats(-2.0, 2.0, allow_nan=False, width=32)
    logp = [draw(st.floats(-3.0, 0.0, width=32)) for _ in range(n)]
    delta = [draw(st.floats(-0.5, 0.5, width=32)) for _ in range(n)]
    adv_seq = [draw(floats) for _ in range(n_seq)]
    mask = [draw(st.integers(0, 1)) for _ in range(n)]
    cuts = sorted(set(draw(st.lists(st.integers(1, n_seq - 1), max_size=3)) if n_seq > 1 else []))
    return lens, logp, delta, adv_seq, mask, cuts


@settings(max_examples=60, deadline=None)
@given(
    batch=_minibatch(),
    agg=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]),
    kind=st.sampled_from(["ppo_clip", "gspo"]),
)
def test_microbatch_split_equals_full(batch, agg, kind) -> None:
    lens, logp_l, delta, adv_seq, mask_l, cuts = batch
    cfg = AlgoConfig(policy_loss=kind, loss_agg=agg, kl_coef=0.05, entropy_coef=0.01, dual_clip=3.0, tis_cap=2.0)
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    logp = torch.tensor(logp_l)
    old = logp + torch.tensor(delta)
    ref = logp - 0.3 * torch.tensor(delta)
    rollout = old + 0.2
    ent = torch.ones_like(logp)
    adv = torch.tensor(adv_seq)[seq_ids]
    mask = torch.tensor(mask_l)
    total, n_seq = int(mask.sum()), len(lens)

    def run(sel: slice, ids: torch.Tensor, **norm):
        x = logp[sel].clone().requires_grad_(True)
        loss, _ = policy_loss(
            x,
            old[sel],
            adv[sel],
            mask[sel],
            ids,
            cfg,
            rollout_logprobs=rollout[sel],
            ref_logprobs=ref[sel],
            entropy=ent[sel],
            **norm,
        )
        loss.backward()
        return loss, x.grad

    full_loss, full_grad = run(slice(None), seq_ids, num_seqs=n_seq, total_tokens=total)
    bounds = [0, *cuts, n_seq]
    starts = [sum(lens[:b]) for b in bounds]
    micro_loss, grads = 0.0, []
    for a, ta, tb in zip(bounds, starts, starts[1:]):
        local_ids = seq_ids[ta:tb] - a  # each micro-batch numbers its sequences from 0
        loss, g = run(slice(ta, tb), local_ids, num_seqs=n_seq, total_tokens=total)
        micro_loss += loss.item()
        grads.append(g)
    assert micro_loss == pytest.approx(full_loss.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(torch.cat(grads), full_grad, rtol=1e-5, atol=1e-6)
