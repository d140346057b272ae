"""engine/protocol.py and miles_hpc/auth.py without a server: SGLang request shapes, every 400, auth decisions."""

from __future__ import annotations

import base64
import itertools
from pathlib import Path

import numpy as np
import pytest

from miles_hpc.auth import ApiKeys, AuthLevel, decide, read_key
from miles_hpc.engine import protocol
from miles_hpc.engine.protocol import BadRequest, ModelLimits
from miles_hpc.engine.types import FinishReason, GenerateResult, SamplingParams
from miles_hpc.rollout import requests as client_bodies

LIMITS = ModelLimits(vocab_size=320, max_context_len=256)
_ids = itertools.count()


def parse(body: object) -> protocol.ParsedGenerate:
    return protocol.parse_generate(body, LIMITS, lambda: f"auto-{next(_ids)}")


def test_single_prompt_defaults_follow_sglang() -> None:
    p = protocol.parse_generate(
        {"input_ids": [1, 2, 3]}, ModelLimits(vocab_size=320, max_context_len=4096), lambda: "auto"
    )
    assert not p.batched and len(p.requests) == 1
    req = p.requests[0]
    assert req.input_ids == (1, 2, 3) and req.rid == "auto"
    sp = req.sampling
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.ignore_eos) == (
        128,
        1.0,
        1.0,
        -1,
        0.0,
        False,
    )
    assert not req.return_logprob and req.logprob_start_len == -1 and not req.return_routed_experts


def test_what_our_rollout_client_sends_is_accepted() -> None:
    # The client builds bodies from requests.py; whatever it can send, the engine must take.
    body = client_bodies.generate_body(
        [5, 6, 7],
        {
            "max_new_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "stop_token_ids": [258],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "sampling_seed": 3,
            "no_stop_trim": False,
            "spaces_between_special_tokens": True,
        },
        rid="r1",
        return_logprob=True,
        logprob_start_len=0,
        return_routed_experts=True,
        routed_experts_start_len=1,
        return_indexer_topk=True,  # our extension (requests.EXTENSION_FIELDS)
        indexer_topk_start_len=2,
    )
    req = parse(body).requests[0]
    assert req.rid == "r1" and req.sampling.stop_token_ids == (258,) and req.sampling.sampling_seed == 3
    assert req.return_logprob and req.logprob_start_len == 0 and req.routed_experts_start_len == 1
    assert req.return_indexer_topk and req.indexer_topk_start_len == 2
    assert set(body) - set(protocol.GENERATE_FIELDS) == set()
    for mode in ("abort", "retract", "in_place"):
        assert protocol.parse_control("pause_generation", client_bodies.pause_body(mode))["mode"] == mode
    assert protocol.parse_control("abort_request", client_bodies.abort_body("r1"))["rid"] == "r1"
    assert protocol.parse_control("abort_request", client_bodies.abort_body(abort_all=True))["abort_all"]
    assert protocol.parse_control("continue_generation", client_bodies.continue_body()) is not None
    v = protocol.parse_control("update_weight_version", client_bodies.update_weight_version_body("7"))
    assert v == {"rid": None, "new_version": "7", "abort_all_requests": False}
    protocol.parse_control("weights_checker", client_bodies.weights_checker_body())
    init = protocol.parse_control(
        "init_weights_update_group", client_bodies.init_weights_update_group_body("h", 1234, 1, 2, backend="gloo")
    )
    assert init["backend"] == "gloo" and init["group_name"] == "weight_update_group"
    upd = client_bodies.update_weights_from_distributed_body(
        ["a", "b"], ["torch.bfloat16", "float32"], [[2, 3], []], weight_version="5", flush_cache=True
    )
    assert protocol.parse_control("update_weights_from_distributed", upd)["dtypes"] == ["bfloat16", "float32"]
    disk = client_bodies.update_weights_from_disk_body("/m", weight_version="2")
    assert protocol.parse_control("update_weights_from_disk", disk)["weight_version"] == "2"
    protocol.parse_control("destroy_weights_update_group", client_bodies.destroy_weights_update_group_body())


