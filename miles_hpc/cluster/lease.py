"""The parent-death lease: a process the launcher started ends when the launcher is gone, even after its SIGKILL.

Stage: cluster (imports nothing of ours). The launcher (`miles-hpc run`'s local cluster) puts its PID in
``MILES_PARENT_PID`` for every engine and trainer rank it starts; each calls
``watch_parent(parent_pid_from_env())`` at start-up. Engines live in sessions of their own, so no terminal signal
reaches them; without this an engine whose launcher was killed would serve the run's key forever, parent PID 1.

How the death is noticed:
- ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (Linux) as the fast path: the kernel signals us when our parent dies. It
  fires when the parent *thread* that forked us exits, too, so a launcher must start children from a thread that
  lives as long as it does (its main thread); and it is lost when we were re-parented before setting it.
- A daemon thread polling every ``interval_s`` is the real check: ``os.getppid()`` no longer the expected PID (we
  were re-parented: the parent died; immune to PID reuse). When the expected process is not our direct parent (a
  wrapper in between) the thread watches that process itself (a pidfd where Linux has one, which PID reuse cannot
  fool; else ``os.kill(pid, 0)``).

What happens then (`terminate_self`, the default ``on_death``): SIGTERM to this process, so its own graceful shutdown
runs (the engine server aborts requests, closes its port, removes its rendezvous file), then ``os._exit(1)`` after
``grace_s`` if it is still alive.

Invariants: no parent PID (the variable unset, a process started by hand) watches nothing; a malformed variable is
a ValueError naming it; a parent already gone when watching starts ends this process at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["PARENT_PID_ENV", "parent_pid_from_env", "terminate_self", "watch_parent"]

log = logging.getLogger(__name__)
PARENT_PID_ENV = "MILES_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_pid_from_env(environ: dict[str, str] | None = None) -> int | None:
    """``MILES_PARENT_PID`` as an int (None when unset or empty); ValueError naming the variable when malformed."""
    raw = (os.environ if environ is None else environ).get(PARENT_PID_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 1:
        raise ValueError(f"{PARENT_PID_ENV}={raw!r}: expected the PID of the launching process (an integer > 1)")
    return int(raw)


def terminate_self(grace_s: float = 30.0) -> None:
    """SIGTERM to this process (its graceful shutdown runs), then ``os._exit(1)`` if it still lives after ``grace_s``."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"[miles-hpc] still alive {grace_s:.0f} s after SIGTERM: exiting", file=sys.stderr, flush=True)
    os._exit(1)


def watch_parent(
    expected_ppid: int | None,
    *,
    on_death: Callable[[], None] | None = None,
    interval_s: float = 1.0,
    grace_s: float = 30.0,
) -> threading.Thread | None:
    """Watch that the process ``expected_ppid`` lives (module docstring); once it is gone, call ``on_death``
    (default: ``terminate_self(grace_s)``) in the watching daemon thread. Returns that thread (None: nothing to
    watch, ``expected_ppid`` None)."""
    if expected_ppid is None:
        return None
    direct = os.getppid() == expected_ppid
    if direct:
        _set_pdeathsig(signal.SIGTERM)
    action = on_death or (lambda: terminate_self(grace_s))
    thread = threading.Thread(
        target=_watch,
        args=(expected_ppid, direct, action, interval_s),
        name=f"parent-watch-{expected_ppid}",
        daemon=True,
    )
    thread.start()
    return thread


def _watch(pid: int, direct: bool, on_death: Callable[[], None], interval_s: float) -> None:
    if direct:
        while os.getppid() == pid:  # re-parented (to init or a subreaper) exactly when the parent died
            time.sleep(interval_s)
    else:
        alive = _process_watch(pid)
        while alive(interval_s):
            pass
    log.warning("the launching process %d is gone: this process ends too", pid)
    print(f"[miles-hpc] the launching process {pid} is gone: exiting", file=sys.stderr, flush=True)
    on_death()


def _sleep_true(seconds: float) -> bool:
    time.sleep(seconds)
    return True


def _process_watch(pid: int) -> Callable[[float], bool]:
    """``alive(wait)``: waits up to ``wait`` seconds, then whether ``pid`` still runs (False at once when it ends)."""
    try:
        fd = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has exited; PID reuse cannot fool it
    except (AttributeError, OSError):
        fd = None
        if not _exists(pid):
            return lambda wait: False

    if fd is None:
        return lambda wait: _sleep_true(wait) and _exists(pid)

    def alive(wait: float) -> bool:
        readable, _, _ = select.select([fd], [], [], wait)
        return not readable

    return alive


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return _state(pid) != "Z"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _set_pdeathsig(sig: int) -> None:
    """Ask the kernel for ``sig`` when our parent (thread) dies; Linux only, best effort."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):
        pass
