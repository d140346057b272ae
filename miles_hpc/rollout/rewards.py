"""Reward functions and concurrent scoring (stage: rollout, after generation; docs/design.md section 1).

A reward function takes one :class:`RewardInput` and returns a float; it may be ``async def`` or a plain function
(run in a worker thread so it cannot stall the event loop). It is named by dotted path in ``RewardConfig.fn`` and
loaded with :func:`load_reward_fn`; ``functools.partial``-style keyword arguments configure the built-ins
(``numeric_match(inp, rel_tol=..., abs_tol=...)``).

Invariants of :func:`score_samples`:
- one :class:`RewardOutcome` per input, in input order;
- a function that raises, times out, or returns something that is not a finite real number (``bool`` included)
  yields ``RewardOutcome(reward=0.0, failed=True, error=...)`` for that input only; the others proceed;
- the samples are not modified: the caller decides how an outcome lands in ``Sample.reward`` / ``status``.

Built-ins returning 1.0 or 0.0: :func:`exact_match`, :func:`numeric_match`, :func:`boxed_math`; with partial credit
in [0, 1]: :func:`char_match`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import re
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from miles_hpc.data.sample import Sample
from miles_hpc.rollout.plugins import load_object

_FLOAT32_MAX = 3.4028234663852886e38

__all__ = [
    "AnyRewardFn",
    "RewardFn",
    "RewardInput",
    "RewardOutcome",
    "boxed_math",
    "call_reward_fn",
    "char_match",
    "exact_match",
    "extract_boxed",
    "load_reward_fn",
    "normalize_math",
    "numeric_match",
    "parse_last_number",
    "score_samples",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardInput:
    """What a reward function sees for one finished sample.

    ``response`` is the decoded response text with special tokens removed and the stop token stripped.
    ``metadata`` is the prompt record's metadata (its extra columns); ``sample`` is read-only by contract.
    """

    prompt: str | list[dict[str, Any]]
    response: str
    label: Any
    sample: Sample
    metadata: dict[str, Any] = field(default_factory=dict)


class RewardFn(Protocol):
    """``async def fn(inp: RewardInput) -> float``; a plain ``def`` returning float is accepted too."""

    async def __call__(self, inp: RewardInput, /) -> float: ...


AnyRewardFn: TypeAlias = RewardFn | Callable[[RewardInput], float] | Callable[[RewardInput], Awaitable[float]]


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardOutcome:
    """The reward of one sample, or why there is none (``failed``; ``reward`` is then 0.0)."""

    reward: float
    failed: bool = False
    error: str | None = None
    traceback: str | None = None  # of the exception, when the function raised


# -- calling --------------------------------------------------------------------------------------------------------


def _is_async(fn: Any) -> bool:
    # inspect unwraps functools.partial; a callable object is async when its __call__ is.
    return inspect.iscoroutinefunction(fn) or (callable(fn) and inspect.iscoroutinefunction(fn.__call__))


def _fn_name(fn: Any) -> str:
    base = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(base, "__qualname__", None) or type(base).__name__


def check_reward_value(value: Any, fn: Any) -> float:
    """``value`` as a float, or ``TypeError``/``ValueError`` saying why it is not a valid reward."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward function {_fn_name(fn)} returned {type(value).__name__} {value!r:.60}, not a float")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward function {_fn_name(fn)} returned non-finite {out}")
    if abs(out) > _FLOAT32_MAX:  # stored as float32 (docs/formats.md): it would become inf there
        raise ValueError(
            f"reward function {_fn_name(fn)} returned {out:g}, outside the float32 range of stored rewards"
        )
    return out


async def call_reward_fn(fn: AnyRewardFn, inp: RewardInput) -> float:
    """Call ``fn`` on ``inp`` (awaiting it, or in a worker thread when it is sync) and check the value."""
    if _is_async(fn):
        value = await fn(inp)
    else:
        value = await asyncio.to_thread(fn, inp)
        if inspect.isawaitable(value):  # a sync wrapper returning a coroutine (e.g. a lambda around an async fn)
            value = await value
    return check_reward_value(value, fn)


async def score_samples(
    inputs: Sequence[RewardInput],
    fn: AnyRewardFn,
    *,
    timeout_s: float | None = None,
    max_concurrency: int | None = None,
) -> list[RewardOutcome]:
    """Score every input concurrently; a failure or timeout is isolated to its own outcome (see module invariants).

    ``timeout_s`` bounds each call (None = no limit). A timed-out *sync* function keeps its worker thread until
    it returns (Python cannot kill a thread); its result is discarded. ``max_concurrency`` bounds calls in flight.
    """
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(inp: RewardInput) -> RewardOutcome:
        try:
            if gate is None:
                reward = await asyncio.wait_for(call_reward_fn(fn, inp), timeout_s)
            else:
                async with gate:
                    reward = await asyncio.wait_for(call_reward_fn(fn, inp), timeout_s)
        except TimeoutError:
            error = f"reward function {_fn_name(fn)} timed out after {timeout_s} s"
            return RewardOutcome(reward=0.0, failed=True, error=error)
        except Exception as e:  # the user's code: any error is this sample's failure, not the batch's
            trace = "".join(traceback.format_exception(e))
            return RewardOutcome(reward=0.0, failed=True, error=f"{type(e).__name__}: {e}", traceback=trace)
        return RewardOutcome(reward=reward)

    return list(await asyncio.gather(*(one(inp) for inp in inputs)))


def load_reward_fn(path: str, kwargs: Mapping[str, Any] | None = None) -> AnyRewardFn:
    """The reward function at dotted ``path``, with ``kwargs`` bound as ``functools.partial`` keywords."""
    fn = load_object(path, kind="reward function")
    return functools.partial(fn, **kwargs) if kwargs else fn


