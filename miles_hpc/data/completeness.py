"""Every trained sample still stored: the per-step sample counts that ``RUN/metrics.jsonl`` records against the
``train_step`` column of the complete shards (stage: data; docs/formats.md, "Checking shards").

The loop appends a step's samples to the store and then logs that step's row, whose ``rollout/samples`` is the
number appended (``loop/sync.py``, ``loop/fully_async.py``). So a step with a row holds exactly that many samples in
the shards, unless a shard was deleted or moved out of the directory, or quarantined as damaged: nothing in the
other shards shows that, and this check does. A step with no row (an SFT warm-up, a crash between the append and
the row) is not counted. Partial shards (a run writing, or a crash before the writer closed its shard) may hold any
step's samples, so with one present there is nothing to compare: :func:`missing_samples` returns no finding then.

Used by ``miles-hpc inspect --verify RUN`` (`verify.verify_shards`) and at a resume (``launch/controller.py``, a
warning after the reconciler, for the steps the checkpoint covers).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import h5py
import numpy as np

from miles_hpc.data.schema import find_shards

__all__ = ["SAMPLES_KEY", "Missing", "describe", "missing_samples", "recorded_counts", "run_of", "stored_counts"]

SAMPLES_KEY = "rollout/samples"  # the metrics row's count of the samples its step appended to the store
METRICS_FILE = "metrics.jsonl"

Missing = tuple[int, int, int]  # (step, samples its metrics row records, samples the shards hold)


def run_of(path: str | Path) -> Path | None:
    """The run directory whose shards ``path`` names: a run directory (``metrics.jsonl`` beside ``trajectories/``)
    or its ``trajectories/``; None for one shard file or a directory of shards outside a run."""
    p = Path(path)
    if not p.is_dir():
        return None
    for run in (p, p.parent):
        if p in (run, run / "trajectories") and (run / METRICS_FILE).is_file() and (run / "trajectories").is_dir():
            return run
    return None


def recorded_counts(metrics: Path, below: int | None = None) -> dict[int, int]:
    """``{step: samples}`` from the rows of ``metrics`` that carry :data:`SAMPLES_KEY` (of steps < ``below`` when
    given); a line that does not parse (a torn last line) is skipped, a later row of a step wins."""
    out: dict[int, int] = {}
    with open(metrics, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
                step, n = int(row["step"]), int(row[SAMPLES_KEY])
            except (ValueError, KeyError, TypeError):
                continue
            if below is None or step < below:
                out[step] = n
    return out


def stored_counts(train_steps: Iterable[np.ndarray]) -> Counter[int]:
    """Samples per ``train_step`` over the given columns."""
    counts: Counter[int] = Counter()
    for column in train_steps:
        steps, n = np.unique(np.asarray(column), return_counts=True)
        counts.update(dict(zip(steps.tolist(), n.tolist(), strict=True)))
    return counts


def missing_samples(run: Path, stored: Counter[int] | None = None, below: int | None = None) -> list[Missing]:
    """Steps of ``run`` (< ``below`` when given) whose shards hold fewer samples than their metrics rows record,
    in step order. ``stored``: the shards' counts when the caller has read them (else the ``train_step`` columns
    are read here). Empty when a partial shard is present (module docstring)."""
    if not (run / METRICS_FILE).is_file() or not (run / "trajectories").is_dir() or below == 0:
        return []  # nothing recorded (a first attempt that ended before its first row), or nothing to compare
    shards, partials = find_shards(run / "trajectories")
    if partials:
        return []
    if stored is None:
        stored = stored_counts(_train_steps(shards))
    recorded = recorded_counts(run / METRICS_FILE, below)
    return [(s, n, stored.get(s, 0)) for s, n in sorted(recorded.items()) if stored.get(s, 0) < n]


def describe(missing: list[Missing], shown: int) -> list[str]:
    """One line per step (the first ``shown``), then one that counts the rest and the samples in all."""
    lines = [
        f"step {s}: {n} sample(s) trained, {k} in the shards: {n - k} missing (a shard deleted, moved out or "
        f"quarantined)"
        for s, n, k in missing[:shown]
    ]
    if len(missing) > shown:
        total = sum(n - k for _, n, k in missing)
        lines.append(f"samples missing from {len(missing)} steps in all ({total} samples)")
    return lines


def _train_steps(shards: list[Path]) -> Iterable[np.ndarray]:
    """Each shard's ``train_step`` column (one small read per file); an unreadable one adds nothing."""
    for path in shards:
        try:
            with h5py.File(path, "r") as f:
                yield f["samples/train_step"][()]
        except (OSError, KeyError, ValueError):
            continue
