"""How a failed run is reported (stage: launch; docs/reliability.md): one message naming the cause, a traceback file.

A run's failure reaches the user as ``error: <what> (traceback: RUN/logs/<role>.traceback)`` on stderr, exit 1; a
stop by a second signal exits 128 + its number. The full traceback goes to the file, so the terminal shows the cause, not
forty frames of asyncio.
"""

from __future__ import annotations

import signal
import sys
import traceback
from pathlib import Path

from miles_hpc.launch.signals import RunAborted, RunInterrupted


def report_failure(exc: BaseException, logs: Path | None, role: str = "controller") -> int:
    """Print ``exc`` as one message (its traceback into ``logs/<role>.traceback`` when ``logs`` is given); return the
    exit code for it."""
    if isinstance(exc, RunInterrupted):
        print(f"[miles-hpc] {exc}; a rerun resumes from the last checkpoint", file=sys.stderr, flush=True)
        return 128 + exc.signum
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
    print(f"error: {type(exc).__name__}: {message}{where}", file=sys.stderr, flush=True)
    return 1
