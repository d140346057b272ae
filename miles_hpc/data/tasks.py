"""Built-in synthetic verifiable tasks (stage: data): easy on purpose, so a tiny model shows RL learning on a CPU.

Each task makes :class:`~miles_hpc.data.prompts.PromptRecord`s whose ``prompt`` is a very short plain string (the
loop renders it with the tokenizer's chat template when ``DataConfig.apply_chat_template``) and whose ``label`` is
the exact expected answer string. The reward is exact match (``miles_hpc.rollout.rewards:exact_match``): the
response, stripped of surrounding whitespace, must equal the label. Nothing is partial credit.

Tasks (answer format in each ``TaskSpec.answer_format``):

- ``arith``: single-digit addition with a one-digit sum, ``"3+5="`` -> ``"8"`` (55 distinct problems).
- ``copy``: ``"copy abc"`` -> ``"abc"``; 2-4 letters from ``abcd``.
- ``reverse``: ``"reverse abc"`` -> ``"cba"``; 2-4 letters from ``abcd``.
- ``echo``: ``"echo abcab"`` -> ``"abcab"``, a copy task whose lengths are long-tailed: 1-32 letters from ``abcd``,
  the length drawn from a lognormal with median 3 and sigma 0.9 (p99 about 8x the median; 8% of answers are longer
  than 10). Responses as long-tailed as their answers make a few samples decide a synchronous rollout's time: the
  task of the fully async comparison (docs/fully_async.md).
- ``terminal``: multi-turn; the prompt is the goal of a simulated terminal task (``data/terminal_env.py``), the
  label its answer, ``metadata["task_seed"]`` rebuilds its files. Needs ``rollout.agent`` (the reference:
  ``miles_hpc.rollout.agents:terminal_agent``), whose environment gives the reward.

Invariants: ``make_task(name, n=n, seed=seed)`` is a pure function of its arguments (same records, same order, on
every platform); ``prompt_id`` is the index 0..n-1; every label is correct by construction; ``metadata`` holds
``{"task": name}``. Problems are drawn with replacement, so ``n`` may exceed the number of distinct problems.

Why these: a random-init byte-level model must emit the right byte(s) and then the end-of-turn token; with
answers of 1 character and an alphabet of 10 digits (or 4 letters) the first successes come early enough for
GRPO groups to have reward variance. ``TaskSpec.max_answer_tokens`` + 1 (for the stop token) is a sensible
``max_new_tokens``: a longer budget mostly adds ways to fail.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from miles_hpc.data.prompts import PromptRecord
from miles_hpc.data.terminal_env import make_terminal_task

__all__ = ["TASKS", "TaskSpec", "make_task", "task_spec"]

_LETTERS = "abcd"
_ECHO_MAX = 32


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpec:
    """A built-in task: how to draw one (prompt, label) pair, and what its answers look like."""

    name: str
    answer_format: str
    max_answer_tokens: int  # bytes of the longest label (byte-level tokenizer: one token per byte)
    draw: Callable[[random.Random], tuple[str, str] | tuple[str, str, dict[str, object]]]  # (+ metadata)


def _arith(rng: random.Random) -> tuple[str, str]:
    # The sum is drawn first, uniformly: with "a uniform, then b" the answer 9 would be right 29% of the time, and
    # a policy that always says 9 is an attractor RL falls into. Uniform answers make every constant answer 10%.
    total = rng.randint(0, 9)  # one-digit sum: every answer is a single character
    a = rng.randint(0, total)
    return f"{a}+{total - a}=", str(total)


def _letters(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 4)))


def _copy(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng)
    return f"copy {s}", s


def _echo(rng: random.Random) -> tuple[str, str]:
    n = min(_ECHO_MAX, max(1, round(math.exp(math.log(3) + 0.9 * rng.gauss(0.0, 1.0)))))
    s = "".join(rng.choice(_LETTERS) for _ in range(n))
    return f"echo {s}", s


def _reverse(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng)
    return f"reverse {s}", s[::-1]


def _terminal(rng: random.Random) -> tuple[str, str, dict[str, object]]:
    seed = rng.randrange(2**31)
    task = make_terminal_task(seed)
    return task.goal, task.answer, {"task_seed": seed, "kind": task.kind}


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="arith", answer_format="the sum as one decimal digit, e.g. '8'", max_answer_tokens=1, draw=_arith
        ),
        TaskSpec(
            name="copy",
            answer_format=f"the 2-4 letters (from {_LETTERS!r}) after 'copy '",
            max_answer_tokens=4,
            draw=_copy,
        ),
        TaskSpec(
            name="reverse",
            answer_format=f"the 2-4 letters (from {_LETTERS!r}) after 'reverse ', reversed",
            max_answer_tokens=4,
            draw=_reverse,
        ),
        TaskSpec(
            name="echo",
            answer_format=f"the 1-{_ECHO_MAX} letters (from {_LETTERS!r}) after 'echo '",
            max_answer_tokens=_ECHO_MAX,
            draw=_echo,
        ),
        TaskSpec(
            name="terminal",
            answer_format="commands over turns; the answer written to /answer.txt",
            max_answer_tokens=32,
            draw=_terminal,
        ),
    )
}


def task_spec(name: str) -> TaskSpec:
    """The spec of a built-in task; ``ValueError`` listing the known names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def make_task(name: str, *, n: int, seed: int = 0) -> list[PromptRecord]:
    """``n`` records of built-in task ``name``, deterministic in ``(name, n, seed)``."""
    spec = task_spec(name)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    # A string seed goes through sha512 in CPython: the same stream on every platform and version.
    rng = random.Random(f"miles-task/{name}/{seed}")
    records = []
    for i in range(n):
        prompt, label, *extra = spec.draw(rng)
        meta = {"task": name, **(extra[0] if extra else {})}
        records.append(PromptRecord(prompt_id=i, prompt=prompt, label=label, metadata=meta))
    return records
