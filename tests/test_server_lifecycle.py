"""`miles-hpc serve` as a process: --port 0 + rendezvous, clean shutdown on SIGTERM/SIGINT with requests in flight
(answered, port released, rendezvous removed, exit 0), and start-up errors that exit 2 with one line."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import aiohttp
import pytest
from server_fixtures import acall, ametrics, make_model, start_server

from miles_hpc.cli import main


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "qwen3")


def port_is_free(port: int) -> bool:
    """Whether a new server could listen there (SO_REUSEADDR, as every server sets: closed client connections
    may linger in TIME_WAIT, which only a listener still holding the port would really block)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.process
def test_signal_shuts_down_cleanly_with_requests_in_flight(model: Path, tmp_path: Path, sig: int) -> None:
    server = start_server(model, tmp_path)
    port = server.info["port"]
    assert not port_is_free(port)

    async def scenario() -> list[object]:
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
            tasks = [asyncio.create_task(acall(s, "POST", server.url + "/generate", body)) for _ in range(2)]
            for _ in range(500):
                if (await ametrics(s, server.url))["sglang:num_running_reqs"] == 2:
                    break
                await asyncio.sleep(0.01)
            server.proc.send_signal(sig)
            return await asyncio.gather(*tasks, return_exceptions=True)

    replies = asyncio.run(scenario())
    assert server.proc.wait(30) == 0, server.log_tail()
    for r in replies:  # in-flight requests are answered (aborted), not left hanging
        assert not isinstance(r, BaseException), r
        assert r.status == 200 and r.body["meta_info"]["finish_reason"]["type"] == "abort"  # type: ignore[attr-defined]
    assert port_is_free(port) and not server.rendezvous.exists()
    assert "shutting down" in server.log_tail() and "Traceback" not in server.log_tail()


def test_startup_errors_exit_2(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In-process: each of these fails before anything is loaded or bound.
    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["serve", str(model), "--api-key", "a", "--api-key-file", str(tmp_path / "k")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["serve", str(model), "--api-key-file", str(tmp_path / "absent")]) == 2
    assert "absent" in capsys.readouterr().err
    assert main(["serve", str(model), "--dtype", "int4"]) == 2
    assert "dtype" in capsys.readouterr().err
    assert main(["serve", str(model), "--port", "70000"]) == 2
    assert "port" in capsys.readouterr().err


@pytest.mark.process
def test_taken_port_fails_fast(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(model), "--port", str(port)]) == 2  # before any model load
    assert f"cannot bind 127.0.0.1:{port}" in capsys.readouterr().err
