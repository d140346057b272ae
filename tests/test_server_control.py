"""Control endpoints with requests in flight, over real HTTP: pause/continue in each mode, abort_request by rid and
all, update_weight_version (and the per-token version spans it produces)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from server_fixtures import Server, acall, ametrics, call, generate, make_model, running_server

pytestmark = pytest.mark.process

N = 600  # tokens per long request: long enough to catch it running, short enough to finish in ~1-2 s


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_model(tmp_path_factory.mktemp("model") / "qwen3")
    with running_server(model, tmp_path_factory.mktemp("srv")) as s:
        yield s


def long_request(rid: str, first: int, n: int = N) -> dict[str, Any]:
    return {
        "input_ids": [first, 2, 3, 4],
        "rid": rid,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }


async def start_running(s: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]]) -> list[asyncio.Task[Any]]:
    """Post the bodies and return once all of them are decoding (and have produced a few tokens)."""
    base = (await ametrics(s, url))["sglang:generation_tokens_total"]
    tasks = [asyncio.create_task(acall(s, "POST", url + "/generate", b)) for b in bodies]
    for _ in range(500):
        m = await ametrics(s, url)
        produced = m["sglang:generation_tokens_total"] - base
        if m["sglang:num_running_reqs"] == len(bodies) and produced > 10 * len(bodies):
            return tasks
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests did not start running: {m}")


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_pause_and_continue_with_requests_in_flight(server: Server, mode: str) -> None:
    url = server.url

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            tasks = await start_running(s, url, [long_request(f"{mode}-{i}", 10 + i) for i in range(3)])
            r = await acall(s, "POST", url + "/pause_generation", {"mode": mode})
            assert r.status == 200 and r.body == {"message": "Generation paused successfully.", "status": "ok"}
            paused = await ametrics(s, url)
            await asyncio.sleep(0.3)
            later = await ametrics(s, url)
            assert later["sglang:generation_tokens_total"] == paused["sglang:generation_tokens_total"]
            assert later["miles:paused"] == 1
            assert (await acall(s, "GET", url + "/health_generate")).status == 200  # paused is not unhealthy
            if mode == "abort":
                replies = await asyncio.wait_for(asyncio.gather(*tasks), 5)  # answered without continue
            else:
                assert not any(t.done() for t in tasks)
                if mode == "retract":  # running requests went back to the queue, their KV freed
                    assert (later["sglang:num_running_reqs"], later["sglang:num_queue_reqs"]) == (0, 3)
            r = await acall(s, "POST", url + "/continue_generation", {})
            assert r.status == 200 and r.body["status"] == "ok"
            if mode != "abort":
                replies = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            for i, reply in enumerate(replies):
                assert reply.status == 200, reply.text
                meta = reply.body["meta_info"]
                assert meta["id"] == f"{mode}-{i}"
                if mode == "abort":
                    assert meta["finish_reason"]["type"] == "abort" and 10 < meta["completion_tokens"] < N
                else:
                    assert meta["finish_reason"] == {"type": "length", "length": N} and meta["completion_tokens"] == N
                    assert meta["num_retractions"] == (1 if mode == "retract" else 0)
            # generation works normally afterwards
            r = await acall(s, "POST", url + "/generate", long_request(f"{mode}-after", 5, 4))
            assert r.status == 200 and r.body["meta_info"]["completion_tokens"] == 4

    asyncio.run(scenario())


def test_abort_request_by_rid_and_all(server: Server) -> None:
    url = server.url

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            tasks = await start_running(s, url, [long_request(f"ab-{i}", 20 + i) for i in range(3)])
            r = await acall(s, "POST", url + "/abort_request", {"rid": "ab-1"})
            assert r.status == 200 and r.body["num_aborted"] == 1
            one = await asyncio.wait_for(tasks[1], 5)
            assert one.body["meta_info"]["finish_reason"]["type"] == "abort"
            assert not tasks[0].done() and not tasks[2].done()
            r = await acall(s, "POST", url + "/abort_request", {"rid": "no-such-rid"})
            assert r.status == 200 and r.body["num_aborted"] == 0
            r = await acall(s, "POST", url + "/abort_request", {"abort_all": True})
            assert r.status == 200 and r.body["num_aborted"] == 2
            for t in (tasks[0], tasks[2]):
                meta = (await asyncio.wait_for(t, 5)).body["meta_info"]
                assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < N

    asyncio.run(scenario())


def test_update_weight_version(server: Server) -> None:
    r = call("POST", server.url + "/update_weight_version", {"new_version": "v-7", "abort_all_requests": False})
    assert r.status == 200 and r.body == {
        "success": True,
        "message": "Weight version updated to v-7",
        "new_version": "v-7",
    }
    meta = generate(server.url, [1, 2, 3], 3)["meta_info"]
    assert meta["weight_version"] == "v-7" and meta["weight_versions"] == [{"version": "v-7", "start": 0, "end": 3}]
    assert call("GET", server.url + "/get_model_info").body["weight_version"] == "v-7"
    assert 'weight_version="v-7"' in call("GET", server.url + "/metrics").text


def test_weight_version_changes_mid_request(server: Server) -> None:
    url = server.url

    async def scenario() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            await acall(s, "POST", url + "/update_weight_version", {"new_version": "a", "abort_all_requests": False})
            [task] = await start_running(s, url, [long_request("spans", 7)])
            await acall(s, "POST", url + "/pause_generation", {"mode": "in_place"})
            body = {"new_version": "b", "abort_all_requests": False}
            r = await acall(s, "POST", url + "/update_weight_version", body)
            assert r.status == 200
            await acall(s, "POST", url + "/continue_generation", {})
            return (await asyncio.wait_for(task, 30)).body["meta_info"]

    meta = asyncio.run(scenario())
    spans = meta["weight_versions"]
    assert [sp["version"] for sp in spans] == ["a", "b"] and meta["weight_version"] == "b"
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == N


def test_update_weight_version_aborts_by_default(server: Server) -> None:
    async def scenario() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            [task] = await start_running(s, server.url, [long_request("to-abort", 9)])
            r = await acall(s, "POST", server.url + "/update_weight_version", {"new_version": "c"})  # SGLang default
            assert r.status == 200
            return (await asyncio.wait_for(task, 5)).body["meta_info"]

    assert asyncio.run(scenario())["finish_reason"]["type"] == "abort"


def test_health_generate_runs_a_generation(server: Server, tmp_path: Path) -> None:
    before = call("GET", server.url + "/metrics").text
    assert call("GET", server.url + "/health_generate").status == 200
    after = call("GET", server.url + "/metrics").text
    assert before != after  # one more request and token counted
