"""Sampling: filters, the seeded batch-invariant noise, its distribution, and the stop rules end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import make_ckpt, run

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.sampling import SamplingBatch, sample, uniform_noise
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.models import load_pretrained

CPU = torch.device("cpu")


def batch(
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int] | None = None,
    vocab: int = 8,
    bans: list[tuple[int, ...]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, seeds, positions or [0] * n, bans or [()] * n, vocab, CPU)


def test_noise_is_a_pure_function_of_seed_position_and_index() -> None:
    u = uniform_noise(torch.tensor([1, 2, 1, -5]), torch.tensor([0, 0, 3, 0]), 1000)
    again = uniform_noise(torch.tensor([-5, 1]), torch.tensor([0, 0]), 1000)
    assert torch.equal(u[3], again[0]) and torch.equal(u[0], again[1])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < float(u.min()) and float(u.max()) < 1
    # Roughly uniform: mean 1/2, variance 1/12.
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_greedy_top_k1_and_logprobs() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    greedy = [SamplingParams(temperature=0.0)] * 5
    topk1 = [SamplingParams(temperature=1.3, top_k=1)] * 5
    t0, lp0 = sample(logits, batch(greedy, [1, 2, 3, 4, 5]))
    t1, _ = sample(logits, batch(topk1, [1, 2, 3, 4, 5]))
    assert torch.equal(t0, logits.argmax(-1)) and torch.equal(t1, t0)
    torch.testing.assert_close(lp0, torch.log_softmax(logits, -1).gather(1, t0[:, None])[:, 0])
    # A ban moves greedy to the runner-up; the reported log-prob stays the model's (unbanned) one.
    best = int(logits[0].argmax())
    t2, lp2 = sample(logits[:1], batch(greedy[:1], [1], bans=[(best,)]))
    assert int(t2) == int(logits[0].topk(2).indices[1])
    assert float(lp2) == pytest.approx(float(torch.log_softmax(logits[0], -1)[int(t2)]))


def empirical(logits: torch.Tensor, sp: SamplingParams, n: int = 20000) -> torch.Tensor:
    """Frequencies of n draws (n seeds) from one row of logits."""
    toks, _ = sample(logits.expand(n, -1), batch([sp] * n, list(range(n)), vocab=logits.shape[-1]))
    return torch.bincount(toks, minlength=logits.shape[-1]).float() / n


def chi_square_ok(freq: torch.Tensor, probs: torch.Tensor, n: int = 20000) -> bool:
    keep = probs > 0
    assert float(freq[~keep].sum()) == 0.0  # nothing outside the support
    stat = float((n * (freq[keep] - probs[keep]) ** 2 / probs[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat < dof + 6 * (2 * dof) ** 0.5  # far in the tail of chi2(dof); fixed seeds make it deterministic


def test_empirical_distribution_follows_filtered_softmax() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    p = torch.softmax(logits, -1)
    assert chi_square_ok(empirical(logits, SamplingParams(temperature=1.0)), p)
    assert chi_square_ok(empirical(logits, SamplingParams(temperature=0.5)), torch.softmax(logits / 0.5, -1))
    top3 = torch.zeros(8)
    top3[:3] = p[:3] / p[:3].sum()
    assert chi_square_ok(empirical(logits, SamplingParams(top_k=3)), top3)
    # top_p 0.7: the first tokens whose preceding mass is below 0.7 (here 0, 1, 2).
    assert float(p[:2].sum()) < 0.7 < float(p[:3].sum())
    assert chi_square_ok(empirical(logits, SamplingParams(top_p=0.7)), top3)
    # min_p 0.2: tokens with prob >= 0.2 * max prob (exp(-1.61) = 0.2: indices 0..3).
    keep4 = torch.zeros(8)
    keep4[:4] = p[:4] / p[:4].sum()
    assert chi_square_ok(empirical(logits, SamplingParams(min_p=0.2)), keep4)


def test_mixed_batch_rows_are_independent_of_neighbours() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in [(1.0, -1, 1.0), (0.0, -1, 1.0), (0.7, 5, 1.0), (1.2, -1, 0.9), (1.0, 3, 0.5), (2.0, -1, 1.0)]
    ]
    seeds, pos = [11, 12, 13, 14, 15, 16], [0, 4, 2, 9, 1, 3]
    together, _ = sample(logits, batch(params, seeds, pos, vocab=50))
    for i in range(6):
        alone, _ = sample(logits[i : i + 1], batch(params[i : i + 1], seeds[i : i + 1], pos[i : i + 1], vocab=50))
        assert int(alone) == int(together[i])


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("qwen3s"), "qwen3", 2)


def req(rid: str, prompt: list[int], **sp: object) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=tuple(prompt), sampling=SamplingParams(**sp))  # type: ignore[arg-type]


def test_seeded_requests_reproduce_alone_and_in_any_batch(ckpt: Path) -> None:
    p = [10, 20, 30, 40, 50]
    sp = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, sampling_seed=1234, ignore_eos=True)
    alone = run(Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4)), req("s", p, **sp))["s"]
    others = [req(f"o{i}", list(range(i, i + 3 * i + 1)), max_new_tokens=7, temperature=1.0) for i in range(5)]
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, seed=9))
    mixed = run(engine, *others[:3], req("s", p, **sp), *others[3:])["s"]
    assert mixed.output_ids == alone.output_ids and len(set(alone.output_ids)) > 2
    # ...and after a retraction in a tiny cache (the tokens are resampled at the same positions).
    tiny = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, num_blocks=8))
    res = run(tiny, *others[:2], req("s", p, **sp), *others[2:4])
    assert res["s"].output_ids == alone.output_ids
    # Different seed, different tokens; no seed: drawn from the engine seed (reproducible per engine seed).
    assert run(tiny, req("t", p, **{**sp, "sampling_seed": 99}))["t"].output_ids != alone.output_ids
    unseeded = {**sp, "sampling_seed": None}
    a = run(Engine.from_pretrained(str(ckpt), EngineConfig(seed=3)), req("u", p, **unseeded))["u"]
    b = run(Engine.from_pretrained(str(ckpt), EngineConfig(seed=3)), req("u", p, **unseeded))["u"]
    assert a.output_ids == b.output_ids


def test_stop_rules(ckpt: Path) -> None:
    model = load_pretrained(ckpt)
    p = [7, 7, 100, 3]
    base = dict(temperature=0.0, ignore_eos=True, max_new_tokens=10)
    ref = run(Engine(model, EngineConfig()), req("r", p, **base))["r"].output_ids
    assert len(ref) == 10
    k = next(i for i in range(2, 10) if ref[i] not in ref[:i])  # first position of a token not seen before
    stop = ref[k]
    r = run(Engine(model, EngineConfig()), req("s", p, **{**base, "stop_token_ids": (stop,)}))["s"]
    assert r.output_ids == ref[: k + 1] and r.finish_reason.type == "stop" and r.finish_reason.matched == stop
    # The same token as EOS: it stops unless ignore_eos; min_new_tokens masks it until reached.
    model.config = model.config.replace(eos_token_id=stop)
    engine = Engine(model, EngineConfig())
    assert engine.eos_token_ids == frozenset({stop})
    res = run(
        engine,
        req("eos", p, **{**base, "ignore_eos": False}),
        req("ign", p, **base),
        req("min", p, **{**base, "ignore_eos": False, "min_new_tokens": k + 2}),
    )
    assert res["eos"].output_ids == ref[: k + 1] and res["eos"].finish_reason.matched == stop
    assert res["ign"].output_ids == ref and res["ign"].finish_reason.type == "length"
    got = res["min"].output_ids
    assert got[:k] == ref[:k] and got[k] != stop and stop not in got[: k + 2]
    # max_new_tokens bounds everything; max_new_tokens=0 only scores the prompt.
    res = run(engine, req("len", p, **{**base, "max_new_tokens": 3}), req("zero", p, **{**base, "max_new_tokens": 0}))
    assert res["len"].output_ids == ref[:3] and res["len"].finish_reason.type == "length"
    assert res["zero"].output_ids == [] and res["zero"].finish_reason.type == "length"
