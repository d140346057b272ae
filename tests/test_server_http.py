"""`miles-hpc serve` over real HTTP: /generate (single, batched, log-probs), every 4xx, info, metrics, flush_cache,
client disconnect. One server process for the module (tiny qwen3, context 256, 50 KB body limit)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from server_fixtures import (
    Server,
    acall,
    ametrics,
    call,
    generate,
    greedy_reference,
    make_model,
    metrics,
    reference_logprobs,
    running_server,
)

pytestmark = pytest.mark.process

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "qwen3")


BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        model,
        tmp_path_factory.mktemp("srv"),
        "--max-context-len",
        "256",
        "--max-request-mb",
        "0.05",
        "--request-body-timeout",
        str(BODY_TIMEOUT_S),
    ) as s:
        yield s


def test_rendezvous_and_probes(server: Server, model: Path) -> None:
    info = server.info
    assert set(info) == {"host", "port", "pid", "url", "model_path", "tp_size", "gpu_ids"}
    assert info["pid"] == server.proc.pid and info["tp_size"] == 1 and info["gpu_ids"] == []
    assert info["model_path"] == str(model) and info["url"] == f"http://127.0.0.1:{info['port']}"
    for path in ("/health", "/ready", "/health_generate"):
        assert call("GET", server.url + path).status == 200, path


def test_generate_single_matches_the_reference_model(server: Server, model: Path) -> None:
    out = generate(
        server.url, PROMPT, 12, return_logprob=True, logprob_start_len=0, rid="single-1", sampling={"ignore_eos": True}
    )
    ids, meta = out["output_ids"], out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"} and isinstance(out["text"], str)
    assert meta["id"] == "single-1" and meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"], len(ids)) == (len(PROMPT), 12, 12)
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 12}]
    assert {"cached_tokens", "num_retractions", "e2e_latency"} <= set(meta)
    # log-prob triples [logprob, token_id, null]: one per output token, and per prompt token from position 0
    assert [t[1:] for t in meta["output_token_logprobs"]] == [[i, None] for i in ids]
    assert [t[1:] for t in meta["input_token_logprobs"]] == [[i, None] for i in PROMPT]
    assert meta["input_token_logprobs"][0][0] is None and all(t[0] < 0 for t in meta["input_token_logprobs"][1:])
    ref = reference_logprobs(model, PROMPT, ids)
    assert max(abs(a[0] - b) for a, b in zip(meta["output_token_logprobs"], ref)) < 1e-4
    assert greedy_reference(model, PROMPT, ids) <= 1e-5  # every token is the reference argmax


def test_generate_batched_returns_a_list_in_order(server: Server) -> None:
    prompts = [PROMPT, PROMPT[:3], [5, 6, 7, 8, 9]]
    out = generate(server.url, prompts, 6, rid=["b0", "b1", "b2"], return_logprob=[True, False, True])
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["b0", "b1", "b2"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(p) for p in prompts]
    assert "output_token_logprobs" in out[0]["meta_info"] and "output_token_logprobs" not in out[1]["meta_info"]
    for p, o in zip(prompts, out):  # batching changes nothing: each equals its single-prompt answer
        assert generate(server.url, p, 6)["output_ids"] == o["output_ids"]


BIG = json.dumps({"input_ids": [1] * 30_000}).encode()  # > the 50 KB limit of this server


@pytest.mark.parametrize(
    "method, path, body, status, needle",
    [
        ("POST", "/generate", b"{not json", 400, "malformed JSON"),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"foo": 1}}, 400, "`sampling_params.foo`"),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, 400, "max_new_tokens"),
        ("POST", "/generate", {"input_ids": [1, 320]}, 400, "input_ids[1]"),
        ("POST", "/generate", {"input_ids": [1] * 256}, 400, "longer than the model's context length"),
        (
            "POST",
            "/generate",
            {"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 100}},
            400,
            "maximum context length",
        ),
        ("POST", "/generate", {"text": "Hello"}, 400, "text input is not supported"),
        ("POST", "/generate", {"input_ids": [1], "stream": True}, 400, "stream"),
        ("POST", "/generate", BIG, 413, "Maximum request body size"),
        ("POST", "/generate", None, 400, "missing required field `input_ids`"),
        ("POST", "/pause_generation", {"mode": "sometimes"}, 400, "mode"),
        ("POST", "/abort_request", {"rid": 5}, 400, "rid"),
        ("POST", "/update_weight_version", {}, 400, "new_version"),
        ("GET", "/generate", None, 405, "Method Not Allowed"),
        ("POST", "/no_such_endpoint", {}, 404, "Not Found"),
    ],
)
def test_bad_requests_get_4xx_and_the_server_stays_up(
    server: Server, method: str, path: str, body: object, status: int, needle: str
) -> None:
    kw = {"data": body} if isinstance(body, bytes) else {}
    r = call(method, server.url + path, None if isinstance(body, bytes) else body, **kw)
    assert r.status == status, r.text
    assert needle in r.body["error"]["message"] and r.body["error"]["code"] == status
    assert call("GET", server.url + "/health_generate").status == 200
    assert generate(server.url, [1, 2], 2)["meta_info"]["completion_tokens"] == 2


BAD_BODIES = [  # (body, what the 400 says): each used to be a 500 or never reached the parser's own checks
    (b"[" * 5000 + b"]" * 5000, "malformed JSON body: nested too deeply"),
    (b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", "malformed JSON body: nested too deeply"),
    (b'{"input_ids": [' + b"9" * 5000 + b"]}", "malformed JSON body: Exceeds the limit (4300 digits)"),
    (b'{"rid": "\xff\xfe"}', "malformed JSON body: 'utf-8' codec can't decode byte 0xff"),
    (b"\x00\x01\x02", "malformed JSON body"),
]


@pytest.mark.parametrize("body, needle", BAD_BODIES)
def test_bodies_the_parser_refuses_are_400_on_every_endpoint(server: Server, body: bytes, needle: str) -> None:
    """Every endpoint that reads a JSON body (/generate and each control/weight schema) answers 400 naming it."""
    from miles_hpc.engine.protocol import SCHEMAS

    for path in ["/generate", *(f"/{name}" for name in SCHEMAS)]:
        r = call("POST", server.url + path, data=body)
        assert r.status == 400, (path, r.text[:300])
        assert needle in r.body["error"]["message"] and "set_int_max_str_digits" not in r.text, (path, r.text[:300])
    assert generate(server.url, [1, 2], 2)["meta_info"]["completion_tokens"] == 2
    assert call("GET", server.url + "/health").status == 200


def test_flush_cache_refuses_an_endless_timeout(server: Server) -> None:
    for bad in ("inf", "nan", "soon"):
        r = call("POST", server.url + f"/flush_cache?timeout={bad}")
        assert r.status == 400 and "query `timeout`" in r.body["error"]["message"], r.text


def test_info_endpoints(server: Server, model: Path) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = call("GET", server.url + path).body
        assert info["model_path"] == str(model) and info["is_generation"] is True
        assert (info["vocab_size"], info["max_context_len"], info["num_moe_layers"]) == (320, 256, 0)
        assert info["architectures"] == ["Qwen3ForCausalLM"] and isinstance(info["weight_version"], str)
    for path in ("/get_server_info", "/server_info"):
        info = call("GET", server.url + path).body
        assert info["tp_size"] == 1 and info["port"] == server.info["port"] and info["device"] == "cpu"
        assert isinstance(info["internal_states"], list) and "num_running_reqs" in info["internal_states"][0]
        assert info["api_key_set"] is False


def test_metrics_are_prometheus_text(server: Server) -> None:
    before = metrics(server.url)
    generate(server.url, [3, 4, 5], 5, sampling={"ignore_eos": True})
    after = metrics(server.url)
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:cache_hit_rate",
        "miles:weight_version_info",
    ):
        assert name in after
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] >= 5
    assert after["sglang:gen_throughput"] > 0
    text = call("GET", server.url + "/metrics").text
    assert 'weight_version="' in text and "# TYPE sglang:generation_tokens_total counter" in text


def test_flush_cache_drops_the_prefix_cache(server: Server) -> None:
    prompt = list(range(10, 60))  # 50 tokens: three full 16-token blocks can be reused
    generate(server.url, prompt, 1)
    assert generate(server.url, prompt, 1)["meta_info"]["cached_tokens"] >= 32
    r = call("POST", server.url + "/flush_cache")
    assert r.status == 200 and r.text.startswith("Cache flushed")
    assert generate(server.url, prompt, 1)["meta_info"]["cached_tokens"] == 0
    assert call("GET", server.url + "/flush_cache?timeout=1").status == 200
    assert call("POST", server.url + "/flush_cache?timeout=soon").status == 400


def test_client_disconnect_aborts_its_request(server: Server) -> None:
    async def scenario() -> tuple[float, float, float]:
        async with aiohttp.ClientSession() as s:
            assert (await acall(s, "POST", server.url + "/pause_generation", {"mode": "in_place"})).status == 200
            try:  # paused: the request waits in the queue; the client gives up after 0.5 s and disconnects
                with pytest.raises(asyncio.TimeoutError):
                    await acall(s, "POST", server.url + "/generate", {"input_ids": [1, 2], "rid": "gone"}, timeout=0.5)
                queued = (await ametrics(s, server.url))["sglang:num_queue_reqs"]
                for _ in range(100):
                    if (await ametrics(s, server.url))["sglang:num_queue_reqs"] == 0:
                        break
                    await asyncio.sleep(0.02)
                left = (await ametrics(s, server.url))["sglang:num_queue_reqs"]
            finally:
                await acall(s, "POST", server.url + "/continue_generation", {})
            again = await acall(
                s,
                "POST",
                server.url + "/generate",
                {"input_ids": [1, 2], "rid": "gone", "sampling_params": {"max_new_tokens": 1}},
            )
            return queued, left, again.status

    queued, left, status = asyncio.run(scenario())
    assert queued in (0, 1) and left == 0  # aborted (maybe before we looked), and the rid is free again
    assert status == 200


def test_oversize_chunked_body_is_413(server: Server) -> None:
    async def scenario() -> int:
        async def body():  # type: ignore[no-untyped-def]  (no Content-Length: the limit is enforced while reading)
            for _ in range(20):
                yield b" " * 10_000

        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/generate", data=body()) as resp:
                return resp.status

    assert asyncio.run(scenario()) == 413
    assert call("GET", server.url + "/health_generate").status == 200


def test_malformed_http_is_a_400_and_one_log_line(server: Server) -> None:
    """aiohttp refuses a request it cannot parse before any handler runs; its log record is one WARNING line, not
    an ERROR with the parser's traceback (any client could send these)."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(server.url)
    before = server.log_tail(10**7)
    for bad in (b"Content-Length: -5", b"Content-Length: abc"):
        with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + bad + b"\r\n\r\n{}")
            status = sock.recv(4096).split(b"\r\n", 1)[0]
            assert status.startswith(b"HTTP/1.") and b" 400 " in status, status
    assert call("GET", server.url + "/health").status == 200  # still serving
    new = server.log_tail(10**7)[len(before) :]
    assert new.count("bad HTTP request from a client (answered 400)") == 2, new
    assert "Traceback" not in new and "ERROR aiohttp.server" not in new, new


def test_a_stalled_request_body_is_a_408_not_a_held_handler(server: Server) -> None:
    """A client that announces a body and stops sending it gets 408 after --request-body-timeout seconds of silence,
    naming the flag; the server keeps serving."""
    import socket
    import time
    from urllib.parse import urlsplit

    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        reply = sock.recv(65536)
        waited = time.monotonic() - t0
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b" 408 " in head.split(b"\r\n", 1)[0], reply
    assert b"--request-body-timeout" in body, reply
    assert waited > BODY_TIMEOUT_S - 0.5, waited  # the answer came from the timeout, not at once
    assert call("GET", server.url + "/health").status == 200
