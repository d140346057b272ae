"""Supervised warm-up batches: prompt -> label + eos, loss only on the answer, labels shuffled on request; marked
supervised, they train the same whatever off-policy correction or KL penalty the run's RL steps use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_fsdp import params_of, world  # noqa: F401 (world: the gloo fixture)
from transformers import AutoTokenizer

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.data.prompts import render_prompt
from miles_hpc.data.sample import token_hash
from miles_hpc.data.tasks import make_task
from miles_hpc.loop.warmup import warmup_batches
from miles_hpc.models.presets import init_model
from miles_hpc.models.tokenizer import write_tokenizer
from miles_hpc.train.fsdp import FSDPTrainer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    out: Path = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches(tok, shuffle: bool) -> None:
    records = make_task("arith", n=200, seed=0)
    render = lambda r: render_prompt(r, tok)  # noqa: E731
    by_prompt = {tuple(render(r)): r.label for r in records}
    batches = list(warmup_batches(records, render, tok, steps=3, batch_size=16, shuffle_labels=shuffle, seed=1))
    assert len(batches) == 3
    mismatched = 0
    for b in batches:
        assert len(b) == 16
        for toks, mask, adv, h in zip(b.tokens, b.loss_mask, b.advantages, b.token_hash):
            p = mask.index(1)
            assert mask == [0] * p + [1] * (len(toks) - p) and adv == [float(m) for m in mask]
            assert toks[-1] == tok.eos_token_id and h == token_hash(toks)
            answer = tok.decode(toks[p:-1])
            assert answer.isdigit() and len(answer) == 1  # the format is always the task's
            mismatched += answer != by_prompt[tuple(toks[:p])]
    if shuffle:
        assert mismatched > 10  # other prompts' labels: the answers are mostly wrong
    else:
        assert mismatched == 0


def test_off_policy_corrections_leave_the_warm_up_alone(world: None, tok, tmp_path: Path) -> None:  # noqa: F811
    """TIS and MIS weigh a token by its probability against the rollout's log-prob, which a warm-up batch does not
    have (placeholders 0): with `algo.mis_low=0.5` nearly every answer token was masked and the warm-up learned
    nothing (the Qwen3-Next demo's answer nll stayed at 5.8, found in a fully async run), and a KL penalty asked
    for reference log-probs it has none of. Marked supervised, two warm-up steps move the weights exactly as
    without them, and the answer's log-likelihood rises."""
    model = init_model("qwen3", "tiny", tmp_path / "model", seed=0)
    records = make_task("arith", n=64, seed=0)
    batches = list(
        warmup_batches(records, lambda r: render_prompt(r, tok), tok, steps=2, batch_size=16, shuffle_labels=False,
                       seed=0)
    )  # fmt: skip
    assert all(b.supervised for b in batches)
    cfg = TrainConfig(lr=1e-2, grad_clip=0.0)
    corrected = AlgoConfig(tis_cap=2.0, mis_low=0.5, mis_high=2.0, kl_coef=0.1)
    weights, nll = [], []
    for algo in (AlgoConfig(), corrected):
        trainer = FSDPTrainer(model, cfg, algo, device="cpu", seed=0)
        # rollout log-probs of 0: the mismatch metric is the answer tokens' mean nll before each update
        nll.append([trainer.train_step(b)["mismatch/mean_abs_logprob_diff"] for b in batches])
        weights.append(params_of(trainer))
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, rtol=0, atol=0, msg=name)
    assert nll[1][1] < nll[1][0], nll