def test_batched_prompts_and_per_item_values() -> None:
    p = parse(
        {
            "input_ids": [[1, 2], [3, 4, 5]],
            "rid": ["a", "b"],
            "return_logprob": [True, False],
            "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "skip_special_tokens": False}],
        }
    )
    assert p.batched and [r.rid for r in p.requests] == ["a", "b"]
    assert [r.return_logprob for r in p.requests] == [True, False]
    assert [r.sampling.max_new_tokens for r in p.requests] == [2, 3]
    assert [t.skip_special_tokens for t in p.text] == [True, False]
    shared = parse({"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True})
    assert [r.sampling.max_new_tokens for r in shared.requests] == [5, 5] and len({r.rid for r in shared.requests}) == 2


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "unknown field `sampling_params.temprature`"),
        ({"text": "hello"}, "text input is not supported"),
        ({"input_ids": [1], "text": "hello"}, "text input is not supported"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({}, "missing required field `input_ids`"),
        ({"input_ids": "1 2"}, "field `input_ids`"),
        ({"input_ids": []}, "must not be empty"),
        ({"input_ids": [1, True]}, "input_ids[1]"),
        ({"input_ids": [1, 320]}, "input_ids[1]` = 320 is not a token id"),
        ({"input_ids": [-1]}, "input_ids[0]"),
        ({"input_ids": [[1], [2, 999]]}, "input_ids[1][1]"),
        ({"input_ids": [1] * 256}, "longer than the model's context length (256 tokens)"),
        ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 250}}, "exceeds the model's maximum context"),
        # exactly the context: SGLang's tokenizer manager refuses it too (input + max_new_tokens >= context_len)
        ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 246}}, "a total of 256 tokens"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
        ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, "stop_token_ids"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids[0]"),
        ({"input_ids": [1], "return_logprob": "yes"}, "field `return_logprob`"),
        ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ({"input_ids": [1], "rid": 7}, "field `rid`"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "distinct"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "1 values for 2 prompts"),
        ({"input_ids": [1], "sampling_params": [{}]}, "only allowed with batched"),
        ({"input_ids": [1], "lora_path": 3}, "field `lora_path`"),  # a loaded adapter's name (engine/lora.py)
        ({"input_ids": [[1], [2]], "lora_path": ["a"]}, "1 values for 2 prompts"),
        ({"input_ids": [1], "routed_experts_start_len": 2}, "routed_experts_start_len"),
        ({"input_ids": [1], "indexer_topk_start_len": 2}, "indexer_topk_start_len"),
        ({"input_ids": [1], "return_indexer_topk": 1}, "field `return_indexer_topk`"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_generate_requests_name_the_field(body: object, needle: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert needle in str(e.value)


def test_null_means_default() -> None:
    req = parse(
        {
            "input_ids": [1],
            "rid": None,
            "sampling_params": {"temperature": None, "max_new_tokens": 5},
            "return_logprob": None,
            "text": None,
            "stream": None,
        }
    ).requests[0]
    assert req.sampling.temperature == 1.0 and not req.return_logprob and req.rid.startswith("auto-")


@pytest.mark.parametrize(
    "endpoint, body, needle",
    [
        ("weights_piece_checksums", {"names": [], "boxes": [], "extra": 1}, "unknown field `extra`"),  # ours: strict
        ("pause_generation", {"mode": "later"}, "field `mode`"),
        ("update_weight_version", {}, "missing required field `new_version`"),
        ("update_weight_version", {"new_version": 3}, "field `new_version`"),
        ("weights_checker", {"action": "compare"}, "field `action`"),
        (
            "init_weights_update_group",
            {"master_address": "h", "master_port": "1", "rank_offset": 1, "world_size": 2},
            "field `master_port`",
        ),
        (
            "init_weights_update_group",
            {"master_address": "h", "master_port": 1, "rank_offset": 2, "world_size": 2},
            "rank_offset",
        ),
        (
            "update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32", "float32"], "shapes": [[1]]},
            "differ in length",
        ),
        ("update_weights_from_distributed", {"names": ["a"], "dtypes": ["complex32"], "shapes": [[1]]}, "dtypes[0]"),
        ("update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes[0][0]"),
        ("update_weights_from_disk", {"model_path": "/m", "load_format": "gguf"}, "load_format"),
        (
            "update_weights_from_tensor",
            {"serialized_named_tensors": [b"x".hex()], "load_format": "direct"},
            "load_format",
        ),
        ("flush_cache", {"timeout_s": -1}, "timeout_s"),
        ("destroy_weights_update_group", ["weight_update_group"], "expected a JSON object"),
    ],
)
def test_bad_control_requests_name_the_field(endpoint: str, body: object, needle: str) -> None:
    with pytest.raises(BadRequest) as e:
        protocol.parse_control(endpoint, body)
    assert needle in str(e.value)


