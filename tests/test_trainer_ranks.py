"""The controller's command protocol over a real 2-rank gloo world (launch/trainer_ranks.py): an abort reaches the
other rank as its error, a heartbeat keeps an idle rank's command wait inside a short collective timeout, and a
controller that fails inside a verb never blocks on the world. Run as a script, this file is one rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.process


class FakeTrainer:
    """Just enough of a trainer: `train_step` is one collective (the other rank must take part)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def train_step(self, batch: object) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return {"sum": float(t)}


def rank_main(scenario: str) -> None:
    from miles_hpc.launch.trainer_ranks import ControllerAborted, RankedTrainer, follow
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env

    info = world_from_env(device="cpu")
    init_trainer_world(info, timeout_s=3.0)  # short: a wait longer than this without a command would fail
    trainer = FakeTrainer(info.rank, info.world_size)
    if info.rank == 1:
        try:
            follow(trainer)  # type: ignore[arg-type]
        except ControllerAborted as e:
            print(f"rank 1 aborted: {e}", flush=True)
            os._exit(3)
        print("rank 1 released", flush=True)
        teardown()
        return
    ranked = RankedTrainer(trainer, heartbeat_s=0.5)  # type: ignore[arg-type]
    assert ranked.train_step(None) == {"sum": 2.0}
    if scenario == "idle_then_shutdown":
        time.sleep(8.0)  # longer than the collective timeout: only the heartbeat keeps rank 1's wait alive
        assert ranked.train_step(None) == {"sum": 2.0}
        ranked.shutdown()
        teardown()
    elif scenario == "abort":
        assert ranked.abort("ValueError: the controller's own error") is True
        teardown(ok=False)
    elif scenario == "abort_while_busy":
        ranked._busy = 1  # as if a verb were running: rank 1 may be inside its collective
        t0 = time.monotonic()
        assert ranked.abort("x") is False and time.monotonic() - t0 < 2.0
        teardown(ok=False)
        os._exit(4)  # rank 1's next broadcast breaks
    print("rank 0 done", flush=True)


def run_world(scenario: str) -> list[tuple[int, str]]:
    from miles_hpc.launch.local import free_port

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=120)
        out.append((p.returncode, text))
    return out


def test_heartbeat_keeps_an_idle_rank_waiting_past_the_collective_timeout() -> None:
    (c0, o0), (c1, o1) = run_world("idle_then_shutdown")
    assert c0 == 0 and "rank 0 done" in o0, o0[-3000:]
    assert c1 == 0 and "rank 1 released" in o1, o1[-3000:]


def test_abort_reaches_the_other_rank_as_its_error() -> None:
    (c0, o0), (c1, o1) = run_world("abort")
    assert c0 == 0, o0[-3000:]
    assert c1 == 3 and "the controller (trainer rank 0) stopped the run: ValueError: the controller's own error" in o1


def test_a_busy_world_is_not_waited_on() -> None:
    (c0, o0), (c1, o1) = run_world("abort_while_busy")
    assert c0 == 4, o0[-3000:]
    assert c1 not in (0, 3), o1[-3000:]  # its wait for a command broke: it failed, it did not hang or succeed


if __name__ == "__main__":
    rank_main(sys.argv[1])
