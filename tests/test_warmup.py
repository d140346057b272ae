"""Supervised warm-up batches: prompt -> label + eos, loss only on the answer, labels shuffled on request."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles_hpc.data.prompts import render_prompt
from miles_hpc.data.sample import token_hash
from miles_hpc.data.tasks import make_task
from miles_hpc.loop.warmup import warmup_batches
from miles_hpc.models.tokenizer import write_tokenizer


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
