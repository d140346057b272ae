"""Crash points for the fault campaign (tests/faults/, docs/reliability.md): a named instant where a test can make the
process die as a power cut would (SIGKILL, nothing flushed, no handler run).

``MILES_CRASH_AT=name`` (or ``name:n``, names hold colons too: ``checkpoint:rolled:2``, the n-th time the point is reached, 1-based) in the environment of a process
kills it at that point; unset, :func:`crash_point` costs one dict lookup. Points are placed at the instants where a
crash used to lose or duplicate data: between a shard's roll and its checkpoint, after a checkpoint, after a step's
samples are stored, in the middle of a weight update (the controller's `sync:paused`, an engine's
`engine:receiving`, a tensor-parallel engine's rank > 0 `engine-tp:receiving`). With ``MILES_CRASH_ONCE=PATH`` a
point fires only while PATH does not exist (it is created first): once per run, not in every restarted process that
inherits the environment.

:func:`enable_stack_dumps` (every process of a run calls it first): a native crash prints every thread's Python stack
to stderr, and so does SIGQUIT (``kill -QUIT PID``, Ctrl-\\) without ending the process, so a run that hangs shows
where each process waits (its log under RUN/logs/); the fault tests send it before they give up on a run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
from collections import Counter

ENV = "MILES_CRASH_AT"
ONCE_ENV = "MILES_CRASH_ONCE"
_reached: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """Die here (SIGKILL) when ``MILES_CRASH_AT`` names this point (and this is its n-th time)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, nth = spec.rpartition(":")
    if not nth.isdigit():  # no count: the first time
        point, nth = spec, "1"
    if point != name:
        return
    _reached[name] += 1
    if _reached[name] == int(nth):
        once = os.environ.get(ONCE_ENV)
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # fired already, in an earlier process of this run
        print(f"[miles-hpc] crash point {name} (#{_reached[name]}): SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def enable_stack_dumps() -> None:
    """Python stacks of every thread to stderr on a native crash and on SIGQUIT (module docstring). Not where stderr
    is no file (in-process callers, captured output): nothing happens."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.enable(all_threads=True)
        faulthandler.register(signal.SIGQUIT, all_threads=True)
