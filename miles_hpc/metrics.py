"""Metrics of a run: ``RUN/metrics.jsonl`` (a contract: one JSON object per train step with at least ``step``,
``reward_mean``, ``weight_version``), TensorBoard scalars under ``RUN/tb/``, and a live console progress line.

Invariants: a line is appended and flushed per step, so a killed run keeps every finished step; values that are
not finite numbers are written to JSON as null and skipped in TensorBoard, never crash the run. Opening the logger
drops a torn last line (a kill mid-write), and with ``resume_step`` every row of a step >= it (those steps run
again) by an atomic rewrite, and TensorBoard purges its events from that step on: a resumed run never repeats a
step. Rows are kept byte for byte, and lines that do not parse are kept where they are (only a torn last one goes).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from miles_hpc.atomic import write_bytes_atomic

# (metric key, label): shown in the progress line as "LABEL N" when the step's value is > 0.
COUNTS: tuple[tuple[str, str], ...] = (("rollout/failed", "failed"), ("rollout/skipped_prompts", "skipped"))


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def truncate_metrics(path: str | Path, resume_step: int | None) -> int:
    """Drop a torn last line of the JSONL file at ``path`` and, with ``resume_step``, every row whose ``step`` is
    >= it; rewrite atomically (temp file, fsync, rename) when anything goes. Returns the number of lines dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()  # bytes: every kept line goes back exactly as it was, whatever it holds
    lines = data.splitlines(keepends=True)
    before = len(lines)
    if lines and not lines[-1].endswith(b"\n"):
        if _step(lines[-1]) is None:
            lines.pop()  # torn by a kill mid-write: appending after it would corrupt the next row too
        else:
            lines[-1] += b"\n"  # whole, only its newline missing
    if resume_step is not None:
        lines = [line for line in lines if (s := _step(line)) is None or s < resume_step]
    kept = b"".join(lines)
    if kept != data:
        write_bytes_atomic(path, kept, mode=path.stat().st_mode & 0o7777)  # the file's own mode, not mkstemp's
    return before - len(lines)


def _step(line: bytes) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        console: IO[str] | None = sys.stdout,
        resume_step: int | None = None,
        counts: Sequence[tuple[str, str]] = COUNTS,
    ) -> None:
        """``resume_step``: the step this run starts at (a checkpoint's next_step; 0 on a fresh start over a crashed
        attempt); rows and TensorBoard events from it on are removed. ``counts``: see :data:`COUNTS`."""
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.console = console
        self.counts = tuple(counts)
        truncate_metrics(self.run_dir / "metrics.jsonl", resume_step)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step)
        self._t0 = time.monotonic()
        self._first_step: int | None = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: (_number(v) if not isinstance(v, str) else v) for k, v in metrics.items()}}
        record.setdefault("time/elapsed_s", time.monotonic() - self._t0)  # wall clock since this logger started
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            x = _number(value)
            if key != "step" and x is not None:
                self._tb.add_scalar(key, x, step)
        self._tb.flush()
        if self.console is not None:
            self.console.write(self._progress(step, record) + "\n")
            self.console.flush()

    def _progress(self, step: int, r: dict[str, Any]) -> str:
        if self._first_step is None:
            self._first_step = step
        done = step - self._first_step + 1
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * max(0, self.total_steps - step - 1)
        parts = [f"step {step + 1}/{self.total_steps}"]
        for key, fmt in (
            ("reward_mean", "reward {:.3f}"),
            ("response_len_mean", "len {:.1f}"),
            ("loss", "loss {:.4f}"),
            ("mismatch/max_abs_logprob_diff", "mismatch {:.2e}"),
            ("perf/tokens_per_s", "{:.0f} tok/s"),
        ):
            if r.get(key) is not None:
                parts.append(fmt.format(r[key]))
        for key, label in self.counts:
            n = _number(r.get(key))
            if n is not None and n > 0:
                parts.append(f"{label} {n:.0f}")
        parts.append(f"eta {eta:.0f}s")
        return "[miles-hpc] " + " | ".join(parts)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
