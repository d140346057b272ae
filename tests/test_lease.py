"""cluster/lease.py with real processes: a launcher (a parent process) starts a child that watches it; the parent
is SIGKILLed; the child is gone within seconds: by PR_SET_PDEATHSIG, by the poll alone (PDEATHSIG switched off), and
through a wrapper process in between. And `miles-hpc serve` under a launcher shuts down gracefully when it dies."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from server_fixtures import REPO, make_model

from miles_hpc.cluster.lease import PARENT_PID_ENV, parent_pid_from_env, watch_parent

CHILD = """
import ctypes, os, sys, time
from miles_hpc.cluster.lease import parent_pid_from_env, watch_parent
# "pdeathsig": a poll too slow to matter, so the kernel's signal must do it
watch_parent(parent_pid_from_env(), interval_s=60 if sys.argv[1] == "pdeathsig" else 0.2, grace_s=5)
if sys.argv[1] == "poll":  # the kernel's signal off: only the poll can notice
    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)
print("CHILD", os.getpid(), os.getppid(), flush=True)
time.sleep(600)
"""

PARENT = """
import os, shlex, subprocess, sys, time
child = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
if sys.argv[2] == "wrapped":  # a shell in between (the `; true` keeps it from exec-ing the child)
    child = ["sh", "-c", shlex.join(child) + "; true"]
env = {**os.environ, "MILES_PARENT_PID": str(os.getpid())}
subprocess.Popen(child, env=env, start_new_session=True)  # as launch/local.py starts engines
print("PARENT", os.getpid(), flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its new parent to reap it counts as exited) or never there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def read_lines(proc: subprocess.Popen[bytes], prefixes: set[str], timeout: float) -> dict[str, list[str]]:
    """The first line starting with each prefix, split (the child writes into the parent's stdout)."""
    assert proc.stdout is not None
    fd, buf, found = proc.stdout.fileno(), b"", {}
    deadline = time.monotonic() + timeout
    while set(found) != prefixes and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            break
        buf += chunk
        for line in buf.decode(errors="replace").split("\n")[:-1]:  # whole lines only
            words = line.split()
            if words and words[0] in prefixes:
                found.setdefault(words[0], words[1:])
    assert set(found) == prefixes, buf.decode(errors="replace")
    return found


@pytest.mark.process
@pytest.mark.parametrize("how", ["pdeathsig", "poll", "wrapped"])
def test_child_ends_when_its_launcher_is_killed(how: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), textwrap.dedent(CHILD), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    child = 0
    try:
        said = read_lines(parent, {"PARENT", "CHILD"}, timeout=60)
        child, child_ppid = int(said["CHILD"][0]), int(said["CHILD"][1])
        assert (child_ppid == parent.pid) == (how != "wrapped")
        time.sleep(0.5)
        assert not gone(child)
        parent.kill()  # SIGKILL: no handler, no cleanup in the launcher
        parent.wait()
        t0 = time.monotonic()
        while not gone(child):
            assert time.monotonic() - t0 < 5, f"child {child} outlived its launcher by 5 s ({how})"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()  # our own child, by handle
            parent.wait()
        if child and not gone(child):
            os.kill(child, signal.SIGKILL)  # the grandchild this test made, by its pid


@pytest.mark.process
def test_serve_shuts_down_gracefully_when_its_launcher_dies(tmp_path: Path) -> None:
    """`miles-hpc serve` started by a launcher: SIGKILL of the launcher -> SIGTERM's graceful shutdown (the
    rendezvous file removed), not an engine serving the run's key with parent PID 1."""
    model = make_model(tmp_path / "model")
    rdv = tmp_path / "engine-0.json"
    launcher = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        argv = [sys.executable, "-m", "miles_hpc.cli", "serve", {str(model)!r}, "--port", "0", "--rendezvous", {str(rdv)!r}]
        env = {{**os.environ, "MILES_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1"}}
        with open({str(tmp_path / "server.log")!r}, "wb") as log:
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd={str(REPO)!r})
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    pid = 0
    try:
        t0 = time.monotonic()
        while not rdv.exists():
            assert time.monotonic() - t0 < 120 and parent.poll() is None, (tmp_path / "server.log").read_text()
            time.sleep(0.05)
        pid = json.loads(rdv.read_text())["pid"]
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        while not gone(pid):
            assert time.monotonic() - t0 < 15, f"engine outlived its launcher:\n{(tmp_path / 'server.log').read_text()}"
            time.sleep(0.05)
        log = (tmp_path / "server.log").read_text()
        assert not rdv.exists(), log  # the graceful path ran: a stale file would name a dead server
        assert "shutting down" in log and "stopped" in log, log
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid and not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_parent_pid_from_env() -> None:
    assert parent_pid_from_env({}) is None and parent_pid_from_env({PARENT_PID_ENV: " "}) is None
    assert parent_pid_from_env({PARENT_PID_ENV: "4242"}) == 4242
    for bad in ("abc", "-5", "1", "12.5"):
        with pytest.raises(ValueError, match=PARENT_PID_ENV):
            parent_pid_from_env({PARENT_PID_ENV: bad})
    assert watch_parent(None) is None  # started by hand: nothing to watch


@pytest.mark.process
def test_a_parent_already_gone_is_noticed_at_once() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    calls: list[float] = []
    t0 = time.monotonic()
    thread = watch_parent(dead.pid, on_death=lambda: calls.append(time.monotonic() - t0), interval_s=0.1)
    assert thread is not None
    thread.join(timeout=5)
    assert calls and calls[0] < 2, calls