# -- built-ins ------------------------------------------------------------------------------------------------------


def exact_match(inp: RewardInput) -> float:
    """1.0 when the response equals ``str(label)``, both stripped of surrounding whitespace; else 0.0."""
    return 1.0 if inp.response.strip() == str(inp.label).strip() else 0.0


def char_match(inp: RewardInput) -> float:
    """Partial credit for string answers: the characters equal to the label's at the same position, divided by the
    longer of response and label (both stripped). 1.0 exactly when ``exact_match`` gives 1.0; a response too short
    or too long loses the share it misses or adds, so the length of the answer is part of what is rewarded."""
    got, want = inp.response.strip(), str(inp.label).strip()
    if not got or not want:
        return 1.0 if got == want else 0.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))


# A number: optional sign (not when glued to a preceding word/number, so "10-5" ends in "5"), thousands groups,
# decimals, exponent. Also a bare ".5".
_NUMBER = re.compile(r"(?:(?<![\w)])[-+])?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
_FRACTION = re.compile(r"^([-+]?)\(?([-+]?[\d.,]+(?:[eE][-+]?\d+)?)\)?/\(?([-+]?[\d.,]+(?:[eE][-+]?\d+)?)\)?$")


_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?:[eE][-+]?\d+)?$")


def _to_float(text: str) -> float | None:
    # Commas only as thousands separators: "1,000" is 1000 but "1,2" (a pair) is not a number.
    if "," in text:
        if not _THOUSANDS.match(text):
            return None
        text = text.replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None  # "inf"/"nan" are words here, not answers


def parse_last_number(text: str) -> float | None:
    """The last number in ``text`` ("1,234", "-3.5", "2e3", ".5"), or None when there is none."""
    matches = _NUMBER.findall(text)
    return _to_float(matches[-1]) if matches else None


def _label_number(label: Any) -> float:
    if isinstance(label, numbers.Real) and not isinstance(label, bool):
        return float(label)
    value = parse_number(str(label))
    if value is None:
        raise ValueError(f"label {label!r} is not a number")
    return value


def parse_number(text: str) -> float | None:
    """``text`` (whole string, stripped) as a number: "12", "-1,000.5", "3/4", "(1)/(2)"; else None."""
    s = text.strip().rstrip(".").strip()
    while len(s) >= 2 and s[0] == "(" and s[-1] == ")" and s.count("(") == 1:  # "(3)" -> "3", not "(1)/(2)"
        s = s[1:-1].strip()
    value = _to_float(s)
    if value is not None:
        return value
    m = _FRACTION.match(s.replace(" ", ""))
    if m:
        num, den = _to_float(m.group(2)), _to_float(m.group(3))
        if num is not None and den:
            return -num / den if m.group(1) == "-" else num / den
    return None


def numeric_match(inp: RewardInput, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the last number in the response is ``math.isclose`` to the label (a number or numeric string).

    The label must parse as a number ("8", "0.5", "3/4", 8); a label that does not is a data error and raises.
    """
    ref = _label_number(inp.label)
    pred = parse_last_number(inp.response)
    return 1.0 if pred is not None and math.isclose(pred, ref, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; None when there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):  # the last complete one wins; an unclosed last box falls back to earlier ones
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def _replace_frac(s: str) -> str:
    """``\\frac{a}{b}`` -> ``(a)/(b)`` with balanced braces; ``\\frac12`` -> ``(1)/(2)``."""

    def group(i: int) -> tuple[str, int] | None:  # one braced group or a single character at s[i]
        if i >= len(s):
            return None
        if s[i] != "{":
            return s[i], i + 1
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1 : j], j + 1
        return None

    while (k := s.find("\\frac")) != -1:
        a = group(k + 5)
        b = group(a[1]) if a else None
        if a is None or b is None:
            break
        s = f"{s[:k]}({_replace_frac(a[0])})/({_replace_frac(b[0])}){s[b[1] :]}"
    return s


def normalize_math(text: str) -> str:
    """Canonical string form of a simple LaTeX answer (see :func:`boxed_math` for what is normalised)."""
    s = text.strip().strip("$")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left|\\right", "", s)
    s = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\^\{?\\circ\}?|\\%|%|\\[,;:! ]", "", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[A-Za-z]\w*=", "", s)  # "x=5" -> "5"
    s = s.rstrip(".")
    s = _replace_frac(s)
    # Drop one pair of braces around the whole answer: "{5}" -> "5".
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    return s


def boxed_math(inp: RewardInput, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the last ``\\boxed{...}`` of the response matches the label; 0.0 when it differs or is absent.

    Both sides are normalised by :func:`normalize_math`: ``$``, spaces, a trailing ``.``, ``\\left``/``\\right``,
    ``\\!``/``\\,``, ``^\\circ``, ``%``, ``\\text{x}`` -> x, ``x=`` prefixes, ``\\dfrac``/``\\tfrac`` -> ``\\frac``,
    ``\\frac{a}{b}`` -> ``(a)/(b)``. They compare numerically (``math.isclose``) when both parse as numbers or
    simple fractions, else as strings. A label holding a ``\\boxed{}`` is unboxed first.
    """
    boxed = extract_boxed(inp.response)
    if boxed is None:
        return 0.0
    label = inp.label if not isinstance(inp.label, str) else (extract_boxed(inp.label) or inp.label)
    pred_s, ref_s = normalize_math(boxed), normalize_math(str(label))
    pred, ref = parse_number(pred_s), parse_number(ref_s)
    if pred is not None and ref is not None:
        return 1.0 if math.isclose(pred, ref, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0
    return 1.0 if pred_s == ref_s else 0.0