def test_generate_response_shape() -> None:
    req = parse(
        {
            "input_ids": [7, 8, 9],
            "return_logprob": True,
            "logprob_start_len": 1,
            "rid": "x",
            "return_routed_experts": True,
            "return_indexer_topk": True,
        }
    ).requests[0]
    routed = np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3)
    picks = np.arange(4 * 2 * 5, dtype=np.int32).reshape(4, 2, 5) % 4 - 1
    res = GenerateResult(
        rid="x",
        output_ids=[4, 5],
        finish_reason=FinishReason(type="stop", matched=5),
        prompt_tokens=3,
        cached_tokens=0,
        output_logprobs=[-0.5, -1.5],
        input_logprobs=[None, -3.0],
        routed_experts=routed,
        indexer_topk=picks,
        weight_versions=[{"version": "3", "start": 0, "end": 2}],
        weight_version="3",
    )
    out = protocol.generate_response(req, res, "hi")
    assert out["text"] == "hi" and out["output_ids"] == [4, 5]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 5}
    assert meta["output_token_logprobs"] == [[-0.5, 4, None], [-1.5, 5, None]]
    assert meta["output_token_logprobs_length"] == 2 and meta["reasoning_tokens"] == 0
    assert meta["input_token_logprobs"] == [[None, 8, None], [-3.0, 9, None]]
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (3, 2, "3")
    decoded = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(4, 2, 3)
    assert (decoded == routed).all()
    assert (np.frombuffer(base64.b64decode(meta["indexer_topk"]), dtype=np.int32).reshape(4, 2, 5) == picks).all()
    plain = parse({"input_ids": [1]}).requests[0]
    meta = protocol.generate_response(plain, res, None)["meta_info"]
    assert "output_token_logprobs" not in meta and "routed_experts" not in meta


# ---------------------------------------------------------------------------------------------- SGLang 0.5.23 conformance
# Each rule below was found by probing our server against SGLang's own FastAPI app (its io_struct normalization,
# JSON contract gate, tokenizer manager and scheduler rules); docs/engine.md, HTTP API.


def test_unknown_top_level_keys_are_ignored_and_reported_as_sglang_ignores_them() -> None:
    seen: list[str] = []
    req = protocol.parse_generate(
        {"input_ids": [1, 2], "foo": 1, "session_idd": None, "custom_labels": {"a": "b"}, "data_parallel_rank": 0},
        LIMITS,
        lambda: "auto",
        seen.append,
    ).requests[0]
    assert req.input_ids == (1, 2) and seen == ["foo", "session_idd", "custom_labels", "data_parallel_rank"]
    assert parse({"input_ids": [1], "bogus": 1}).requests[0].input_ids == (1,)  # quietly by default
    for endpoint, body in [
        ("abort_request", {"rid": "a", "extra": 1}),
        ("pause_generation", {"mode": "in_place", "http_worker_ipc": "x"}),
        ("update_weights_from_disk", {"model_path": "/m", "foo": True}),
        (
            "init_weights_update_group",
            {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "x": 0},
        ),
    ]:
        seen.clear()
        protocol.parse_control(endpoint, body, seen.append)
        assert len(seen) == 1 and seen[0] in body, endpoint
    # sampling_params keys outside SGLang's are still a 400 (its JSON contract refuses them), and our own
    # endpoints stay strict
    with pytest.raises(BadRequest, match="unknown field `sampling_params.temprature`"):
        protocol.parse_generate({"input_ids": [1], "sampling_params": {"temprature": 1}}, LIMITS, str, seen.append)
    with pytest.raises(BadRequest, match="unknown field `flush`"):
        protocol.parse_control("update_weights_from_delta", {"manifest_path": "/d", "flush": True}, seen.append)


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1], "return_prompt_token_ids": True},
        {"input_ids": [1], "return_entropy": True},
        {"input_ids": [1], "session_id": "s"},
        {"input_ids": [1], "max_thinking_tokens": 8},
        {"input_ids": [1], "require_reasoning": True},
        {"input_ids": [1], "return_sampling_mask": True},
        {"input_ids": [1], "watermark": {"enabled": True}},
        {"input_ids": [1], "stream": True},
        {"input_ids": [1], "text": "hi"},
        {"input_ids": [1], "sampling_params": {"n": 2}},
        {"input_ids": [1], "sampling_params": {"json_schema": "{}"}},
        {"input_ids": [1], "sampling_params": {"regex": "a+"}},
        {"input_ids": [1], "sampling_params": {"beam_width": 2}},
        {"input_ids": [1], "sampling_params": {"watermark": {"enabled": True}}},
    ],
)
def test_sglang_fields_that_would_change_the_answer_are_refused_by_name(body: dict) -> None:
    name = next(k for k in (*body, *body.get("sampling_params", {})) if k not in ("input_ids", "sampling_params"))
    with pytest.raises(BadRequest, match=f"`(sampling_params.)?{name}`.*not supported"):
        parse(body)


