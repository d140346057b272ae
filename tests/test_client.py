"""Rollout client, CPU tier: exact request bodies, response parsing, and error paths (closed port, stub server).

The stub aiohttp server here is for the client's error paths and wire format only; behaviour against a real engine
is tests/test_client_engine.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from miles_hpc.rollout import requests as rq
from miles_hpc.rollout.client import (
    EngineClient,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeoutError,
    EngineUnreachableError,
)
from miles_hpc.rollout.responses import (
    FinishReason,
    WeightVersionSpan,
    decode_routed_experts,
    metric_sum,
    parse_generate,
    parse_prometheus,
    parse_weights_checksums,
)

# ------------------------------------------------------------------------------------------- request bodies


def test_generate_body_minimal_and_full() -> None:
    assert rq.generate_body([1, 2, 3], {"max_new_tokens": 4}) == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4},
    }
    body = rq.generate_body(
        np.array([5, 6], dtype=np.int64),  # numpy ids become JSON ints
        {"max_new_tokens": 8, "temperature": 0.5, "top_p": None, "stop_token_ids": (np.int32(2),)},
        rid="r1",
        return_logprob=True,
        logprob_start_len=0,
        return_routed_experts=True,
        routed_experts_start_len=1,
    )
    assert body == {
        "rid": "r1",
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.5, "stop_token_ids": [2]},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_routed_experts": True,
        "routed_experts_start_len": 1,
    }
    assert all(type(x) is int for x in body["input_ids"] + body["sampling_params"]["stop_token_ids"])
    json.dumps(body)


def test_generate_body_never_sends_unset_or_unknown_fields() -> None:
    # logprob_start_len without return_logprob is meaningless: not sent.
    assert rq.generate_body([1], {}, logprob_start_len=0) == {"input_ids": [1], "sampling_params": {}}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['n', 'topp'\]"):
        rq.generate_body([1], {"topp": 0.9, "n": 2})
    with pytest.raises(ValueError, match="must not be empty"):
        rq.generate_body([], {})
    with pytest.raises(TypeError, match="integers"):
        rq.generate_body([1.5], {})
    with pytest.raises(ValueError, match="routed_experts_start_len"):
        rq.generate_body([1, 2], {}, return_routed_experts=True, routed_experts_start_len=3)
    # Indexer records (our engine's extension): the fields only when asked, the start checked like routing's.
    assert rq.generate_body([1, 2], {}, indexer_topk_start_len=1) == {"input_ids": [1, 2], "sampling_params": {}}
    body = rq.generate_body([1, 2], {}, return_indexer_topk=True, indexer_topk_start_len=1)
    assert set(body) - {"input_ids", "sampling_params"} == rq.EXTENSION_FIELDS
    with pytest.raises(ValueError, match="indexer_topk_start_len"):
        rq.generate_body([1, 2], {}, return_indexer_topk=True, indexer_topk_start_len=3)


def test_control_and_weight_bodies_are_exact() -> None:
    assert rq.abort_body("r") == {"rid": "r"}
    assert rq.abort_body(abort_all=True) == {"abort_all": True}
    with pytest.raises(ValueError):
        rq.abort_body("r", abort_all=True)
    assert rq.pause_body("in_place") == {"mode": "in_place"}
    with pytest.raises(ValueError, match="pause mode"):
        rq.pause_body("stop")  # type: ignore[arg-type]
    assert rq.continue_body() == {}
    assert rq.flush_cache_query() == {} and rq.flush_cache_query(2) == {"timeout": "2.0"}
    version = rq.update_weight_version_body(3)  # type: ignore[arg-type]
    assert version == {"new_version": "3", "abort_all_requests": False}
    assert rq.weights_checker_body() == {"action": "checksum"}
    assert rq.init_weights_update_group_body("h", 29500, 1, 3) == {
        "master_address": "h",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    assert rq.update_weights_from_distributed_body(["a", "b"], ["torch.bfloat16", "float32"], [(2, 3), [4]]) == {
        "names": ["a", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "group_name": "weight_update_group",
    }
    assert rq.update_weights_from_distributed_body(["a"], ["bfloat16"], [[1]], weight_version=4, flush_cache=False) == {
        "names": ["a"],
        "dtypes": ["bfloat16"],
        "shapes": [[1]],
        "group_name": "weight_update_group",
        "flush_cache": False,
        "weight_version": "4",
    }
    with pytest.raises(ValueError, match="lengths differ"):
        rq.update_weights_from_distributed_body(["a"], [], [[1]])
    assert rq.update_weights_from_disk_body("/ck", weight_version="2") == {"model_path": "/ck", "weight_version": "2"}
    assert rq.destroy_weights_update_group_body() == {"group_name": "weight_update_group"}


# ------------------------------------------------------------------------------------------- response parsing


def _answer(ids: list[int], prompt: int = 3, **meta: Any) -> dict[str, Any]:
    base = {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": ids[-1]},
        "prompt_tokens": prompt,
        "completion_tokens": len(ids),
        "cached_tokens": 1,
        "weight_version": "2",
    }
    return {"text": None, "output_ids": ids, "meta_info": {**base, **meta}}


def test_parse_generate_typed_output() -> None:
    routed = np.arange(3 * 2 * 4 * 2, dtype=np.int32).reshape(-1, 4, 2)  # prompt 3 + 3 out - 1 - start 1 = 4 rows
    obj = _answer(
        [7, 8, 2],
        output_token_logprobs=[[-0.5, 7, None], [-1.0, 8, None], [-0.25, 2, None]],
        input_token_logprobs=[[None, 1, None], [-2.0, 5, None]],
        weight_versions=[{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 3}],
        routed_experts=base64.b64encode(routed[:4].tobytes()).decode(),
    )
    out = parse_generate(
        obj, return_logprob=True, return_routed_experts=True, routed_experts_start_len=1, routing_dims=(None, 2)
    )
    assert out.output_ids == [7, 8, 2] and out.completion_tokens == 3 and out.cached_tokens == 1
    assert out.finish_reason == FinishReason(type="stop", matched=2)
    assert out.output_logprobs == [-0.5, -1.0, -0.25] and out.input_logprobs == [None, -2.0]
    assert out.weight_versions == (
        WeightVersionSpan(version="1", start=0, end=1),
        WeightVersionSpan(version="2", start=1, end=3),
    )
    assert out.token_versions() == ["1", "2", "2"]
    assert out.routed_experts is not None and out.routed_experts.shape == (4, 4, 2)
    np.testing.assert_array_equal(out.routed_experts, routed[:4])


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"output_token_logprobs": [[-0.5, 9, None], [-1.0, 8, None]]}, "is for token 9"),
        ({"output_token_logprobs": [[-0.5, 7, None]]}, "1 output_token_logprobs for 2"),
        ({"completion_tokens": 5}, "completion_tokens=5"),
        ({"weight_versions": [{"version": "1", "start": 0, "end": 1}]}, "end at 1"),
        ({"finish_reason": None}, "finish_reason"),
    ],
)
def test_parse_generate_rejects_broken_answers(meta: dict[str, Any], message: str) -> None:
    obj = _answer([7, 8])
    obj["meta_info"].update({"output_token_logprobs": [[-0.5, 7, None], [-1.0, 8, None]], **meta})
    with pytest.raises(ValueError, match=message):
        parse_generate(obj, return_logprob=True, return_routed_experts=False)


def test_parse_generate_decodes_indexer_records() -> None:
    picks = (np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3) % 5) - 1  # prompt 3 + 2 out - 1 = 4 rows
    obj = _answer([7, 8], indexer_topk=base64.b64encode(picks.tobytes()).decode())
    kw: dict[str, Any] = {"return_logprob": False, "return_routed_experts": False, "return_indexer_topk": True}
    out = parse_generate(obj, **kw, indexer_dims=(2, 3))
    assert out.indexer_topk is not None and out.indexer_topk.shape == (4, 2, 3)
    np.testing.assert_array_equal(out.indexer_topk, picks)
    later = _answer([7, 8], indexer_topk=base64.b64encode(picks[2:].tobytes()).decode())
    assert parse_generate(later, **kw, indexer_topk_start_len=2, indexer_dims=(2, 3)).indexer_topk.shape == (2, 2, 3)
    none = _answer([7, 8], indexer_topk="")  # an empty payload: no rows (a request aborted before it ran)
    assert parse_generate(none, **kw, indexer_dims=(2, 3)).indexer_topk.shape == (0, 2, 3)
    with pytest.raises(ValueError, match="expected rows\\*indexer_layers\\*index_topk=4\\*3\\*3"):
        parse_generate(obj, **kw, indexer_dims=(3, 3))
    with pytest.raises(ValueError, match="indexer layers and index_topk are needed"):
        parse_generate(obj, **kw)
    with pytest.raises(ValueError, match="--enable-return-indexer-topk"):
        parse_generate(_answer([7, 8]), **kw, indexer_dims=(2, 3))
    assert parse_generate(obj, return_logprob=False, return_routed_experts=False).indexer_topk is None


def test_decode_routed_experts_needs_one_dim_and_checks_it() -> None:
    arr = np.arange(24, dtype=np.int32)
    b64 = base64.b64encode(arr.tobytes()).decode()
    assert decode_routed_experts(b64, 2, num_layers=3).shape == (2, 3, 4)
    assert decode_routed_experts(b64, 2, top_k=2).shape == (2, 6, 2)
    with pytest.raises(ValueError, match="expected num_layers"):
        decode_routed_experts(b64, 2, num_layers=5, top_k=2)
    with pytest.raises(ValueError, match="do not split into 5 rows"):
        decode_routed_experts(b64, 5, top_k=2)
    assert decode_routed_experts("", 0, num_layers=3, top_k=2).shape == (0, 3, 2)


def test_parse_prometheus_and_weights_checksums() -> None:
    text = (
        "# HELP sglang:num_running_reqs running\n# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0\n'
        'sglang:num_running_reqs{tp_rank="1",model_name="m"} 2\n'
        'sglang:cache_hit_rate{model_name="a b, {c}\\"d"} 0.5 1700000000\n'
        "process_start_time_seconds 1.7e9\n"
        "sglang:gen_throughput NaN\n"
    )
    m = parse_prometheus(text)
    assert m['sglang:num_running_reqs{model_name="m",tp_rank="1"}'] == 2.0
    assert m['sglang:cache_hit_rate{model_name="a b, {c}"d"}'] == 0.5
    assert m["process_start_time_seconds"] == 1.7e9
    assert metric_sum(m, "sglang:num_running_reqs") == 5.0 and metric_sum(m, "absent") is None
    ranks = parse_weights_checksums(
        {
            "success": True,
            "message": "",
            "ranks": [{"checksums": {"w": "ab"}, "per_gpu_checksum": "x"}],
            "per_engine_checksum": "y",
        }
    )
    assert ranks.ranks[0].checksums == {"w": "ab"} and ranks.per_engine_checksum == "y"
    assert parse_weights_checksums({"checksums": {"w": "ab"}}).ranks[0].checksums == {"w": "ab"}


# ------------------------------------------------------------------------------------------- error paths


def _free_port() -> int:
    from miles_hpc.launch.local import free_port as pick

    return pick()  # below the ephemeral range: no other process's connection takes it first


@asynccontextmanager
async def stub(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """An aiohttp server on a free localhost port answering every path with ``handler``."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_closed_port_names_url_and_endpoint_after_retries() -> None:
    url = f"http://127.0.0.1:{_free_port()}"

    async def main() -> tuple[EngineUnreachableError, float]:
        async with EngineClient(url, connect_retries=2, retry_backoff_s=0.05) as c:
            t0 = time.monotonic()
            with pytest.raises(EngineUnreachableError) as info:
                await c.generate([1, 2], {"max_new_tokens": 1})
            return info.value, time.monotonic() - t0

    err, elapsed = asyncio.run(main())
    assert url in str(err) and "POST /generate" in str(err) and "cannot connect" in str(err)
    assert err.sent is False and err.url == url
    assert elapsed >= 0.05  # it backed off and retried: nothing can have run on a refused connection


