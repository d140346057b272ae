"""Reward built-ins on hand-written cases, concurrent scoring with isolated failures, dotted-path plug-ins."""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import time
from pathlib import Path

import pytest

from miles_hpc.rollout.contract import example_input
from miles_hpc.rollout.plugins import PluginError, load_object
from miles_hpc.rollout.rewards import (
    RewardOutcome,
    boxed_math,
    char_match,
    exact_match,
    extract_boxed,
    load_reward_fn,
    numeric_match,
    parse_last_number,
    score_samples,
)


def r(fn, response: str, label: object, **kw) -> float:
    return fn(example_input("q", response, label), **kw)


def test_exact_match() -> None:
    assert r(exact_match, " 8\n", "8") == 1.0
    assert r(exact_match, "8", 8) == 1.0  # label compared as its string
    assert r(exact_match, "8.", "8") == 0.0
    assert r(exact_match, "", "8") == 0.0
    assert r(exact_match, "c ba", "cba") == 0.0


def test_char_match() -> None:
    assert r(char_match, " abcd\n", "abcd") == 1.0
    assert r(char_match, "abca", "abcd") == 0.75
    assert r(char_match, "ab", "abcd") == 0.5  # too short: the missing half is lost
    assert r(char_match, "abcdcd", "abcd") == pytest.approx(4 / 6)  # too long: extra characters cost too
    assert r(char_match, "bcda", "abcd") == 0.0  # positions, not a bag of characters
    assert r(char_match, "", "abcd") == 0.0 and r(char_match, "", "") == 1.0
    for got, want in (("x", "x"), ("xy", "x"), ("a b", "ab")):
        assert (r(char_match, got, want) == 1.0) == (r(exact_match, got, want) == 1.0)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("The answer is 42.", 42),
        ("10-5", 5),
        ("x = -5", -5),
        ("1,234 apples", 1234),
        ("pairs 1,2", 2),
        ("2e3", 2000),
        (".5", 0.5),
        ("-.25 then 3.75", 3.75),
        ("no digits", None),
        ("", None),
        ("a5", 5),
    ],
)
def test_parse_last_number(text: str, value: float | None) -> None:
    assert parse_last_number(text) == value


def test_numeric_match_and_tolerance() -> None:
    assert r(numeric_match, "so it is 8", "8") == 1.0
    assert r(numeric_match, "8 then 9", "8") == 0.0  # the last number counts
    assert r(numeric_match, "0.33333", "1/3") == 0.0
    assert r(numeric_match, "0.33333", "1/3", rel_tol=1e-4) == 1.0
    loose = functools.partial(numeric_match, abs_tol=0.5)  # how a config binds tolerance
    assert loose(example_input("q", "7.6", 8)) == 1.0 and loose(example_input("q", "7.4", 8)) == 0.0
    assert r(numeric_match, "1,000", "1000") == 1.0
    assert r(numeric_match, "nothing", "3") == 0.0
    with pytest.raises(ValueError, match="label 'abc' is not a number"):
        r(numeric_match, "3", "abc")


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"\boxed{5}", "5"),
        (r"a \boxed{1} b \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{{a}{b}}", "{a}{b}"),
        (r"\boxed{1} then \boxed{2", "1"),
        ("no box", None),
        (r"\fbox{7}", "7"),
        (r"\boxed {x}", "x"),
    ],
)
def test_extract_boxed_balanced(text: str, content: str | None) -> None:
    assert extract_boxed(text) == content


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
        (r"\boxed{\tfrac34}", "0.75", 1.0),
        (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{\frac{-3}{4}}", r"-\frac34", 1.0),
        (r"\boxed{ 12. }", "12", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{\left( 3 \right)}", "3", 1.0),
        (r"\boxed{\text{yes}}", "yes", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\dfrac{\sqrt{2}}{2}", 1.0),  # not numeric: compared as strings
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{3}}{2}", 0.0),
        (r"\boxed{1} wait, actually \boxed{2}", "2", 1.0),
        (r"\boxed{1} wait, actually \boxed{2}", "1", 0.0),
        (r"\boxed{(1,2)}", "12", 0.0),  # a pair is not the thousands-separated 12
        ("the answer is 5", "5", 0.0),  # no box, no credit
        (r"\boxed{5}", r"\boxed{5}", 1.0),  # a boxed label is unboxed
        (r"\boxed{5}", 5, 1.0),
        (r"\boxed{0.3333}", r"\frac{1}{3}", 0.0),
    ],
)
def test_boxed_math(response: str, label: object, reward: float) -> None:
    assert r(boxed_math, response, label) == reward


def test_boxed_math_tolerance_kwarg() -> None:
    assert r(boxed_math, r"\boxed{0.3333}", r"\frac{1}{3}", rel_tol=1e-3) == 1.0


# -- score_samples -----------------------------------------------------------------------------------------------


