"""How the controller process stops (stage: launch; docs/reliability.md): on request, on a signal, on a failure.

- First SIGTERM, SIGINT or SIGUSR2, or the ``RUN/rendezvous/preempt`` marker (`miles-hpc worker --role preempt`, the
  batch script's USR2 handler): the loop checkpoints after its current step and returns; the marker is consumed.
- A second signal: :class:`RunInterrupted` is raised in the main thread at once (no new checkpoint: a resume starts
  from the last one and discards what came after it), and if the process still lives ``hard_exit_s`` later, every
  child is killed and the process exits (a main thread stuck in a C++ collective cannot run Python).
- A failure seen by another thread (a trainer rank died, no engine left): :meth:`StopControl.fail` raises
  :class:`RunAborted` with its reason in the main thread, with the same hard-exit backstop.

Exit codes: 128 + signal number after SIGTERM/SIGINT (also when the stop checkpointed), 0 after SIGUSR2 (Slurm's
preemption/walltime notice: a checkpointed stop the job requeues from) or the marker, 1 after a failure.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
_ABORT_SIGNAL = signal.SIGUSR1  # internal: how another thread interrupts the main one (StopControl.fail)


class RunInterrupted(KeyboardInterrupt):
    """A second stop signal: the run ends now. A KeyboardInterrupt, so no ``except Exception`` swallows it."""

    def __init__(self, signum: int, message: str | None = None) -> None:
        # Both in args: whatever re-creates the exception from them (copies, pickles) gets the same one back.
        super().__init__(signum, message or f"{signal.Signals(signum).name} (second signal): stopped at once")
        self.signum = signum

    def __str__(self) -> str:
        return str(self.args[1])


class RunAborted(KeyboardInterrupt):
    """Another thread found the run cannot go on (its message says why)."""


class StopControl:
    """Stop requests and failures of one controller process. ``install()`` from the main thread, ``restore()`` at
    the end; ``on_hard_exit`` kills the run's children (the last resort before ``os._exit``)."""

    def __init__(
        self,
        rendezvous: Path | None = None,
        *,
        on_hard_exit: Callable[[], None] | None = None,
        hard_exit_s: float = 20.0,
    ) -> None:
        self.marker = None if rendezvous is None else rendezvous / "preempt"
        self.on_hard_exit = on_hard_exit
        self.hard_exit_s = hard_exit_s
        self.signum: int | None = None  # the first stop signal
        self.failure: str | None = None
        self.ranks_told = False  # the other trainer ranks heard the controller's abort (they exit on purpose)
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    # -- requests -------------------------------------------------------------------------------------------

    def stop_requested(self) -> bool:
        """True once a stop signal came or the preempt marker exists (the loop checks after every step)."""
        return self.signum is not None or (self.marker is not None and self.marker.exists())

    def why(self) -> str | None:
        if self.signum is not None:
            return signal.Signals(self.signum).name
        if self.marker is not None and self.marker.exists():
            return f"preempt request ({self.marker})"
        return None

    def consume_marker(self) -> None:
        """The stop the marker asked for happened: remove it, or every later run of this directory would stop
        after one step."""
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)

    def exit_code(self) -> int:
        """0 after a stop request (the marker) or SIGUSR2 (Slurm's preemption and walltime notice: the job is
        requeued and resumes); 128 + the signal after SIGTERM/SIGINT."""
        return 128 + self.signum if self.signum not in (None, signal.SIGUSR2) else 0

    # -- signals --------------------------------------------------------------------------------------------

    def install(self) -> StopControl:
        """Handle the stop signals (main thread only; elsewhere, e.g. a test's thread, nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (*STOP_SIGNALS, _ABORT_SIGNAL):
            self._previous[sig] = signal.signal(sig, self._on_signal if sig != _ABORT_SIGNAL else self._on_abort)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            print(
                f"[miles-hpc] {name}: checkpoint after the current step, then exit (a second signal stops at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        print(f"[miles-hpc] {name} again: stopping now, without a new checkpoint", file=sys.stderr, flush=True)
        self._arm_hard_exit(128 + signum)
        raise RunInterrupted(signum)

    def fail(self, reason: str) -> None:
        """From any thread: end the run with ``reason`` (raised as RunAborted in the main thread)."""
        if self.failure is not None:
            return
        self.failure = reason
        print(f"[miles-hpc] error: {reason}", file=sys.stderr, flush=True)
        self._arm_hard_exit(1)
        if _ABORT_SIGNAL in self._previous:  # else (not installed: not the main thread's) only the backstop acts
            _thread.interrupt_main(_ABORT_SIGNAL)

    def _on_abort(self, _signum: int, _frame: FrameType | None) -> None:
        if self.failure is not None:
            raise RunAborted(self.failure)

    def _arm_hard_exit(self, code: int) -> None:
        if self._timer is not None:
            return
        self._timer = threading.Timer(self.hard_exit_s, self._hard_exit, args=(code,))
        self._timer.daemon = True
        self._timer.start()

    def _hard_exit(self, code: int) -> None:
        print(
            f"[miles-hpc] the run did not stop within {self.hard_exit_s:.0f} s (a collective that cannot finish?): "
            "killing its processes",
            file=sys.stderr,
            flush=True,
        )
        if self.on_hard_exit is not None:
            try:
                self.on_hard_exit()
            except Exception as e:  # noqa: BLE001 (the last resort goes on regardless)
                print(f"[miles-hpc] stopping the children failed: {e}", file=sys.stderr, flush=True)
        os._exit(code)