@pytest.mark.process
def test_http_errors_carry_the_server_message_and_no_key() -> None:
    seen: list[tuple[str, str, str | None, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        seen.append((request.method, request.path, request.headers.get("Authorization"), body))
        if request.path == "/generate":
            return web.json_response({"object": "error", "message": "boom in scheduler", "code": 500}, status=500)
        if request.path == "/pause_generation":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if request.path == "/update_weights_from_disk":
            return web.json_response({"success": False, "message": "no such checkpoint"}, status=400)
        if request.path == "/get_model_info":
            return web.Response(text="<html>not json</html>")
        return web.Response(text="")

    async def main(url: str) -> None:
        async with EngineClient(url, api_key="plain-k", admin_api_key="admin-k") as c:
            with pytest.raises(EngineHTTPError) as e500:
                await c.generate([1], {"max_new_tokens": 1}, rid="x")
            assert e500.value.status == 500 and e500.value.server_message == "boom in scheduler"
            assert f"engine {url} POST /generate: HTTP 500: boom in scheduler" == str(e500.value)
            with pytest.raises(EngineHTTPError, match=r"POST /pause_generation: HTTP 401: Unauthorized"):
                await c.pause("retract")
            with pytest.raises(EngineHTTPError, match="HTTP 400: no such checkpoint"):
                await c.update_weights_from_disk("/nope", weight_version="3")
            with pytest.raises(EngineProtocolError, match="GET /get_model_info: answer is not JSON"):
                await c.model_info()
            await c.health()
            await c.flush_cache(timeout_s=1.5)
            for err in (e500.value,):
                assert "plain-k" not in str(err) and "admin-k" not in str(err)
            assert "k" not in repr(c).replace("EngineClient", "").replace(url, "")

    async def run() -> None:
        async with stub(handler) as url:
            await main(url)

    asyncio.run(run())
    auth = {(m, p): a for m, p, a, _ in seen}
    assert auth[("POST", "/generate")] == "Bearer plain-k"
    assert auth[("POST", "/pause_generation")] == "Bearer admin-k"  # admin endpoints carry the admin key
    assert auth[("POST", "/update_weights_from_disk")] == "Bearer admin-k"
    assert seen[0][3] == {"rid": "x", "input_ids": [1], "sampling_params": {"max_new_tokens": 1}}  # on the wire
    assert seen[1][3] == {"mode": "retract"}
    assert ("POST", "/flush_cache") in auth


@pytest.mark.process
def test_generate_is_not_resent_after_the_connection_broke_but_health_is() -> None:
    hits: dict[str, int] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        hits[request.path] = hits.get(request.path, 0) + 1
        if hits[request.path] <= 1 or request.path == "/generate":
            assert request.transport is not None
            request.transport.close()  # the engine dies while holding the request
            await asyncio.sleep(0.05)
        return web.Response(text="")

    async def main(url: str) -> None:
        async with EngineClient(url, connect_retries=3, retry_backoff_s=0.01) as c:
            with pytest.raises(EngineUnreachableError, match="POST /generate: connection lost") as info:
                await c.generate([1], {"max_new_tokens": 1})
            assert info.value.sent is True
            await c.health()  # idempotent: the second try succeeds

    async def run() -> None:
        async with stub(handler) as url:
            await main(url)

    asyncio.run(run())
    assert hits == {"/generate": 1, "/health": 2}


@pytest.mark.process
def test_timeout_names_the_endpoint() -> None:
    async def run() -> None:
        release = asyncio.Event()

        async def handler(request: web.Request) -> web.StreamResponse:
            await release.wait()
            return web.Response(text="")

        async with stub(handler) as url, EngineClient(url, timeout=0.2) as c:
            with pytest.raises(EngineTimeoutError, match=r"GET /get_server_info: no answer within 0.2 s"):
                await c.server_info()
            release.set()  # let the stub shut down at once

    asyncio.run(run())


@pytest.mark.process
def test_admin_calls_to_a_hung_engine_end_at_the_admin_timeout() -> None:
    """A hung engine (SIGSTOPped: it accepts connections and never answers) holds a weight sync's pause, continue
    and group calls only for the admin timeout the controller sets from sync.timeout_s; a generation keeps the
    long one, and a caller's own timeout still wins."""

    async def run() -> None:
        release = asyncio.Event()

        async def handler(request: web.Request) -> web.StreamResponse:
            await release.wait()
            return web.Response(text="{}")

        async with stub(handler) as url, EngineClient(url, timeout=30.0, admin_timeout=0.2) as c:
            for call, where in (
                (c.pause("retract"), "POST /pause_generation"),
                (c.continue_generation(), "POST /continue_generation"),
                (c.destroy_weights_update_group(), "POST /destroy_weights_update_group"),
            ):
                with pytest.raises(EngineTimeoutError, match=f"{where}: no answer within 0.2 s"):
                    await asyncio.wait_for(call, 5.0)
            with pytest.raises(EngineTimeoutError, match="no answer within 0.4 s"):
                await c.abort(abort_all=True, timeout=0.4)
            info = asyncio.ensure_future(c.server_info())  # not an admin call (nor is /generate): the 30 s timeout
            await asyncio.sleep(0.6)
            assert not info.done()
            release.set()
            await info

    asyncio.run(run())
