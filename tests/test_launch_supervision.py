"""Stop control and engine supervision in one process (launch/signals.py, launch/supervisor.py): signals and the
preempt marker, the abort another thread raises, restarts with backoff and their limit, records followed, and the
fleet-down error. Real signals to this process; the engines are a fake owner (no process is started)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from miles_hpc.launch.signals import RunAborted, RunInterrupted, StopControl
from miles_hpc.launch.supervisor import EngineFleetDown, EngineSupervisor
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.router import Router, RouterConfig


def test_first_signal_requests_a_stop_and_the_second_interrupts(tmp_path: Path) -> None:
    control = StopControl(tmp_path, hard_exit_s=3600).install()
    try:
        assert not control.stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert control.stop_requested() and control.why() == "SIGTERM" and control.exit_code() == 143
        with pytest.raises(RunInterrupted) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        assert info.value.signum == signal.SIGINT
        copy = type(info.value)(*info.value.args)  # what copies and pickles do
        assert (
            copy.signum == signal.SIGINT and str(copy) == str(info.value) == "SIGINT (second signal): stopped at once"
        )
    finally:
        control.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_preempt_marker_is_a_stop_request_until_consumed(tmp_path: Path) -> None:
    control = StopControl(tmp_path)
    assert not control.stop_requested()
    (tmp_path / "preempt").write_text("{}")
    assert control.stop_requested() and "preempt" in (control.why() or "") and control.exit_code() == 0
    control.consume_marker()
    assert not control.stop_requested() and not (tmp_path / "preempt").exists()


def test_another_thread_fails_the_run_in_the_main_thread(tmp_path: Path) -> None:
    control = StopControl(tmp_path, hard_exit_s=3600).install()
    try:
        with pytest.raises(RunAborted, match="trainer rank 1 exited"):
            threading.Thread(target=control.fail, args=("trainer rank 1 exited with code -9",)).start()
            time.sleep(2.0)
    finally:
        control.restore()


class FakeOwner:
    """A local cluster whose engine processes are exit codes set by the test."""

    def __init__(self, n: int, logs: Path) -> None:
        self.codes: list[int | None] = [None] * n
        self.restarted: list[int] = []
        self.logs = logs

    def engine_exit(self, i: int) -> int | None:
        return self.codes[i]

    def restart_engine(self, i: int) -> None:
        self.restarted.append(i)
        self.codes[i] = None

    def engine_log(self, i: int) -> Path:
        return self.logs / f"engine-{i}.log"


def supervised(tmp_path: Path, n: int, **kw: object) -> tuple[Router, EngineSupervisor, FakeOwner]:
    router = Router([EngineClient(f"http://127.0.0.1:{9 + i}") for i in range(n)], RouterConfig(health_interval_s=3600))
    owner = FakeOwner(n, tmp_path)
    sup = EngineSupervisor(router, tmp_path, EngineClient, owner=owner, **kw)  # type: ignore[arg-type]
    return router, sup, owner


def test_a_dead_engine_is_restarted_with_backoff_until_its_limit(tmp_path: Path) -> None:
    async def main() -> None:
        router, sup, owner = supervised(tmp_path, 2, max_restarts=2, backoff_s=1.0)
        await router.start()
        try:
            owner.codes[0] = -9
            sup.check(100.0)
            assert 0 in router.selector.quarantined and owner.restarted == []
            sup.check(100.5)  # the backoff (1 s) has not passed
            assert owner.restarted == []
            sup.check(101.0)
            assert owner.restarted == [0]
            owner.codes[0] = -9  # dies again: the second backoff is 2 s
            sup.check(200.0)
            sup.check(201.5)
            assert owner.restarted == [0]
            sup.check(202.0)
            assert owner.restarted == [0, 0]
            owner.codes[0] = 1  # and again: no restart left
            sup.check(300.0)
            sup.check(400.0)
            assert owner.restarted == [0, 0] and sup.fates[0].gave_up
        finally:
            await router.close()

    asyncio.run(main())


def test_a_new_record_becomes_the_engines_client(tmp_path: Path) -> None:
    async def main() -> None:
        router, sup, _ = supervised(tmp_path, 2)
        await router.start()
        try:
            (tmp_path / "engine-1.json").write_text(json.dumps({"url": "http://127.0.0.1:4242/"}))
            sup.check(1.0)
            assert router.clients[1].url == "http://127.0.0.1:4242" and 1 in router.selector.quarantined
            sup.check(2.0)  # the same record again: nothing changes
            assert router.clients[1].url == "http://127.0.0.1:4242"
        finally:
            await router.close()

    asyncio.run(main())


def test_no_engine_for_too_long_or_none_left_fails_naming_each(tmp_path: Path) -> None:
    async def main() -> None:
        router, sup, owner = supervised(tmp_path, 2, max_restarts=1, down_timeout_s=10.0)
        await router.start()
        try:
            owner.codes = [-9, -9]
            sup.check(0.0)  # both dead, restarts pending: not yet hopeless
            with pytest.raises(EngineFleetDown, match=r"no rollout engine has served for 11 s.*engine 0 .*engine 1"):
                sup.check(11.0)
        finally:
            await router.close()
        router, sup, owner = supervised(tmp_path, 1, max_restarts=0, down_timeout_s=1e9)
        await router.start()
        try:
            owner.codes = [-9]
            with pytest.raises(EngineFleetDown, match="exited with code -9"):
                sup.check(0.0)  # no restart left and nothing serving: at once
        finally:
            await router.close()

    asyncio.run(main())
