"""Built-in synthetic tasks: deterministic, labels correct by construction, short prompts and answers."""

from __future__ import annotations

import pytest

from miles_hpc.data.tasks import TASKS, make_task, task_spec


def _solve(prompt: str) -> str:
    # An independent solver, written from the docstring's formats rather than the generators.
    if prompt.startswith("copy "):
        return prompt.removeprefix("copy ")
    if prompt.startswith("echo "):
        return prompt.removeprefix("echo ")
    if prompt.startswith("reverse "):
        return prompt.removeprefix("reverse ")[::-1]
    a, b = prompt.removesuffix("=").split("+")
    return str(int(a) + int(b))


@pytest.mark.parametrize("name", sorted(set(TASKS) - {"terminal"}))  # terminal: tests/test_terminal_env.py
def test_labels_correct_and_formats(name: str) -> None:
    recs = make_task(name, n=500, seed=3)
    assert [r.prompt_id for r in recs] == list(range(500))
    spec = task_spec(name)
    for r in recs:
        assert isinstance(r.prompt, str) and isinstance(r.label, str) and r.metadata == {"task": name}
        assert r.label == _solve(r.prompt)
        assert (
            1 <= len(r.label.encode()) <= spec.max_answer_tokens
            and len(r.prompt) <= len("reverse ") + spec.max_answer_tokens
        )
    assert len({r.prompt for r in recs}) > 20  # not one problem repeated


def test_task_shapes() -> None:
    arith = make_task("arith", n=2000, seed=0)
    assert {r.label for r in arith} == {str(d) for d in range(10)}
    assert all(len(r.label) == 1 for r in arith)
    assert len({r.prompt for r in arith}) == 55  # every one-digit-sum problem shows up
    for name in ("copy", "reverse"):
        letters = {r.label for r in make_task(name, n=2000, seed=0)}
        assert {len(s) for s in letters} == {2, 3, 4} and set("".join(letters)) == set("abcd")


def test_echo_lengths_long_tailed() -> None:
    lengths = sorted(len(r.label) for r in make_task("echo", n=20000, seed=0))
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert median == 3 and p99 >= 8 * median and lengths[0] == 1 and lengths[-1] == 32


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_in_seed(name: str) -> None:
    assert make_task(name, n=50, seed=1) == make_task(name, n=50, seed=1)
    assert make_task(name, n=50, seed=1) != make_task(name, n=50, seed=2)
    assert make_task(name, n=10, seed=1) == make_task(name, n=50, seed=1)[:10]  # a prefix: n only truncates


def test_pinned_output() -> None:
    # Pinned values: a change here changes every run's data, so it must be deliberate.
    assert [(r.prompt, r.label) for r in make_task("arith", n=3, seed=0)] == PINNED


PINNED = [("4+2=", "6"), ("8+1=", "9"), ("0+7=", "7")]


def test_unknown_task_and_bad_n() -> None:
    with pytest.raises(ValueError, match="unknown built-in task 'nope'; choose one of arith, copy, reverse"):
        make_task("nope", n=1, seed=0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        make_task("arith", n=0, seed=0)


def test_arith_answers_are_uniform() -> None:
    # No constant answer may be an attractor for RL: each sum 0..9 is about 10% of the prompts.
    labels = [r.label for r in make_task("arith", n=5000, seed=3)]
    for digit in "0123456789":
        assert 0.08 < labels.count(digit) / len(labels) < 0.12
