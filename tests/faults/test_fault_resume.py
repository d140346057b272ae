"""Crashes of a real run and its resume (docs/reliability.md, "Crash and resume"): the run is killed (SIGKILL: nothing
flushed, no handler) at the instants that used to store samples twice, at random instants, and by losing a trainer
rank; every time, the same command resumes it and the accounting is exact: each step's drawn prompts trained and
stored once, no group in two shards, each step once in metrics.jsonl, nothing a checkpoint covered lost."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from fault_support import (
    assert_exactly_once,
    finish,
    no_orphans,
    output,
    run,
    run_processes,
    start,
    steps_logged,
    wait_for,
)

pytestmark = [pytest.mark.process, pytest.mark.faults]

STEPS = 5
CKPT = ("train.checkpoint_interval=2",)


def resume_and_check(run_dir: Path) -> None:
    proc = run(run_dir, f"steps={STEPS}", *CKPT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_exactly_once(run_dir, STEPS)
    no_orphans(run_dir)


@pytest.mark.parametrize(
    "point",
    [
        "checkpoint:rolled:2",  # the shard of steps 2-3 is complete, its checkpoint (step_4) is not written
        "checkpoint:saved:1",  # just after step_2's checkpoint
        "step:stored:3",  # step 2's samples stored, its metrics not logged
        "sync:paused:3",  # in the weight update after step 1, the engine paused
    ],
)
def test_killed_at_a_crash_point_then_resumed(tmp_path: Path, point: str) -> None:
    run_dir = tmp_path / "run"
    proc = run(run_dir, f"steps={STEPS}", *CKPT, env={"MILES_CRASH_AT": point})
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    no_orphans(run_dir)  # the engines and trainer ranks died with the run
    resume_and_check(run_dir)


def test_fully_async_killed_between_roll_and_checkpoint_then_resumed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    mode = ("mode=fully_async",)
    proc = run(run_dir, f"steps={STEPS}", *CKPT, *mode, env={"MILES_CRASH_AT": "checkpoint:rolled:2"})
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    no_orphans(run_dir)
    proc = run(run_dir, f"steps={STEPS}", *CKPT, *mode)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_exactly_once(run_dir, STEPS, in_order=False)
    no_orphans(run_dir)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killed_at_a_random_instant_then_resumed(tmp_path: Path, seed: int) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, f"steps={STEPS}", *CKPT)
    try:
        wait_for("the first step", lambda: len(steps_logged(run_dir)) >= 1, proc=proc)
        time.sleep(random.Random(seed).uniform(0.0, 3.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    no_orphans(run_dir)
    resume_and_check(run_dir)


def test_a_lost_trainer_rank_ends_the_run_within_seconds_then_it_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "steps=40", *CKPT, "train.world_size=2")
    try:
        wait_for("step 3", lambda: len(steps_logged(run_dir)) >= 3, proc=proc)
        rank1 = [p for p in run_processes(run_dir) if "--role" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0], signal.SIGKILL)
        t0 = time.monotonic()
        code = finish(proc, run_dir, 120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output(run_dir)
    assert code == 1, out[-3000:]
    assert "trainer rank 1 exited with code -9" in out, out[-3000:]
    assert took < 30, f"{took:.0f} s to notice"
    no_orphans(run_dir)
    done = max(steps_logged(run_dir)) + 1
    proc2 = run(run_dir, f"steps={done + 1}", *CKPT, "train.world_size=2")
    assert proc2.returncode == 0, proc2.stdout[-3000:] + proc2.stderr[-3000:]
    assert_exactly_once(run_dir, done + 1)
