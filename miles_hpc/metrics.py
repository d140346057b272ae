"""Metrics of a run: ``RUN/metrics.jsonl`` (a contract: one JSON object per train step with at least ``step``,
``reward_mean``, ``weight_version``), TensorBoard scalars under ``RUN/tb/``, and a live console progress line.

Invariants: a line is appended and flushed per step, so a killed run keeps every finished step; values that are
not finite numbers are written to JSON as null and skipped in TensorBoard, never crash the run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, total_steps: int, console: IO[str] | None = sys.stdout) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.console = console
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(self.run_dir / "tb"))
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
        parts.append(f"eta {eta:.0f}s")
        return "[miles-hpc] " + " | ".join(parts)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
