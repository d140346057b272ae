"""The reward-function contract, checkable against your own plug-in (stage: rollout; STYLE 10).

Run it on your function from the shell::

    MILES_REWARD_FN=mypkg.rewards:score pytest tests/test_reward_contract.py

Optional: ``MILES_REWARD_EXAMPLES=examples.jsonl`` (rows ``{"prompt", "response", "label", "metadata"?}``) to check
on your own inputs instead of the generic ones of :func:`default_examples`, and ``MILES_REWARD_RANGE=lo,hi`` (or
``none``) when your rewards are not in ``[0, 1]``. Or from Python: ``check_reward_fn(fn, examples)``.

The contract (what :func:`check_reward_fn` checks, in this order, on every example):

1. ``fn`` is callable with one positional :class:`RewardInput`; ``async def`` and plain ``def`` both work;
2. it returns a finite real number (not ``bool``, not ``None``, not NaN/inf), within ``reward_range``
   (default ``[0, 1]``; pass ``reward_range=None`` if your function documents another range);
3. it does not mutate the input: the sample, its metadata and the label are unchanged after the call;
4. it is deterministic: a second call on the same input returns the same value.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_hpc.data.sample import Sample
from miles_hpc.rollout.rewards import AnyRewardFn, RewardInput, call_reward_fn

__all__ = ["ContractError", "check_reward_fn", "default_examples", "example_input", "load_examples"]


class ContractError(AssertionError):
    """A reward function breaks the contract; the message names the rule, the function and the example."""


def example_input(
    prompt: str | list[dict[str, Any]], response: str, label: Any, metadata: dict[str, Any] | None = None
) -> RewardInput:
    """A :class:`RewardInput` with a minimal valid sample (byte ids of prompt and response, one per byte)."""
    prompt_text = prompt if isinstance(prompt, str) else "".join(m.get("content", "") for m in prompt)
    p, r = list(prompt_text.encode()), list(response.encode())
    sample = Sample(
        prompt_id=0,
        group_id=0,
        tokens=p + r,
        prompt_len=len(p),
        loss_mask=[0] * len(p) + [1] * len(r),
        rollout_logprobs=[0.0] * len(p) + [-1.0] * len(r),
        policy_version=[-1] * len(p) + [0] * len(r),
        metadata=dict(metadata or {}),
    )
    return RewardInput(prompt=prompt, response=response, label=label, sample=sample, metadata=dict(metadata or {}))


def default_examples() -> list[RewardInput]:
    """Generic inputs any reward function should survive: right, wrong, empty, numeric, boxed, chat, unicode."""
    return [
        example_input("3+5=", "8", "8"),
        example_input("3+5=", "9", "8"),
        example_input("3+5=", "", "8"),
        example_input("What is 6*7?", "The answer is 42.", "42"),
        example_input("Compute 1/2.", r"So the result is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        example_input([{"role": "user", "content": "reverse abc"}], " cba\n", "cba", {"task": "reverse"}),
        example_input("Say hi", "héllo wörld ✓", "hello world"),
    ]


def load_examples(path: str | Path) -> list[RewardInput]:
    """Examples from a JSONL file of ``{"prompt", "response", "label", "metadata"?}`` rows."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
            out.append(example_input(row["prompt"], row["response"], row.get("label"), row.get("metadata")))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: bad example row: {type(e).__name__}: {e}") from None
    return out


def _snapshot(inp: RewardInput) -> tuple[Any, ...]:
    s = inp.sample
    return (
        list(s.tokens),
        s.prompt_len,
        list(s.loss_mask),
        list(s.rollout_logprobs),
        list(s.policy_version),
        s.reward,
        s.status,
        s.token_hash,
        copy.deepcopy(s.metadata),
        s.train_step,
        copy.deepcopy(inp.metadata),
        copy.deepcopy(inp.label),
        copy.deepcopy(inp.prompt),
    )


def _callable_with_one_arg(fn: Any) -> str | None:
    if not callable(fn):
        return f"is a {type(fn).__name__}, not callable"
    try:
        inspect.signature(fn).bind(object())
    except TypeError as e:
        return f"cannot be called with one positional RewardInput: {e}"
    except ValueError:  # builtins without a signature: let the call decide
        return None
    return None


async def _check(fn: AnyRewardFn, examples: Sequence[RewardInput], reward_range: tuple[float, float] | None) -> None:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    why = _callable_with_one_arg(fn)
    if why:
        raise ContractError(f"reward function {name} {why}")
    for i, inp in enumerate(examples):
        where = f"reward function {name} on example {i} (response={inp.response!r:.60}, label={inp.label!r:.40})"
        before = _snapshot(inp)
        try:
            first = await call_reward_fn(fn, inp)
        except Exception as e:  # raised, or returned a non-number / non-finite value
            raise ContractError(f"{where} failed: {type(e).__name__}: {e}") from e
        if reward_range is not None and not reward_range[0] <= first <= reward_range[1]:
            raise ContractError(
                f"{where} returned {first}, outside the range {list(reward_range)} "
                "(pass reward_range=... / MILES_REWARD_RANGE if yours documents another)"
            )
        if _snapshot(inp) != before or not inp.sample.hash_ok():
            raise ContractError(f"{where} mutated its input (sample, metadata or label); reward functions must not")
        second = await call_reward_fn(fn, inp)
        if first != second:
            raise ContractError(f"{where} is not deterministic: returned {first} then {second}")


def check_reward_fn(
    fn: AnyRewardFn,
    examples: Sequence[RewardInput] | None = None,
    *,
    reward_range: tuple[float, float] | None = (0.0, 1.0),
) -> None:
    """Check ``fn`` against the contract of the module docstring; raise :class:`ContractError` on the first breach.

    ``examples`` defaults to :func:`default_examples`. Runs its own event loop: call it from sync code.
    """
    examples = default_examples() if examples is None else list(examples)
    if not examples:
        raise ContractError("check_reward_fn needs at least one example")
    asyncio.run(_check(fn, examples, reward_range))