def test_sglang_fields_without_effect_here_are_accepted() -> None:
    body = {
        "input_ids": [1],
        "return_prompt_token_ids": False,
        "session_id": None,
        "sampling_params": {"stream_interval": 4, "beam_width": None, "no_stop_trim": True},
    }
    req = parse(body).requests[0]
    assert req.sampling.max_new_tokens == 128
    assert parse({"input_ids": [1], "log_metrics": False}).requests[0].log_metrics is False


def test_a_batch_with_one_string_rid_numbers_it_as_sglang_does() -> None:
    p = parse({"input_ids": [[1], [2], [3]], "rid": "grp"})
    assert [r.rid for r in p.requests] == ["grp_0", "grp_1", "grp_2"]
    assert parse({"input_ids": [[1]], "rid": "one"}).requests[0].rid == "one_0"
    assert parse({"input_ids": [1], "rid": "single"}).requests[0].rid == "single"


def test_logprob_start_len_may_be_the_prompt_length() -> None:
    req = parse({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3}).requests[0]
    assert req.logprob_start_len == 3
    with pytest.raises(BadRequest, match="logprob_start_len"):
        parse({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4})


@pytest.mark.parametrize(
    "prompt_len, sampling, kv, expected",
    [
        (2000, None, None, 128),  # absent: SGLang's default 128 ...
        (200, {}, None, 54),  # ... cut to min(context, kv) - prompt - 2 = 256 - 200 - 2, never a 400
        (250, {}, None, 4),
        (254, {}, None, 0),
        (255, {}, None, 0),
        (100, {"max_new_tokens": None}, None, 154),  # null: as much as the context holds
        (10, {"max_new_tokens": None}, None, 244),
        (200, {"max_new_tokens": 55}, None, 54),  # an explicit one that fits the context is cut the same way
        (200, {"max_new_tokens": 20}, None, 20),
        (100, {"max_new_tokens": 100}, 150, 48),  # the KV cache binds: 150 - 100 - 2
        (100, {"max_new_tokens": None, "min_new_tokens": 200}, None, 154),
        (250, {"max_new_tokens": 5, "min_new_tokens": 5}, None, 4),  # min_new_tokens follows
    ],
)
def test_max_new_tokens_is_cut_to_the_context_as_sglang_cuts_it(
    prompt_len: int, sampling: dict | None, kv: int | None, expected: int
) -> None:
    limits = ModelLimits(vocab_size=320, max_context_len=256 if prompt_len < 256 else 4096, kv_capacity_tokens=kv)
    body = {"input_ids": [1] * prompt_len, **({} if sampling is None else {"sampling_params": sampling})}
    sp = protocol.parse_generate(body, limits, str).requests[0].sampling
    assert sp.max_new_tokens == expected and sp.min_new_tokens <= expected


def test_finish_reasons_have_sglang_shapes() -> None:
    assert FinishReason(type="length", length=7).to_json() == {"type": "length", "length": 7}
    assert FinishReason(type="stop", matched=3).to_json() == {"type": "stop", "matched": 3}
    abort = FinishReason(type="abort", message="aborted by request").to_json()
    assert abort == {"type": "abort", "message": "aborted by request", "status_code": None, "err_type": None}


