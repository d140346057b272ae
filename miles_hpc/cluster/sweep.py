"""Hyperparameter sweeps as Slurm array jobs (stage: cluster): one array task per grid point, each a whole
single-machine run (`miles-hpc run`) in its own run directory under the sweep's root.

`expand_grid(["train.lr=1e-4,3e-4", "seed=0,1"])` -> the points (the cartesian product, first key slowest);
`write_plan(root, config, overrides, points)` -> `ROOT/sweep.json`; `render_array(...)` -> the batch script, whose
task `$SLURM_ARRAY_TASK_ID` runs `miles-hpc sweep-task ROOT/sweep.json ID`; `report(root)` -> one row per point
with its final metrics. Pure functions plus the plan file; imports nothing of ours but the config.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import statistics
from pathlib import Path
from typing import Any

from miles_hpc.config import RunConfig

__all__ = ["expand_grid", "point_name", "render_array", "report", "write_plan"]


def expand_grid(grid: list[str]) -> list[dict[str, str]]:
    """``key=v1,v2`` items -> every combination, as ``{key: value}`` (values kept as text: the config parses
    them). A key given twice or without values is an error naming it."""
    axes: dict[str, list[str]] = {}
    for item in grid:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--grid {item!r}: expected key=v1,v2,...")
        if key in axes:
            raise ValueError(f"--grid: {key} given twice")
        axes[key] = [v.strip() for v in values.split(",") if v.strip()]
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def point_name(index: int, point: dict[str, str]) -> str:
    """A directory name for a grid point: ``003-train.lr=3e-4,seed=1`` (unsafe characters replaced)."""
    text = ",".join(f"{k}={v}" for k, v in point.items())
    return f"{index:03d}-" + re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)[:120]


def write_plan(root: Path, config: str, overrides: list[str], points: list[dict[str, str]]) -> Path:
    """``ROOT/sweep.json``: the config, the shared overrides and, per task, its overrides and run directory."""
    tasks = []
    for i, point in enumerate(points):
        run_dir = root / point_name(i, point)
        tasks.append(
            {
                "index": i,
                "run_dir": str(run_dir),
                "point": point,
                "overrides": [*overrides, *(f"{k}={v}" for k, v in point.items()), f"run_dir={run_dir}"],
            }
        )
    root.mkdir(parents=True, exist_ok=True)
    path = root / "sweep.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"config": config, "overrides": overrides, "tasks": tasks}, indent=1) + "\n")
    tmp.replace(path)
    return path


def render_array(cfg: RunConfig, plan: Path, n: int, *, max_parallel: int | None = None) -> str:
    """An array job of ``n`` tasks, each one node running `miles-hpc sweep-task PLAN $SLURM_ARRAY_TASK_ID`."""
    s = cfg.slurm
    limit = f"%{max_parallel}" if max_parallel else ""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.name}-sweep",
        f"#SBATCH --time={s.time}",
        f"#SBATCH --array=0-{n - 1}{limit}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --cpus-per-task={max(s.cpus_per_task, cfg.train.world_size + cfg.rollout.num_engines)}",
        f"#SBATCH --output={plan.parent}/slurm-%A_%a.out",
    ]
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    for key, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos)):
        if value:
            lines.append(f"#SBATCH --{key}={value}  # EDIT")
    if s.signal_s and s.requeue:
        lines.append(f"#SBATCH --signal=B:USR2@{s.signal_s}  # preemption/walltime: checkpoint, then requeue")
    if s.requeue:
        lines.append("#SBATCH --requeue  # a requeued task resumes its run from the last checkpoint")
    lines += [f"#SBATCH {x}" for x in s.extra_sbatch]
    body = [
        "set -euo pipefail",
        'echo "START $(date -u +%FT%TZ) task ${SLURM_ARRAY_TASK_ID} of job ${SLURM_ARRAY_JOB_ID}"',
        "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1",
        'export TMPDIR="/tmp/mh-${SLURM_JOB_ID}"',
        'mkdir -p "$TMPDIR"',
        "export PYTHONUNBUFFERED=1",
    ]
    if s.site:
        body.append(f"source {shlex.quote(s.site)}")
    body += list(s.setup)
    task = f'miles-hpc sweep-task {shlex.quote(str(plan))} "$SLURM_ARRAY_TASK_ID"'
    if not (s.signal_s and s.requeue):
        body += [task, 'echo "END $(date -u +%FT%TZ)"']
        return "\n".join(lines) + "\n\n" + "\n".join(body) + "\n"
    # The run in the background, so the USR2 trap runs at once (bash defers traps while a foreground child runs):
    # the run checkpoints after its current step and returns, then this task requeues itself and resumes there.
    body += [
        "REQUEUE=0",
        f"{task} &",
        "TASK=$!",
        "on_usr2() {",
        '  echo "[miles-hpc] USR2 at $(date -u +%FT%TZ): checkpoint, then requeue task ${SLURM_ARRAY_TASK_ID}"',
        '  kill -USR2 "$TASK" 2>/dev/null || true',
        "  REQUEUE=1",
        "}",
        "trap on_usr2 USR2",
        "RC=0",
        'while kill -0 "$TASK" 2>/dev/null; do wait "$TASK" && RC=0 || RC=$?; done  # a trap interrupts wait',
        'wait "$TASK" 2>/dev/null && RC=0 || RC=${RC}',
        'if [ "$REQUEUE" = 1 ]; then',
        '  echo "[miles-hpc] requeueing ${SLURM_JOB_ID} (task ${SLURM_ARRAY_TASK_ID})"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'echo "END $(date -u +%FT%TZ) exit ${RC}"',
        'exit "$RC"',
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(body) + "\n"


def report(root: Path, *, last: int = 10) -> list[dict[str, Any]]:
    """One row per grid point: its values, steps done, mean reward over its last ``last`` steps, final metrics;
    ``status`` is done, running (fewer steps than planned) or missing (no metrics yet)."""
    plan = json.loads((root / "sweep.json").read_text())
    rows = []
    for task in plan["tasks"]:
        run_dir = Path(task["run_dir"])
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
        steps = _planned_steps(run_dir)
        row: dict[str, Any] = {"index": task["index"], **task["point"], "steps": len(records)}
        if records:
            row["reward_last"] = round(statistics.fmean(r.get("reward_mean", 0.0) for r in records[-last:]), 4)
            row["status"] = "done" if steps is not None and len(records) >= steps else "running"
        else:
            row["status"] = "missing"
        rows.append(row)
    return rows


def _planned_steps(run_dir: Path) -> int | None:
    config = run_dir / "config.yaml"
    if not config.exists():
        return None
    m = re.search(r"^steps:\s*(\d+)\s*$", config.read_text(), re.MULTILINE)
    return int(m.group(1)) if m else None
