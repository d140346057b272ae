"""The rollout client against the real embedded engine (``miles-hpc serve`` subprocess on a tiny Qwen3-MoE), CPU.

Every client method once, with API keys on (admin endpoints carry the admin key). :class:`EngineProcess` and
:func:`tiny_model` are shared with tests/test_router_engine.py.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import require

from miles_hpc.rollout.client import EngineClient, EngineHTTPError
from miles_hpc.rollout.responses import metric_sum
from miles_hpc.rollout.sglang import EngineRecord, read_engine_record

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[1]
HAVE_SERVER = (REPO / "miles_hpc" / "engine" / "server.py").exists() and "serve" in (
    REPO / "miles_hpc" / "cli.py"
).read_text()
needs_server = pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built")


def miles_hpc_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("miles-hpc")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "miles_hpc.cli"]


@functools.cache
def tiny_model() -> Path:
    """One tiny random Qwen3-MoE checkpoint per test session, made by ``miles-hpc init-model``."""
    out = Path(tempfile.mkdtemp(prefix="miles-rollout-")) / "qwen3_moe_tiny"
    subprocess.run(
        miles_hpc_cmd() + ["init-model", "--arch", "qwen3_moe", "--size", "tiny", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def free_port() -> int:
    from miles_hpc.launch.local import free_port as pick

    return pick()  # below the ephemeral range: no other process's connection takes it first


class EngineProcess:
    """One ``miles-hpc serve`` process, started and stopped by handle (never by name)."""

    def __init__(self, model: Path, rendezvous: Path, *, port: int = 0, args: tuple[str, ...] = ()) -> None:
        self.model, self.rendezvous, self.port, self.args = model, rendezvous, port, args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = rendezvous.with_suffix(".log")

    def start(self) -> EngineProcess:
        self.rendezvous.unlink(missing_ok=True)
        cmd = miles_hpc_cmd() + [
            "serve",
            str(self.model),
            "--port",
            str(self.port),
            "--rendezvous",
            str(self.rendezvous),
            "--max-total-tokens",
            "16384",
            *self.args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # several engines share 2 cores
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = 60) -> EngineRecord:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.rendezvous.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        rec = read_engine_record(self.rendezvous)
        self.port = rec.port  # a restart comes back on the same port
        return rec

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        stop_all([self])


def stop_all(procs: list[EngineProcess]) -> None:
    """SIGTERM every process first, then wait: they shut down in parallel."""
    running = [p.proc for p in procs if p.proc is not None and p.proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def engine_fleet(d: Path, n: int, args: tuple[str, ...] = (), *, wait: bool = False) -> Iterator[list[EngineProcess]]:
    """`n` engines serving the tiny model, rendezvous files `d/engine-<i>.json`; all stopped on exit. `wait`: until
    every one listens (else the caller waits, e.g. with `wait_for_engines`)."""
    procs = [EngineProcess(tiny_model(), d / f"engine-{i}.json", args=args) for i in range(n)]
    try:
        for p in procs:
            p.start()
        if wait:
            for p in procs:
                p.wait_ready(90)
        yield procs
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    require(HAVE_SERVER, "the embedded engine server (miles-hpc serve)")
    d = tmp_path_factory.mktemp("engine")
    keys = {"api_key": "plain-0123", "admin_api_key": "admin-4567"}
    for name, value in keys.items():
        (d / name).write_text(value + "\n")
        (d / name).chmod(0o600)
    proc = EngineProcess(
        tiny_model(),
        d / "engine-0.json",
        args=("--api-key-file", str(d / "api_key"), "--admin-api-key-file", str(d / "admin_api_key")),
    )
    try:
        rec = proc.start().wait_ready()
        yield rec.url, keys
    finally:
        proc.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


@needs_server
def test_info_health_metrics(engine: tuple[str, dict[str, str]]) -> None:
    url, keys = engine

    async def main() -> None:
        async with EngineClient(url, **keys) as c:
            await c.health()
            await c.health_generate()
            info = await c.model_info()
            assert info["model_path"] == str(tiny_model()) and info["weight_version"] is not None
            server = await c.server_info()
            assert server["api_key_set"] is True and "plain-0123" not in str(server)
            before = metric_sum(await c.metrics(), "sglang:num_requests_total") or 0.0
            await c.generate([1, 2, 3], {"max_new_tokens": 2})
            assert metric_sum(await c.metrics(), "sglang:num_requests_total") == before + 1
        async with EngineClient(url, api_key="wrong") as bad:
            await bad.health()  # open without a key
            with pytest.raises(EngineHTTPError, match=rf"engine {url} GET /get_model_info: HTTP 401"):
                await bad.model_info()
        async with EngineClient(url, api_key=keys["api_key"]) as plain:  # the plain key does not unlock admin routes
            with pytest.raises(EngineHTTPError, match="POST /pause_generation: HTTP 401"):
                await plain.pause("retract")

    run(main())


@needs_server
def test_generate_logprobs_routing_versions_and_stops(engine: tuple[str, dict[str, str]]) -> None:
    url, keys = engine
    prompt = [(7 * i) % 250 + 3 for i in range(40)]  # > 2 KV blocks of 16, so a repeat hits the prefix cache
    seeded = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 42}

    async def main() -> None:
        async with EngineClient(url, **keys) as c:  # routing dims come from /get_model_info
            out = await c.generate(
                prompt,
                seeded,
                return_logprob=True,
                logprob_start_len=0,
                return_routed_experts=True,
                routed_experts_start_len=2,
            )
            assert out.completion_tokens == len(out.output_ids) == 12 and out.finish_reason.type == "length"
            assert out.prompt_tokens == 40 and out.output_logprobs is not None and len(out.output_logprobs) == 12
            assert all(math.isfinite(x) and x <= 0 for x in out.output_logprobs)
            assert out.input_logprobs is not None and out.input_logprobs[0] is None and len(out.input_logprobs) == 40
            assert out.routed_experts is not None and out.routed_experts.shape == (40 + 12 - 1 - 2, 2, 2)
            assert (
                out.routed_experts.dtype.name == "int32"
                and 0 <= out.routed_experts.min() <= out.routed_experts.max() < 8
            )
            assert out.token_versions() == [out.weight_version] * 12
            again = await c.generate(prompt, seeded)
            assert again.output_ids == out.output_ids and again.cached_tokens >= 32  # same seed; prefix cached
            stop = out.output_ids[5]
            first = out.output_ids.index(stop)
            stopped = await c.generate(prompt, {**seeded, "stop_token_ids": [stop]})
            assert stopped.finish_reason.type == "stop" and stopped.finish_reason.matched == stop
            assert stopped.output_ids == out.output_ids[: first + 1]
            teacher = await c.generate(
                prompt + out.output_ids, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=len(prompt) - 1
            )  # OPD-style scoring; entry 0 (token logprob_start_len) is None, as SGLang's
            assert teacher.output_ids == [] and teacher.input_logprobs is not None
            assert teacher.input_logprobs[0] is None
            assert teacher.input_logprobs[1:] == pytest.approx(out.output_logprobs, abs=1e-4)
            with pytest.raises(EngineHTTPError, match="POST /generate: HTTP 400: .*input_ids"):
                await c.generate([10**6], {"max_new_tokens": 1})

    run(main())


@needs_server
def test_abort_pause_continue_flush(engine: tuple[str, dict[str, str]]) -> None:
    url, keys = engine
    long = {"max_new_tokens": 1800, "ignore_eos": True}

    async def main() -> None:
        async with EngineClient(url, **keys) as c:
            task = asyncio.create_task(c.generate([1, 2, 3], long, rid="to-abort"))
            await asyncio.sleep(0.3)
            await c.abort("to-abort")
            out = await task
            assert out.finish_reason.type == "abort" and out.rid == "to-abort" and len(out.output_ids) < 1800
            task = asyncio.create_task(c.generate([4, 5], long))
            await asyncio.sleep(0.3)
            await c.abort(abort_all=True)
            assert (await task).finish_reason.type == "abort"

            task = asyncio.create_task(c.generate([6, 7], {"max_new_tokens": 200, "ignore_eos": True}))
            await asyncio.sleep(0.1)
            await c.pause("in_place")
            assert (await c.server_info())["paused"]
            with pytest.raises(EngineHTTPError, match="POST /flush_cache: HTTP 400"):
                await c.flush_cache()  # a request is held in place
            await c.continue_generation()
            done = await task
            assert done.finish_reason.type == "length" and done.completion_tokens == 200
            await c.flush_cache(timeout_s=5)

    run(main())


@needs_server
def test_weight_version_checksums_and_updates(engine: tuple[str, dict[str, str]]) -> None:
    import torch

    from miles_hpc.sync.wire.pg import CustomGroup, GroupSpec

    url, keys = engine
    model = tiny_model()

    async def main() -> None:
        async with EngineClient(url, **keys) as c:
            await c.update_weight_version("7")
            assert (await c.model_info())["weight_version"] == "7"
            assert (await c.generate([1], {"max_new_tokens": 1})).weight_version == "7"
            base = await c.weights_checksums()
            sums = base.ranks[0].checksums
            assert "model.norm.weight" in sums and base.per_engine_checksum

            # Trainer rank 0 (this test) + the engine (rank 1) over gloo, as the broadcast strategy does.
            port = free_port()
            joining = asyncio.create_task(
                c.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g", backend="gloo")
            )
            spec = GroupSpec(
                backend="gloo",
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=2,
                group_name="g",
                timeout_s=30,
            )
            group = await asyncio.to_thread(CustomGroup, spec)
            await joining
            hidden = 64
            receiving = asyncio.create_task(
                c.update_weights_from_distributed(
                    ["model.norm.weight"], [torch.float32], [[hidden]], group_name="g", weight_version="8"
                )
            )
            await asyncio.to_thread(group.broadcast, torch.full((hidden,), 0.5), 0)
            await receiving
            after = (await c.weights_checksums()).ranks[0].checksums
            assert after["model.norm.weight"] != sums["model.norm.weight"]
            assert {k for k in sums if after[k] != sums[k]} == {"model.norm.weight"}
            assert (await c.model_info())["weight_version"] == "8"
            await c.destroy_weights_update_group("g")
            group.destroy()

            await c.update_weights_from_disk(model, weight_version="9")  # back to the checkpoint's weights
            assert (await c.weights_checksums()).ranks[0].checksums == sums
            with pytest.raises(EngineHTTPError, match=r"POST /update_weights_from_disk: HTTP 400: .*nonexistent"):
                await c.update_weights_from_disk(model / "nonexistent")

    run(main())