def test_meta_info_keys_with_logprobs_and_no_prompt_logprobs() -> None:
    req = parse({"input_ids": [7, 8, 9], "return_logprob": True}).requests[0]
    res = GenerateResult(
        rid="x",
        output_ids=[4],
        finish_reason=FinishReason(type="length", length=1),
        prompt_tokens=3,
        cached_tokens=0,
        output_logprobs=[-0.5],
    )
    meta = protocol.generate_response(req, res, None)["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 1
    assert meta["finish_reason"] == {"type": "length", "length": 1} and meta["reasoning_tokens"] == 0
    at_end = parse({"input_ids": [7, 8, 9], "return_logprob": True, "logprob_start_len": 3}).requests[0]
    assert protocol.generate_response(at_end, res, None)["meta_info"]["input_token_logprobs"] == []


def test_text_leaves_out_the_matched_stop_token_unless_no_stop_trim() -> None:
    stop = GenerateResult(
        rid="x", output_ids=[4, 5, 9], finish_reason=FinishReason(type="stop", matched=9), prompt_tokens=1,
        cached_tokens=0,
    )  # fmt: skip
    assert protocol.text_ids(stop, protocol.TextOptions()) == [4, 5]
    assert protocol.text_ids(stop, protocol.TextOptions(no_stop_trim=True)) == [4, 5, 9]
    length = GenerateResult(
        rid="y", output_ids=[4, 9], finish_reason=FinishReason(type="length", length=2), prompt_tokens=1,
        cached_tokens=0,
    )  # fmt: skip
    assert protocol.text_ids(length, protocol.TextOptions()) == [4, 9]  # only a matched stop is trimmed
    options = parse({"input_ids": [1], "sampling_params": {"no_stop_trim": True, "skip_special_tokens": False}}).text
    assert options == [protocol.TextOptions(skip_special_tokens=False, no_stop_trim=True)]


# ---------------------------------------------------------------------------------------------- auth
KEY, ADMIN = "k-plain", "k-admin"


@pytest.mark.parametrize(
    "keys, level, header, expected",
    [
        (ApiKeys(), AuthLevel.NORMAL, None, None),
        (ApiKeys(), AuthLevel.ADMIN, None, None),
        (ApiKeys(api_key=KEY), AuthLevel.OPEN, None, None),
        (ApiKeys(api_key=KEY), AuthLevel.NORMAL, None, 401),
        (ApiKeys(api_key=KEY), AuthLevel.NORMAL, f"Bearer {KEY}", None),
        (ApiKeys(api_key=KEY), AuthLevel.NORMAL, f"bearer {KEY}", None),
        (ApiKeys(api_key=KEY), AuthLevel.NORMAL, f"Bearer {KEY}x", 401),
        (ApiKeys(api_key=KEY), AuthLevel.NORMAL, KEY, 401),
        (ApiKeys(api_key=KEY), AuthLevel.NORMAL, "Basic abc", 401),
        (ApiKeys(api_key=KEY), AuthLevel.ADMIN, f"Bearer {KEY}", None),  # no admin key: the plain key suffices
        (ApiKeys(api_key=KEY, admin_api_key=ADMIN), AuthLevel.ADMIN, f"Bearer {KEY}", 401),
        (ApiKeys(api_key=KEY, admin_api_key=ADMIN), AuthLevel.ADMIN, f"Bearer {ADMIN}", None),
        (ApiKeys(api_key=KEY, admin_api_key=ADMIN), AuthLevel.NORMAL, f"Bearer {ADMIN}", 401),  # as SGLang
        (ApiKeys(admin_api_key=ADMIN), AuthLevel.NORMAL, None, None),
        (ApiKeys(admin_api_key=ADMIN), AuthLevel.ADMIN, None, 401),
        (ApiKeys(api_key="ключ"), AuthLevel.NORMAL, "Bearer ключ", None),
    ],
)
def test_auth_decisions_follow_sglang(
    keys: ApiKeys, level: AuthLevel, header: str | None, expected: int | None
) -> None:
    assert decide(level, header, keys) == expected


def test_keys_never_print() -> None:
    assert KEY not in repr(ApiKeys(api_key=KEY, admin_api_key=ADMIN)) and ADMIN not in str(ApiKeys(api_key=ADMIN))


def test_read_key(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("secret-1\n")
    f.chmod(0o600)
    assert read_key(None, str(f), "api-key") == "secret-1"
    assert read_key("inline", None, "api-key") == "inline" and read_key(None, None, "api-key") is None
    with pytest.raises(ValueError, match="not both"):
        read_key("x", str(f), "api-key")
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_key(None, str(f), "api-key")
    with pytest.raises(FileNotFoundError):
        read_key(None, str(tmp_path / "missing"), "api-key")


@pytest.mark.parametrize("temperature,expected", [(1e-42, 0.0), (1e-39, 0.0), (9.9e-7, 0.0), (1e-6, 1e-6), (0.7, 0.7)])
def test_a_temperature_below_sglangs_epsilon_is_greedy(temperature: float, expected: float) -> None:
    """SGLang samples greedily below 1e-6; dividing float32 logits by a denormal temperature overflowed to inf and
    picked the first positive logit's token."""
    body = {"input_ids": [1, 2], "sampling_params": {"temperature": temperature}}
    assert protocol.parse_generate(body, LIMITS, str).requests[0].sampling.temperature == expected
    assert SamplingParams(temperature=temperature).temperature == expected  # in-process requests too
