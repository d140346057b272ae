"""How a failed run is reported (stage: launch; docs/reliability.md): one message naming the cause, a traceback file.

A run's failure reaches the user as ``error: <what> (traceback: RUN/logs/<role>.traceback)`` on stderr, exit 1; a
stop by a second signal exits 128 + its number. The full traceback goes to the file, so the terminal shows the cause, not
forty frames of asyncio.
"""

from __future__ import annotations

import re
import signal
import sys
import traceback
from pathlib import Path

from miles_hpc.launch.signals import RunAborted, RunInterrupted


def interrupt_in(exc: BaseException, depth: int = 0) -> RunInterrupted | None:
    """The second-signal stop inside ``exc``: itself, its cause or context, or a rank's failure that a library
    collected (torch's distributed checkpoint wraps what its steps raise in a CheckpointException, so a signal that
    arrives while a checkpoint is written surfaces that way)."""
    if isinstance(exc, RunInterrupted):
        return exc
    if depth > 8:
        return None
    inner: list[object] = [exc.__cause__, exc.__context__]
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):  # torch's: rank -> (exception, its traceback summary)
        inner += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    for e in inner:
        if isinstance(e, BaseException) and (found := interrupt_in(e, depth + 1)) is not None:
            return found
    return None


def report_failure(exc: BaseException, logs: Path | None, role: str = "controller") -> int:
    """Print ``exc`` as one message (its traceback into ``logs/<role>.traceback`` when ``logs`` is given); return the
    exit code for it."""
    stop = interrupt_in(exc)
    if stop is not None:
        print(f"[miles-hpc] {stop}; a rerun resumes from the last checkpoint", file=sys.stderr, flush=True)
        return 128 + stop.signum
    if type(exc) is KeyboardInterrupt:  # a Ctrl-C outside the run's handlers (e.g. while its processes stop)
        print("[miles-hpc] SIGINT: stopped; a rerun resumes from the last checkpoint", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    where = ""
    if logs is not None:
        try:
            logs.mkdir(parents=True, exist_ok=True)
            path = logs / f"{role}.traceback"
            path.write_text("".join(traceback.format_exception(exc)))
            where = f" (traceback: {path})"
        except OSError:
            pass
    if isinstance(exc, RunAborted):  # its reason was printed when it was raised
        print(f"[miles-hpc] the run stopped{where}", file=sys.stderr, flush=True)
        return 1
    message = str(exc) or "(no message)"
    print(f"error: {type(exc).__name__}: {message}{hint(message)}{where}", file=sys.stderr, flush=True)
    return 1


# gloo's and NCCL's words for a collective that waited past its timeout
_COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms for (recv|send)|Watchdog caught collective operation timeout"
)


def hint(message: str) -> str:
    """What the user can do about a failure whose own words say nothing of the run (a library's message)."""
    if _COLLECTIVE_TIMEOUT.search(message):
        return (
            " [a trainer collective waited past train.collective_timeout_s: a trainer rank stopped answering (hung "
            "or stopped; `kill -QUIT PID` prints its stacks into RUN/logs/trainer-<rank>.log)]"
        )
    return ""
