"""One run per run directory (launch/run_dir.lock_run_dir): a second process is refused with the holder named while
the first lives, and gets the directory the moment the first is gone, however it died (the kernel drops a POSIX
lock with its process); a forked child does not inherit the claim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from miles_hpc.launch.run_dir import RunDirInUseError, lock_run_dir

pytestmark = pytest.mark.process

HOLD = "import sys, time; from pathlib import Path; from miles_hpc.launch.run_dir import lock_run_dir; " \
       "lock_run_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"  # fmt: skip


def _holder(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _claim(root: Path, hold: bool) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from pathlib import Path; from miles_hpc.launch.run_dir import lock_run_dir; "
        f"lock_run_dir(Path(sys.argv[1]), hold={hold}); print('ok')"
    )
    return subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)


def test_a_second_run_is_refused_while_the_first_lives_then_admitted(tmp_path: Path) -> None:
    root = tmp_path / "run"
    first = _holder(root)
    try:
        for hold in (True, False):  # a run, and a job's prepare step (which only checks)
            got = _claim(root, hold)
            assert got.returncode != 0 and "RunDirInUseError" in got.stderr, got.stderr[-2000:]
            assert f"run_dir {root} is in use by another run (host " in got.stderr
            assert f"pid {first.pid} since" in got.stderr
        with pytest.raises(RunDirInUseError, match="wait for it to end, or give another run_dir"):
            lock_run_dir(root)
    finally:
        first.send_signal(signal.SIGKILL)  # no clean-up of any kind
        first.wait()
    got = _claim(root, True)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-2000:]


def test_the_claim_is_idempotent_and_not_inherited_by_a_forked_child(tmp_path: Path) -> None:
    root = tmp_path / "run"
    code = (
        "import os, sys, time; from pathlib import Path; from miles_hpc.launch.run_dir import lock_run_dir\n"
        "root = Path(sys.argv[1]); lock_run_dir(root); lock_run_dir(root)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    os.close(1); os.close(2); time.sleep(30); os._exit(0)\n"
        "print(pid, flush=True)\n"
    )  # the parent exits at once, its forked child lives on
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.strip())
    try:
        got = _claim(root, True)
        assert got.returncode == 0, got.stderr[-2000:]
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_run_in_this_process_gives_the_directory_back_when_it_returns(tmp_path: Path) -> None:
    """`miles-hpc run` / `run_local` claim the directory for the run only (a library call leaks no lock)."""
    from miles_hpc.launch.run_dir import claimed_run_dir

    root = tmp_path / "run"
    with claimed_run_dir(root):
        with claimed_run_dir(root):  # nested: the inner block leaves the outer's claim alone
            pass
        assert "in use by another run" in _claim(root, False).stderr
    got = _claim(root, True)
    assert got.returncode == 0, got.stderr[-2000:]
