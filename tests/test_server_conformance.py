"""The embedded engine's HTTP server against SGLang 0.5.23's behaviour, where a probe of both found them apart:
`/health_generate` on a busy engine, `PUT /generate`, the decoded text around a stop token, ignored unknown keys,
prompts near the context limit, batched string rids, finish reasons and the log-prob keys of `meta_info`.

One engine (tiny qwen3 with its byte tokenizer) behind an in-process `EngineServer` on a local port (aiohttp's
TestServer); docs/engine.md, HTTP API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from engine_support import make_ckpt

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.server import EngineServer, ServerConfig

pytestmark = pytest.mark.process  # an HTTP server on a local port

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("model") / "qwen3", "qwen3", seed=1)


@pytest.fixture
def engine(ckpt: Path) -> Iterator[Engine]:
    e = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_running_requests=2))  # context 2048
    e.start()
    try:
        yield e
    finally:
        e.shutdown()


def serve(engine: Engine, scenario: Any, **config: Any) -> Any:
    """Run ``scenario(client)`` against an EngineServer over ``engine``; its result."""

    async def main() -> Any:
        async with TestClient(TestServer(EngineServer(engine, ServerConfig(**config)).app())) as client:
            return await scenario(client)

    return asyncio.run(main())


def body(n: int = 6, **kw: Any) -> dict[str, Any]:
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw.pop("sampling", {})}
    return {"input_ids": PROMPT, "sampling_params": sp, **kw}


def test_health_generate_answers_200_at_once_on_a_saturated_engine(engine: Engine) -> None:
    """SGLang answers as soon as the scheduler produced any output after the probe began; the probe waiting behind a
    full queue (2 running, 30 queued requests of 1,500 tokens) must not make a busy engine look dead."""

    async def scenario(client: TestClient) -> tuple[int, float, dict[str, Any], dict[str, Any]]:
        long = [body(1500, input_ids=[3 + i, 4, 5, 6]) for i in range(32)]
        tasks = [asyncio.create_task(client.post("/generate", json=b)) for b in long]
        while engine.stats()["num_requests_total"] < len(long) or engine.stats()["num_running_reqs"] < 2:
            await asyncio.sleep(0.01)
        before = engine.stats()
        t0 = time.monotonic()
        r = await client.get("/health_generate")
        took = time.monotonic() - t0
        after = engine.stats()
        await asyncio.to_thread(engine.abort, None)
        await asyncio.gather(*tasks)
        return r.status, took, before, after

    status, took, before, after = serve(engine, scenario, health_timeout_s=4.0)
    assert before["num_queue_reqs"] >= 20 and before["num_running_reqs"] == 2
    assert status == 200 and took < 2.0, (status, took)
    # the probe (log_metrics=False, as SGLang sends it) counts in no request counter
    for key in ("num_requests_total", "prompt_tokens_total"):
        assert after[key] == before[key], key


def test_health_generate_is_503_only_when_nothing_progresses(ckpt: Path) -> None:
    stuck = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))  # never started: no step ever runs

    async def scenario(client: TestClient) -> tuple[int, dict[str, Any]]:
        r = await client.get("/health_generate")
        await asyncio.sleep(0.2)  # the probe's abort runs in a worker thread
        return r.status, await r.json()

    try:
        status, answer = serve(stuck, scenario, health_timeout_s=0.5)
        stats = stuck.stats()
    finally:
        stuck.shutdown()
    assert status == 503 and "no engine step completed within 0.5 s" in answer["error"]["message"]
    assert stats["num_queue_reqs"] == 0 and stats["num_requests_total"] == 0  # aborted, never counted


def test_idle_engine_health_generate_and_put_generate(engine: Engine) -> None:
    async def scenario(client: TestClient) -> tuple[int, int, Any, Any]:
        health = await client.get("/health_generate")
        put = await client.put("/generate", json=body(5))
        post = await client.post("/generate", json=body(5))
        return health.status, put.status, await put.json(), await post.json()

    health, put_status, put, post = serve(engine, scenario)
    assert health == 200 and put_status == 200 and put["output_ids"] == post["output_ids"]
    assert put["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_text_leaves_out_the_matched_stop_token(engine: Engine) -> None:
    async def scenario(client: TestClient) -> list[Any]:
        free = await (await client.post("/generate", json=body(40))).json()
        stop = next(t for t in free["output_ids"] if 32 <= t < 127)  # a printable byte the model produces
        outs = [free]
        for trim in (False, True):
            b = body(40, sampling={"stop_token_ids": [stop], "no_stop_trim": trim})
            outs.append(await (await client.post("/generate", json=b)).json())
        return outs

    free, trimmed, kept = serve(engine, scenario)
    stop = trimmed["meta_info"]["finish_reason"]["matched"]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["output_ids"] == kept["output_ids"] and trimmed["output_ids"][-1] == stop  # ids keep it
    assert kept["text"] == trimmed["text"] + chr(stop)  # only no_stop_trim keeps it in the text
    assert free["text"].startswith(kept["text"])


def test_unknown_keys_are_ignored_and_logged_once(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(client: TestClient) -> list[int]:
        statuses = []
        for _ in range(2):
            r = await client.post("/generate", json=body(2, foo=1, custom_labels={"team": "rl"}))
            statuses.append(r.status)
        statuses.append((await client.post("/abort_request", json={"rid": "none", "foo": 2})).status)
        bad = await client.post("/generate", json=body(2, return_entropy=True))
        statuses.append(bad.status)
        return statuses

    with caplog.at_level(logging.WARNING, logger="miles_hpc.engine.server"):
        statuses = serve(engine, scenario)
    assert statuses == [200, 200, 200, 400]
    warned = [r.getMessage() for r in caplog.records if "ignoring request field" in r.getMessage()]
    assert sorted(warned) == sorted(
        f"ignoring request field {name!r}: not one this engine reads (SGLang ignores it too); logged once"
        for name in ("foo", "custom_labels")
    )


def test_context_limit_batched_rids_and_meta_info(engine: Engine) -> None:
    async def scenario(client: TestClient) -> list[Any]:
        near = {"input_ids": [5] * 2040, "sampling_params": {"temperature": 0.0, "ignore_eos": True}}
        unbounded = {"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
        batch = {"input_ids": [PROMPT, PROMPT[:4]], "rid": "grp", "sampling_params": {"max_new_tokens": 2}}
        logprobs = body(3, return_logprob=True)
        scored = body(0, return_logprob=True, logprob_start_len=3)
        replies = []
        for b in (near, unbounded, batch, logprobs, scored):
            r = await client.post("/generate", json=b)
            replies.append((r.status, await r.json()))
        return replies

    (s1, near), (s2, unbounded), (s3, batch), (s4, lp), (s5, scored) = serve(engine, scenario)
    assert (s1, s2, s3, s4, s5) == (200,) * 5
    # no max_new_tokens near the 2048-token context: SGLang's 128 cut to 2048 - 2040 - 2, not a 400
    assert len(near["output_ids"]) == 6 and near["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert len(unbounded["output_ids"]) == 46  # null: what the context holds
    assert [o["meta_info"]["id"] for o in batch] == ["grp_0", "grp_1"]
    meta = lp["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 3
    assert meta["reasoning_tokens"] == 0
    entries = scored["meta_info"]["input_token_logprobs"]  # from position 3; entry 0 is None, as SGLang's
    assert [e[1] for e in entries] == PROMPT[3:] and entries[0][0] is None
    assert all(e[0] < 0 for e in entries[1:])


def test_an_aborted_request_has_sglangs_abort_shape(engine: Engine) -> None:
    async def scenario(client: TestClient) -> Any:
        task = asyncio.create_task(client.post("/generate", json=body(1500, rid="long")))
        while engine.stats()["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        assert (await client.post("/abort_request", json={"rid": "long"})).status == 200
        return await (await task).json()

    finish = serve(engine, scenario)["meta_info"]["finish_reason"]
    assert finish == {"type": "abort", "message": "aborted by request", "status_code": None, "err_type": None}