def _inputs(n: int):
    return [example_input(f"q{i}", str(i), str(i)) for i in range(n)]


def test_score_samples_sync_and_async_in_order() -> None:
    async def async_exact(inp):
        await asyncio.sleep(0.01 * (5 - len(inp.response)))
        return exact_match(inp)

    inputs = _inputs(5) + [example_input("q", "wrong", "x")]
    for fn in (exact_match, async_exact):
        out = asyncio.run(score_samples(inputs, fn, timeout_s=5))
        assert out == [RewardOutcome(reward=1.0)] * 5 + [RewardOutcome(reward=0.0)]


def test_score_samples_isolates_errors_timeouts_and_bad_values() -> None:
    async def fn(inp):
        i = int(inp.response)
        if i == 1:
            raise KeyError("boom")
        if i == 2:
            await asyncio.sleep(10)
        return {3: float("nan"), 4: "1.0", 5: True, 6: None}.get(i, 0.5)

    t0 = time.monotonic()
    out = asyncio.run(score_samples(_inputs(8), fn, timeout_s=0.2))
    assert time.monotonic() - t0 < 2
    assert [o.failed for o in out] == [False, True, True, True, True, True, True, False]
    assert out[0] == out[7] == RewardOutcome(reward=0.5)
    assert all(o.reward == 0.0 for o in out[1:7])
    assert out[1].error == "KeyError: 'boom'"
    assert "timed out after 0.2 s" in out[2].error
    assert "non-finite nan" in out[3].error
    assert "returned str '1.0', not a float" in out[4].error
    assert "returned bool" in out[5].error and "returned NoneType" in out[6].error


def test_score_samples_sync_timeout_and_concurrency_bound() -> None:
    def slow(inp):
        time.sleep(1.0 if inp.response == "0" else 0.0)
        return 1.0

    out = asyncio.run(score_samples(_inputs(3), slow, timeout_s=0.1))
    assert out[0].failed and "timed out" in out[0].error and not out[1].failed and not out[2].failed

    live = peak = 0

    async def counted(inp):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.01)
        live -= 1
        return 1.0

    asyncio.run(score_samples(_inputs(10), counted, timeout_s=None, max_concurrency=3))
    assert peak == 3


def test_score_samples_does_not_touch_samples() -> None:
    inputs = _inputs(3)
    asyncio.run(score_samples(inputs, lambda inp: 0.7, timeout_s=1))
    assert all(inp.sample.reward == 0.0 for inp in inputs)


# -- plug-ins ----------------------------------------------------------------------------------------------------


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "myplug.py").write_text(
        "def score(inp):\n    return 1.0\n"
        "class Scorer:\n    @staticmethod\n    def run(inp):\n        return 0.0\n"
        "THRESHOLD = 3\n"
    )
    (tmp_path / "brokenplug.py").write_text("import not_a_real_dependency_xyz\n")
    (tmp_path / "raisingplug.py").write_text("raise RuntimeError('bad config at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in ("myplug", "brokenplug", "raisingplug"):
        sys.modules.pop(m, None)


def test_load_object_forms(plugin_dir: Path) -> None:
    import myplug

    assert load_object("myplug:score", kind="reward function") is myplug.score
    assert load_object("myplug.score", kind="reward function") is myplug.score
    assert load_object("myplug:Scorer.run", kind="reward function") is myplug.Scorer.run
    assert load_object("miles_hpc.rollout.rewards:exact_match", kind="x") is exact_match
    assert load_object("myplug:THRESHOLD", kind="constant", require_callable=False) == 3


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nopkg_xyz.mod:fn", "reward function 'nopkg_xyz.mod:fn': module 'nopkg_xyz.mod' not found"),
        ("brokenplug:fn", "importing module 'brokenplug' failed: ModuleNotFoundError: No module named 'not_a_real"),
        ("raisingplug:fn", "importing module 'raisingplug' failed: RuntimeError: bad config at import"),
        ("myplug:scor", r"'myplug' has no attribute 'scor' \(did you mean score"),
        ("myplug:Scorer.walk", "'myplug.Scorer' has no attribute 'walk'"),
        ("myplug:THRESHOLD", "'myplug.THRESHOLD' is a int, not callable"),
        ("justaname", "expected a dotted path"),
        ("myplug:", "expected a dotted path"),
        ("my-plug:fn", "expected a dotted path"),
    ],
)
def test_load_object_errors(plugin_dir: Path, path: str, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        load_object(path, kind="reward function")


def test_load_reward_fn_binds_kwargs() -> None:
    fn = load_reward_fn("miles_hpc.rollout.rewards:numeric_match", {"abs_tol": 0.5})
    assert fn(example_input("q", "7.6", "8")) == 1.0
    assert load_reward_fn("miles_hpc.rollout.rewards:exact_match") is exact_match
    assert math.isclose(load_reward_fn("miles_hpc.rollout.rewards.numeric_match")(example_input("q", "8", 8)), 1.0)
