"""The reward-function contract (miles_hpc.rollout.contract) on the built-ins, on known-bad functions, and on yours:

    MILES_REWARD_FN=mypkg.rewards:score pytest tests/test_reward_contract.py

(optional: MILES_REWARD_EXAMPLES=examples.jsonl, MILES_REWARD_RANGE=lo,hi or none; see the module docstring).
"""

from __future__ import annotations

import asyncio
import functools
import os
import random

import pytest

from miles_hpc.config import RewardConfig
from miles_hpc.rollout.contract import ContractError, check_reward_fn, default_examples, example_input, load_examples
from miles_hpc.rollout.plugins import load_object
from miles_hpc.rollout.rewards import boxed_math, exact_match, numeric_match

NUMERIC_EXAMPLES = [
    example_input("3+5=", "8", "8"),
    example_input("3+5=", "9", 8),
    example_input("3+5=", "", "8"),
    example_input("half?", "0.5", "1/2"),
    example_input("big", "it is 1,000,000", "1000000"),
]


@pytest.mark.parametrize(
    ("fn", "examples"),
    [
        (exact_match, None),
        (boxed_math, None),
        (numeric_match, NUMERIC_EXAMPLES),
        (functools.partial(numeric_match, rel_tol=1e-3), NUMERIC_EXAMPLES),
    ],
)
def test_builtins_meet_contract(fn, examples) -> None:
    check_reward_fn(fn, examples)


def test_async_and_callable_objects_meet_contract() -> None:
    async def async_fn(inp):
        await asyncio.sleep(0)
        return exact_match(inp)

    class Scorer:
        async def __call__(self, inp):
            return 1.0 if inp.label in inp.response else 0.0

    check_reward_fn(async_fn)
    check_reward_fn(Scorer())


def _mutates(inp):
    inp.sample.metadata["seen"] = True
    return 0.0


def _mutates_tokens(inp):
    inp.sample.tokens.append(1)
    return 0.0


_rng = random.Random(0)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda: 1.0, "cannot be called with one positional RewardInput"),
        (lambda a, b: 1.0, "cannot be called with one positional RewardInput"),
        (42, "not callable"),
        (lambda inp: True, "returned bool"),
        (lambda inp: None, "returned NoneType"),
        (lambda inp: float("inf"), "non-finite inf"),
        (lambda inp: 2.0, r"returned 2.0, outside the range \[0.0, 1.0\]"),
        (lambda inp: 1 / 0, "failed: ZeroDivisionError"),
        (_mutates, "mutated its input"),
        (_mutates_tokens, "mutated its input"),
        (lambda inp: _rng.random(), "is not deterministic"),
    ],
)
def test_contract_catches_bad_functions(fn, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        check_reward_fn(fn)


def test_contract_range_and_examples() -> None:
    check_reward_fn(lambda inp: -1.0, reward_range=(-1.0, 1.0))
    check_reward_fn(lambda inp: 5.0, reward_range=None)
    with pytest.raises(ContractError, match="at least one example"):
        check_reward_fn(exact_match, [])
    assert len(default_examples()) >= 5


def _user_range() -> tuple[float, float] | None:
    raw = os.environ.get("MILES_REWARD_RANGE", "0,1")
    if raw.strip().lower() == "none":
        return None
    lo, hi = (float(x) for x in raw.split(","))
    return (lo, hi)


def test_user_reward_fn_meets_contract() -> None:
    # Without MILES_REWARD_FN this checks the default of RewardConfig.fn through the same dotted-path loading.
    fn = load_object(os.environ.get("MILES_REWARD_FN", RewardConfig().fn), kind="reward function")
    path = os.environ.get("MILES_REWARD_EXAMPLES")
    check_reward_fn(fn, load_examples(path) if path else None, reward_range=_user_range())
