"""The pause lease (engine/pause_lease.py) over real HTTP, with a 1 s lease: a pause nobody continues ends by itself,
admin calls keep it alive, and an engine left on half-updated weights says so on /health and /health_generate
(503) instead of pretending to be healthy while /generate waits forever."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from safetensors.torch import save
from server_fixtures import Server, acall, ametrics, call, make_model, metrics, running_server

from miles_hpc.engine.pause_lease import PauseLease
from miles_hpc.engine.server import ServerConfig
from miles_hpc.models import iter_hf_tensors, load_pretrained

LEASE_S = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "qwen3")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(model, tmp_path_factory.mktemp("srv"), "--pause-lease", str(LEASE_S)) as s:
        yield s


def metric(url: str, name: str) -> float:
    return metrics(url)[name]


def wait_until(cond: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``cond()`` held (polling), or fail."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.process
def test_a_pause_nobody_continues_ends_by_itself(server: Server) -> None:
    url = server.url
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}}

    async def scenario() -> tuple[float, dict[str, object], int]:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(acall(s, "POST", url + "/generate", body))
            while (await ametrics(s, url))["sglang:num_running_reqs"] < 1:
                await asyncio.sleep(0.01)
            assert (await acall(s, "POST", url + "/pause_generation", {"mode": "in_place"})).status == 200
            t0 = time.monotonic()
            probe = await acall(s, "GET", url + "/health_generate")  # paused: says so, still 200 (SGLang-compatible)
            assert probe.status == 200, probe.text
            assert (await acall(s, "GET", url + "/health")).status == 200
            assert (await ametrics(s, url))["miles:paused"] == 1 and not task.done()
            while (await ametrics(s, url))["miles:paused"] == 1:
                await asyncio.sleep(0.02)
            reply = await asyncio.wait_for(task, 60)  # the trainer never came back: generation went on
            return time.monotonic() - t0, probe.body, reply.body["meta_info"]["completion_tokens"]

    waited, probe, tokens = asyncio.run(scenario())
    assert probe["status"] == "paused" and 0 < probe["lease_remaining_s"] <= LEASE_S, probe
    assert "ends by itself" in probe["message"]
    assert LEASE_S * 0.8 <= waited <= LEASE_S + 5, waited
    assert tokens == 400
    assert "continuing generation" in server.log_tail(20000) and "pause lease 1 s" in server.log_tail(20000)


@pytest.mark.process
def test_admin_calls_keep_the_pause(server: Server) -> None:
    url = server.url
    assert call("POST", url + "/pause_generation", {"mode": "retract"}).status == 200
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * LEASE_S:  # the trainer is alive: it checks weights, names a version
        assert call("GET", url + "/weights_checker").status == 200
        time.sleep(LEASE_S / 3)
        assert metric(url, "miles:paused") == 1
    assert call("POST", url + "/continue_generation", {}).status == 200
    assert metric(url, "miles:paused") == 0


def one_bucket(model: Path) -> str:
    """base64 safetensors of one tensor of the model (its own values: the point is the missing weight_version)."""
    name, t = next(iter(iter_hf_tensors(load_pretrained(model))))
    return base64.b64encode(save({name: t.detach().contiguous().clone()})).decode()


@pytest.mark.process
def test_half_updated_weights_past_the_lease_are_unhealthy(server: Server, model: Path) -> None:
    url = server.url
    assert call("POST", url + "/pause_generation", {"mode": "abort"}).status == 200
    r = call("POST", url + "/update_weights_from_tensor", {"serialized_named_tensors": [one_bucket(model)]})
    assert r.status == 200 and r.body["success"], r.text  # a bucket of a multi-part update; then the trainer died
    assert call("GET", url + "/health").status == 200  # within the lease: an update in progress
    wait_until(lambda: call("GET", url + "/health").status == 503, LEASE_S + 5)
    for path in ("/health", "/health_generate"):
        r = call("GET", url + path)
        assert r.status == 503 and "half-updated" in r.body["error"]["message"], (path, r.text)
        assert "/update_weights_from_disk" in r.body["error"]["message"]
    time.sleep(LEASE_S)
    assert metric(url, "miles:paused") == 1  # it did not continue on mixed weights
    assert call("POST", url + "/continue_generation", {}).status == 400  # and refuses to
    assert server.log_tail(20000).count("this engine cannot serve") == 1  # reported once, not every tick
    # the weights are declared whole again: healthy at once, and the pause (nobody continues it) ends by itself
    assert call("POST", url + "/update_weight_version", {"new_version": "whole"}).status == 200
    assert call("GET", url + "/health").status == 200
    wait_until(lambda: metric(url, "miles:paused") == 0, LEASE_S + 5)
    r = call("POST", url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status == 200 and r.body["meta_info"]["weight_version"] == "whole"


# ---------------------------------------------------------------------------------------------- the bookkeeping
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lease_runs_out_only_when_idle() -> None:
    clock = Clock()
    lease = PauseLease(10.0, clock)
    assert not lease.ran_out() and lease.remaining_s() == 10.0
    with lease.hold():
        clock.t += 50  # a receive waiting for the trainer's broadcast: never runs out meanwhile
        assert not lease.ran_out() and lease.idle_s() == 0.0
    assert lease.remaining_s() == 10.0  # renewed when the call ended
    clock.t += 9.9
    assert not lease.ran_out()
    clock.t += 0.1
    assert lease.ran_out() and lease.remaining_s() == 0.0
    assert lease.take_report() and not lease.take_report()  # once per episode
    lease.renew()
    assert not lease.ran_out() and lease.take_report()


def test_no_lease_and_the_default() -> None:
    lease = PauseLease(None)
    assert not lease.ran_out() and lease.remaining_s() is None
    with pytest.raises(ValueError, match="pause lease"):
        PauseLease(0.0)
    assert ServerConfig(weight_sync_timeout_s=30.0).lease_s() == 30.0  # default: the weight-update timeout
    assert ServerConfig(pause_lease_s=0.0).lease_s() is None
    assert ServerConfig(pause_lease_s=2.5).lease_s() == 2.5
    with pytest.raises(ValueError, match="pause_lease_s"):
        ServerConfig(pause_lease_s=-1.0)
