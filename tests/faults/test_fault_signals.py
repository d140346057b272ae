"""Signals to a real `miles-hpc run` (docs/reliability.md, "Signals"): the first SIGTERM/SIGINT/SIGUSR2 checkpoints after
the current step and exits (128 + signal; 0 for USR2, the preemption notice) with every child gone; a second stops at once; a SIGKILL of the run takes its
engines and trainer ranks with it; the preempt marker stops the run once and is consumed. Each resumes exactly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_support import (
    REPO,
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2])
def test_a_signal_checkpoints_after_the_step_and_exits(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "steps=40", "train.world_size=2")
    try:
        wait_for("step 2", lambda: len(steps_logged(run_dir)) >= 2, proc=proc)
        proc.send_signal(sig)
        code = finish(proc, run_dir, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output(run_dir)
    assert code == (0 if sig == signal.SIGUSR2 else 128 + sig), out[-3000:]
    done = len(steps_logged(run_dir))
    assert (run_dir / "checkpoints" / f"step_{done}").is_dir(), out[-3000:]
    assert f"stopped by {sig.name} after" in out
    no_orphans(run_dir)
    proc2 = run(run_dir, f"steps={done + 2}", "train.world_size=2")
    assert proc2.returncode == 0, proc2.stdout[-3000:] + proc2.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{done}'}" in proc2.stdout
    assert_exactly_once(run_dir, done + 2)


def test_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "steps=400", "rollout.max_new_tokens=48", "train.world_size=2")
    try:
        wait_for("step 1", lambda: len(steps_logged(run_dir)) >= 1, proc=proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = finish(proc, run_dir, 60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGINT, output(run_dir)[-3000:]
    assert took < 25, f"{took:.1f} s after the second signal"
    no_orphans(run_dir)


def test_sigkill_of_the_run_takes_its_children_along(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "steps=400", "rollout.num_engines=2", "train.world_size=2")
    try:
        wait_for("step 1", lambda: len(steps_logged(run_dir)) >= 1, proc=proc)
        children = [p for p in run_processes(run_dir) if p != proc.pid]
        assert len(children) == 3, children  # two engines, trainer rank 1
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    no_orphans(run_dir, timeout=40)


def test_the_preempt_marker_stops_the_run_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "steps=40")
    try:
        wait_for("step 1", lambda: len(steps_logged(run_dir)) >= 1, proc=proc)
        subprocess.run(
            [sys.executable, "-m", "miles_hpc.cli", "worker", "--role", "preempt", str(run_dir / "config.yaml")],
            check=True,
            cwd=REPO,
            timeout=60,
        )
        code = finish(proc, run_dir, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, output(run_dir)[-3000:]
    assert not (run_dir / "rendezvous" / "preempt").exists()  # consumed: a rerun is not stopped again
    done = len(steps_logged(run_dir))
    assert done < 40 and (run_dir / "checkpoints" / f"step_{done}").is_dir()
    proc2 = run(run_dir, f"steps={done + 3}")
    assert proc2.returncode == 0, proc2.stdout[-3000:] + proc2.stderr[-3000:]
    assert_exactly_once(run_dir, done + 3)
    no_orphans(run_dir)
