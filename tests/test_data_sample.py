"""The Sample record (docs/design.md section 7): construction, normalisation, invariants with errors naming the field."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest

from miles_hpc.data import SCHEMA_VERSION, Sample, SampleError, SampleStatus, token_hash


def make(**over: Any) -> Sample:
    """3 prompt tokens + 2 generated tokens, with routing for len(tokens) - 1 positions."""
    fields: dict[str, Any] = dict(
        prompt_id=7,
        group_id=3,
        tokens=[10, 11, 12, 13, 14],
        prompt_len=3,
        loss_mask=[0, 0, 0, 1, 1],
        rollout_logprobs=[0.0, 0.0, 0.0, -0.5, -1.25],
        policy_version=[-1, -1, -1, 4, 5],
        reward=1.0,
        status=SampleStatus.COMPLETED,
        routed_experts=np.arange(4 * 2 * 2).reshape(4, 2, 2) % 8,
        metadata={"task": "gsm8k", "tags": [1, 2]},
    )
    fields.update(over)
    return Sample(**fields)


def test_fields_and_derived_views() -> None:
    s = make()
    assert SCHEMA_VERSION == 1
    assert s.response_len == 2 and s.response_tokens == [13, 14] and s.prompt_tokens == [10, 11, 12]
    assert s.num_loss_tokens == 2 and s.has_routing and s.train_step == -1
    assert s.token_hash == token_hash([10, 11, 12, 13, 14]) and s.hash_ok()
    assert [st.value for st in SampleStatus] == [0, 1, 2, 3]
    assert [st.name for st in SampleStatus] == ["COMPLETED", "TRUNCATED", "ABORTED", "FAILED"]
    # The repr stays short whatever the length of the sample.
    assert "response_len=2" in repr(s) and len(repr(make(tokens=[1] * 5))) < 300


def test_token_hash_is_blake2b128_of_int32_le() -> None:
    ids = [0, 1, 255, 2**31 - 1]
    want = hashlib.blake2b(np.array(ids, dtype="<i4").tobytes(), digest_size=16).hexdigest()
    assert token_hash(ids) == want and len(want) == 32
    # The same ids held in any integer type hash the same (engine client, file and trainer agree).
    assert token_hash(np.array(ids, dtype=np.int64)) == want == token_hash(tuple(ids))
    assert token_hash([]) == hashlib.blake2b(b"", digest_size=16).hexdigest()


def test_numpy_inputs_are_normalised_to_lists() -> None:
    s = make(
        tokens=np.array([10, 11, 12, 13, 14], dtype=np.int32),
        loss_mask=np.array([0, 0, 0, 1, 1], dtype=np.uint8),
        rollout_logprobs=np.array([0, 0, 0, -0.5, -1.25], dtype=np.float32),
        policy_version=np.array([-1, -1, -1, 4, 5]),
        status=1,
        reward=np.float32(2.0),
        prompt_id=np.int64(7),
    )
    assert type(s.tokens) is list and all(type(t) is int for t in s.tokens)
    assert type(s.rollout_logprobs[3]) is float and type(s.loss_mask[4]) is int
    assert s.status is SampleStatus.TRUNCATED and type(s.reward) is float and type(s.prompt_id) is int
    assert s == make(status=SampleStatus.TRUNCATED, reward=2.0)


def test_prompt_only_and_empty_samples_are_allowed() -> None:
    s = make(
        tokens=[1, 2],
        prompt_len=2,
        loss_mask=[0, 0],
        rollout_logprobs=[0, 0],
        policy_version=[-1, -1],
        routed_experts=np.zeros((1, 2, 2), dtype=np.int64),
        status=SampleStatus.ABORTED,
    )
    assert s.response_len == 0 and s.response_tokens == []
    empty = make(
        tokens=[],
        prompt_len=0,
        loss_mask=[],
        rollout_logprobs=[],
        policy_version=[],
        routed_experts=None,
        status=SampleStatus.FAILED,
    )
    assert empty.response_len == 0 and empty.token_hash == token_hash([])


def test_zero_row_routing_is_normalised_to_none() -> None:
    # SGLang returns len(tokens) - 1 rows: zero for a one-token sample; that carries no information.
    s = make(
        tokens=[5],
        prompt_len=1,
        loss_mask=[0],
        rollout_logprobs=[0.0],
        policy_version=[-1],
        routed_experts=np.zeros((0, 3, 2), dtype=np.int32),
    )
    assert s.routed_experts is None and not s.has_routing


def test_equality_is_exact_and_compares_arrays_by_value() -> None:
    a, b = make(), make()
    assert a == b and a is not b
    assert make(routed_experts=a.routed_experts.astype(np.uint8)) == a  # dtype is storage, values are identity
    assert make(routed_experts=None) != a
    assert make(reward=1.5) != a and make(metadata={}) != a and make(train_step=0) != a
    with pytest.raises(TypeError):
        hash(a)


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        (dict(loss_mask=[0, 0, 0, 1]), "loss_mask", "4 entries but tokens has 5"),
        (dict(rollout_logprobs=[0.0] * 6), "rollout_logprobs", "6 entries"),
        (dict(policy_version=[-1]), "policy_version", "1 entries"),
        (dict(prompt_len=6), "prompt_len", "[0, 5]"),
        (dict(prompt_len=-1), "prompt_len", "[0, 5]"),
        (dict(prompt_len=True), "prompt_len", "must be an int"),
        (dict(prompt_id=1.5), "prompt_id", "must be an int"),
        (dict(tokens=[10, 11, 12, 13, -1]), "tokens", "ids must be in"),
        (dict(tokens=[10, 11, 12, 13, 2**31]), "tokens", "ids must be in"),
        (dict(tokens=[10.0, 11, 12, 13, 14]), "tokens", "ints"),
        (dict(loss_mask=[0, 0, 0, 1, 2]), "loss_mask", "only 0 and 1"),
        (dict(loss_mask=[1, 0, 0, 1, 1]), "loss_mask", "prompt tokens"),
        (dict(rollout_logprobs=[0.0, -0.1, 0.0, -0.5, -1.0]), "rollout_logprobs", "prompt tokens"),
        (dict(rollout_logprobs=[0.0, 0.0, 0.0, float("nan"), -1.0]), "rollout_logprobs", "NaN"),
        (dict(policy_version=[-1, 0, -1, 4, 5]), "policy_version", "prompt tokens"),
        (dict(policy_version=[-1, -1, -1, -2, 5]), "policy_version", "[-1,"),
        (dict(reward=float("nan")), "reward", "finite"),
        (dict(reward=1e39), "reward", "float32"),
        (dict(reward="1.0"), "reward", "finite float"),
        (dict(status=9), "status", "COMPLETED"),
        (dict(train_step=-2), "train_step", "[-1,"),
        (dict(routed_experts=np.zeros((4, 2))), "routed_experts", "[rows, layers, top_k]"),
        (dict(routed_experts=np.zeros((4, 2, 2))), "routed_experts", "integer"),
        (dict(routed_experts=np.zeros((6, 2, 2), dtype=int)), "routed_experts", "6 rows"),
        (dict(routed_experts=np.zeros((4, 0, 2), dtype=int)), "routed_experts", ">= 1"),
        (dict(routed_experts=-np.ones((4, 2, 2), dtype=int)), "routed_experts", ">= 0"),
        (dict(token_hash="0" * 32), "token_hash", "does not match"),
        (dict(metadata=[1]), "metadata", "must be a dict"),
        (dict(metadata={"x": object()}), "metadata", "JSON-serialisable"),
        (dict(metadata={"x": float("nan")}), "metadata", "JSON-serialisable"),
        (dict(metadata={"x": (1, 2)}), "metadata", "round trip"),
        (dict(metadata={1: "a"}), "metadata", "round trip"),
    ],
)
def test_invalid_samples_name_the_field(over: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SampleError, match=r"^Sample\." + field + ":") as info:
        make(**over)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validate_catches_mutation_after_construction() -> None:
    s = make()
    s.tokens[-1] = 99  # the ids changed after generation: the hash proves it
    assert not s.hash_ok()
    with pytest.raises(SampleError, match="token_hash"):
        s.validate()
    s = make()
    s.loss_mask.append(1)
    with pytest.raises(SampleError, match="loss_mask"):
        s.validate()


def test_replace_recomputes_nothing_silently() -> None:
    s = make()
    # dataclasses.replace re-runs validation: the old hash no longer matches new tokens.
    with pytest.raises(SampleError, match="token_hash"):
        dataclasses.replace(s, tokens=[1, 2, 3, 4, 5])
    t = dataclasses.replace(s, tokens=[1, 2, 3, 4, 5], token_hash="")
    assert t.token_hash == token_hash([1, 2, 3, 4, 5]) and dataclasses.replace(s, reward=0.0).reward == 0.0
