"""An engine step that raises (a bug, an out-of-memory) fails the requests it held with HTTP 500 naming the
exception, and the server keeps serving: a client must not take the zero tokens of a broken step for a generation
(engine/core.py `_loop`, docs/engine.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from engine_support import make_ckpt

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.server import EngineServer, ServerConfig


@pytest.mark.process  # an HTTP server on a local port
def test_a_failed_step_is_a_500_and_the_next_request_is_served(tmp_path: Path) -> None:
    engine = Engine.from_pretrained(str(make_ckpt(tmp_path / "m", "qwen3", seed=1)), EngineConfig(block_size=4))
    engine.start()
    real_run, calls = engine.runner.run, []

    def broken_once(batch: Any) -> Any:
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_run(batch)

    engine.runner.run = broken_once  # type: ignore[method-assign]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}

    async def scenario() -> tuple[int, Any, int, Any]:
        async with TestClient(TestServer(EngineServer(engine, ServerConfig()).app())) as client:
            first = await client.post("/generate", json=body)
            second = await client.post("/generate", json=body)
            return first.status, await first.json(), second.status, await second.json()

    try:
        status, error, status2, ok = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert status == 500 and "engine step failed: RuntimeError: boom" in error["error"]["message"], error
    assert status2 == 200 and len(ok["output_ids"]) == 3 and ok["meta_info"]["finish_reason"]["type"] == "length"
