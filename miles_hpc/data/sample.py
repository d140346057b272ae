"""The trajectory record (stage: data; docs/design.md section 7, a contract): one prompt + response, per-token facts.

A :class:`Sample` is what rollout produces, the buffer holds, the trainer consumes and the HDF5 store mirrors
1:1 (see :mod:`miles_hpc.data.store`). Invariants, checked by :meth:`Sample.validate` (run on construction and
again by the writer, because the record is mutable):

- ``tokens`` = prompt ids + response ids, ``0 <= prompt_len <= len(tokens)``. Zero tokens are allowed (a sample
  that failed before tokenisation); ``response_len == 0`` (prompt only) is the common aborted case.
- ``loss_mask``, ``rollout_logprobs``, ``policy_version`` have one entry per token. On prompt tokens they are
  0, 0.0 and -1: the prompt was not generated, so it carries no loss, no log-prob and no policy version.
  Response tokens that were not generated (tool output in a multi-turn sample) also have mask 0 and version -1.
- Token ids, versions and ``train_step`` fit int32 (the on-disk dtype); ids are >= 0, versions >= -1;
  ``reward`` is finite and fits float32; log-probs are not NaN.
- ``token_hash == token_hash(tokens)``: it is computed when left empty, and a mismatch is an error. It travels
  with the sample so the trainer can prove it trains on exactly the generated ids (TITO, docs/design.md section 4).
- ``routed_experts`` is ``None`` or an integer array ``[rows, layers, top_k]`` with ``1 <= rows <= len(tokens)``
  (SGLang returns ``len(tokens) - 1`` rows). A zero-row array carries no information and is normalised to
  ``None``, so "no routing" has one representation and the store round-trips it exactly.
- ``indexer_topk`` (indexer replay, DeepSeek Sparse Attention) is ``None`` or an integer array
  ``[rows, indexer_layers, index_topk]`` with ``1 <= rows <= len(tokens)``: row t holds, per indexer layer, the key
  positions (within this sample) that the query of token t attends to, each in ``[0, t]``, or -1 for padding (a
  query at t < index_topk - 1 has only t + 1 keys). Zero rows normalise to ``None``, as routing does.
- ``metadata`` is free-form *user* data that survives a JSON round trip unchanged (str keys, lists not tuples,
  no NaN); anything with a name of its own belongs in a field, not here (STYLE 7).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

__all__ = ["SCHEMA_VERSION", "Sample", "SampleError", "SampleStatus", "token_hash"]

# Bumped whenever a field is added, removed or changes meaning; the HDF5 store writes it as a file attribute.
SCHEMA_VERSION = 1

_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class SampleStatus(IntEnum):
    """How generation ended. Stored as uint8; values are part of the file format, never renumber them."""

    COMPLETED = 0  # stop token / EOS
    TRUNCATED = 1  # hit max_new_tokens or the context limit
    ABORTED = 2  # aborted by the controller (weight sync, over-sampling cut-off)
    FAILED = 3  # the engine, agent or reward function errored


class SampleError(ValueError):
    """A :class:`Sample` breaks one of its invariants; the message starts with ``Sample.<field>``."""


def token_hash(tokens: Sequence[int] | np.ndarray) -> str:
    """Hex blake2b-128 of the ids as int32 little-endian bytes: 32 lowercase hex characters.

    Hashing the on-disk byte layout (not Python ints) makes the hash identical in the engine client, the HDF5
    file and the trainer, whatever integer type each side holds the ids in.
    """
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < -(2**31) or arr.max() > _INT32_MAX):
        raise SampleError("Sample.tokens: ids must fit int32 to be hashed")
    return hashlib.blake2b(arr.astype("<i4", copy=False).tobytes(), digest_size=16).hexdigest()


def _fail(name: str, msg: str) -> None:
    raise SampleError(f"Sample.{name}: {msg}")


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    # bool is an Integral but a True prompt_id is always a bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, f"must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        _fail(name, f"must be in [{lo}, {hi}], got {value}")
    return int(value)


def _per_token(name: str, values: Any, kinds: str) -> np.ndarray:
    """``values`` as a 1-D array whose dtype kind is in ``kinds`` (an empty list is fine whatever its dtype)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        _fail(name, f"must be a flat sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in kinds:
        _fail(name, f"must hold {'numbers' if 'f' in kinds else 'ints'}, got dtype {arr.dtype}")
    return arr


def _none_if_empty(values: Any) -> Any:
    """A per-row record as an ndarray, or None when it has no rows (one representation of "no record")."""
    if values is None:
        return None
    arr = np.asarray(values)
    return None if arr.ndim == 3 and arr.shape[0] == 0 else arr


def _check_rows(name: str, r: Any, n: int, dims: tuple[str, str], what: str) -> None:
    """``r`` is an integer ``[rows, dims...]`` array with 1..n rows and every other dimension >= 1."""
    if not isinstance(r, np.ndarray) or r.ndim != 3:
        _fail(name, f"must be a [rows, {dims[0]}, {dims[1]}] array, got {np.shape(r)}")
    if r.dtype.kind not in "iu":
        _fail(name, f"must hold integer {what}, got dtype {r.dtype}")
    if not 1 <= r.shape[0] <= n:
        _fail(name, f"has {r.shape[0]} rows, expected 1..{n} (one per token at most)")
    if r.shape[1] < 1 or r.shape[2] < 1:
        _fail(name, f"{dims[0]} and {dims[1]} must be >= 1, got shape {r.shape}")


def _same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


@dataclass(kw_only=True, slots=True, eq=False, repr=False)
class Sample:
    """One prompt + response with per-token facts; fields mirror the HDF5 datasets 1:1 (docs/design.md section 7)."""

    prompt_id: int
    group_id: int
    tokens: list[int]
    prompt_len: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    policy_version: list[int]
    reward: float = 0.0
    status: SampleStatus = SampleStatus.COMPLETED
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None
    token_hash: str = ""  # computed from tokens when empty (by validate)
    metadata: dict[str, Any] = field(default_factory=dict)
    train_step: int = -1  # the train step that consumed it; -1 = not trained on (yet)

    def __post_init__(self) -> None:
        # Normalise containers to plain Python lists / one ndarray so equality and the store see one type;
        # numpy inputs (from the engine client or the reader) are accepted and converted here.
        self.tokens = _per_token("tokens", self.tokens, "iu").tolist()
        self.loss_mask = _per_token("loss_mask", self.loss_mask, "iub").astype(np.int64).tolist()
        self.rollout_logprobs = _per_token("rollout_logprobs", self.rollout_logprobs, "fiu").astype(float).tolist()
        self.policy_version = _per_token("policy_version", self.policy_version, "iu").tolist()
        self.routed_experts = _none_if_empty(self.routed_experts)
        self.indexer_topk = _none_if_empty(self.indexer_topk)
        self.validate()

    def validate(self) -> None:
        """Check every invariant of the module docstring; raise :class:`SampleError` naming the field.

        Scalars are normalised on the way (``reward`` to float, ``status`` to :class:`SampleStatus`, numpy ints to
        int), so ``sample.reward = 1`` after construction is fine; an empty ``token_hash`` is computed.
        """
        self.prompt_id = _int("prompt_id", self.prompt_id, _INT64_MIN, _INT64_MAX)
        self.group_id = _int("group_id", self.group_id, _INT64_MIN, _INT64_MAX)
        self.train_step = _int("train_step", self.train_step, -1, _INT32_MAX)
        n = len(self.tokens)
        self.prompt_len = _int("prompt_len", self.prompt_len, 0, n)
        tokens = _per_token("tokens", self.tokens, "iu")
        if n and (tokens.min() < 0 or tokens.max() > _INT32_MAX):
            _fail("tokens", f"ids must be in [0, {_INT32_MAX}]")
        p = self.prompt_len
        for name in ("loss_mask", "rollout_logprobs", "policy_version"):
            if len(getattr(self, name)) != n:
                _fail(name, f"has {len(getattr(self, name))} entries but tokens has {n}")
        mask = _per_token("loss_mask", self.loss_mask, "iub")
        if n and not np.isin(mask, (0, 1)).all():
            _fail("loss_mask", "must hold only 0 and 1")
        if mask[:p].any():
            _fail("loss_mask", "must be 0 on prompt tokens (the prompt is not trained on)")
        logprobs = _per_token("rollout_logprobs", self.rollout_logprobs, "fiu")
        if np.isnan(logprobs).any():
            _fail("rollout_logprobs", "must not hold NaN")
        if logprobs[:p].any():
            _fail("rollout_logprobs", "must be 0.0 on prompt tokens")
        versions = _per_token("policy_version", self.policy_version, "iu")
        if n and (versions.min() < -1 or versions.max() > _INT32_MAX):
            _fail("policy_version", f"must be in [-1, {_INT32_MAX}]")
        if (versions[:p] != -1).any():
            _fail("policy_version", "must be -1 on prompt tokens")
        if isinstance(self.reward, bool) or not isinstance(self.reward, numbers.Real):
            _fail("reward", f"must be a finite float, got {self.reward!r}")
        self.reward = float(self.reward)  # np.float32 / int -> float, so equality and repr see one type
        if not math.isfinite(self.reward) or abs(self.reward) > _FLOAT32_MAX:
            _fail("reward", f"must be a finite float that fits float32 (the on-disk dtype), got {self.reward!r}")
        try:
            if isinstance(self.status, bool):
                raise ValueError
            self.status = SampleStatus(self.status)
        except ValueError:
            _fail("status", f"must be one of {[s.name for s in SampleStatus]}, got {self.status!r}")
        self._validate_routing(n)
        self._validate_indexer(n)
        if not self.token_hash:  # left empty: computed here, after the ids are known to fit int32
            self.token_hash = token_hash(tokens)
        elif self.token_hash != token_hash(tokens):
            _fail("token_hash", "does not match tokens (the ids changed after the hash was taken)")
        self._validate_metadata()

    def _validate_routing(self, n: int) -> None:
        r = self.routed_experts
        if r is None:
            return
        _check_rows("routed_experts", r, n, ("layers", "top_k"), "expert ids")
        if r.min() < 0:
            _fail("routed_experts", "expert ids must be >= 0")

    def _validate_indexer(self, n: int) -> None:
        r = self.indexer_topk
        if r is None:
            return
        _check_rows("indexer_topk", r, n, ("indexer_layers", "index_topk"), "key positions")
        if r.min() < -1:
            _fail("indexer_topk", f"key positions must be >= -1 (-1 = padding), got {int(r.min())}")
        # Row t is the query of token t: it may only see keys 0..t. A per-row max, not an array as big as r.
        row_max = r.reshape(r.shape[0], -1).max(axis=1)
        late = np.flatnonzero(row_max > np.arange(r.shape[0]))
        if late.size:
            t = int(late[0])
            _fail("indexer_topk", f"row {t} holds key position {int(row_max[t])}, beyond the query's own position {t}")

    def _validate_metadata(self) -> None:
        if not isinstance(self.metadata, dict):
            _fail("metadata", f"must be a dict, got {type(self.metadata).__name__}")
        try:
            # allow_nan=False: NaN is not JSON and NaN != NaN would break the round-trip check below.
            back = json.loads(json.dumps(self.metadata, allow_nan=False))
        except (TypeError, ValueError) as e:
            _fail("metadata", f"must be JSON-serialisable: {e}")
        if back != self.metadata:
            _fail("metadata", "must survive a JSON round trip unchanged (use str keys and lists, not tuples)")

    # -- derived views ------------------------------------------------------------------------------------------

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def has_routing(self) -> bool:
        return self.routed_experts is not None

    @property
    def has_indexer(self) -> bool:
        return self.indexer_topk is not None

    def hash_ok(self) -> bool:
        """Whether ``token_hash`` still matches ``tokens`` (the trainer's TITO check)."""
        return self.token_hash == token_hash(self.tokens)

    # -- equality and repr: exact on every field; arrays compared by value, not identity ------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        same_arrays = _same_array(self.routed_experts, other.routed_experts) and _same_array(
            self.indexer_topk, other.indexer_topk
        )
        return same_arrays and all(
            getattr(self, f) == getattr(other, f)
            for f in (
                "prompt_id",
                "group_id",
                "tokens",
                "prompt_len",
                "loss_mask",
                "rollout_logprobs",
                "policy_version",
                "reward",
                "status",
                "token_hash",
                "metadata",
                "train_step",
            )
        )

    __hash__ = None  # type: ignore[assignment]  # mutable record

    def __repr__(self) -> str:
        # Token lists can be 100k long: print their shape, not their contents.
        routing = None if self.routed_experts is None else tuple(self.routed_experts.shape)
        indexer = None if self.indexer_topk is None else tuple(self.indexer_topk.shape)
        return (
            f"Sample(prompt_id={self.prompt_id}, group_id={self.group_id}, prompt_len={self.prompt_len}, "
            f"response_len={self.response_len}, status={self.status.name}, reward={self.reward!r}, "
            f"train_step={self.train_step}, routed_experts={routing}, indexer_topk={indexer}, "
            f"token_hash={self.token_hash!r})"
        )
