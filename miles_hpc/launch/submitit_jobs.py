"""Submitting runs with submitit (stage: loop): for single-component jobs and arrays, where one allocation runs a
whole `miles-hpc run` (its engines and trainer ranks on the allocated node). submitit cannot express heterogeneous
jobs: those go through `miles-hpc submit` (cluster/slurm.py renders them).

`run_config` is what executes inside the job (submitit pickles it by reference: it must stay a module-level
function); `submit_runs` sizes the allocation from the config's `slurm:` section and submits one job, or an array
of them (`Executor.map_array`) for a sweep. submitit polls `sacct`; on a cluster without accounting use the
stand-in of the local test cluster (docs/hpc.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_hpc.config import RunConfig, load_config

__all__ = ["describe", "parameters", "run_config", "submit_runs"]


def run_config(config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Inside the job: the whole run on this node; returns its summary (submitit's ``job.result()``)."""
    from miles_hpc.launch.controller import run_local
    from miles_hpc.launch.run_dir import prepare_run_dir, resolve_model

    cfg = load_config(config_path, overrides)
    resolve_model(cfg, prepare_run_dir(cfg))
    return run_local(cfg)


def _minutes(walltime: str) -> int:
    """Slurm's time formats -> minutes, rounded up: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days_text, dash, rest = walltime.partition("-") if "-" in walltime else ("", "", walltime)
    parts = [int(x) for x in rest.split(":")]
    if dash:  # after "D-" the fields are hours[:minutes[:seconds]]
        h, m, s = (parts + [0, 0])[:3]
    else:  # minutes, minutes:seconds, or hours:minutes:seconds
        h, m, s = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return int(days_text or 0) * 1440 + h * 60 + m + (1 if s else 0)


def parameters(cfg: RunConfig) -> dict[str, Any]:
    """The executor's parameters for ``cfg`` (submitit's ``update_parameters``): one node for the whole run."""
    s = cfg.slurm
    extra: dict[str, Any] = {}
    if s.account:
        extra["account"] = s.account
    if s.qos:
        extra["qos"] = s.qos
    return dict(
        name=cfg.name,
        timeout_min=_minutes(s.time),
        nodes=1,
        tasks_per_node=1,
        cpus_per_task=max(s.cpus_per_task, cfg.train.world_size + cfg.rollout.num_engines),
        slurm_partition=s.partition,
        slurm_additional_parameters=extra,
        **({"gpus_per_node": s.gpus_per_node} if s.gpus_per_node else {}),
    )


def describe(cfg: RunConfig, config_path: str, runs: list[list[str]]) -> str:
    """What `submit_runs` would submit (`miles-hpc submit --launcher submitit --dry-run`), as JSON."""
    import json

    path = str(Path(config_path).resolve())
    jobs = [{"function": "miles_hpc.launch.submitit_jobs.run_config", "args": [path, r]} for r in runs]
    return json.dumps({"launcher": "submitit", "parameters": parameters(cfg), "jobs": jobs}, indent=2)


def submit_runs(cfg: RunConfig, config_path: str, runs: list[list[str]], folder: Path) -> list[Any]:
    """One job per entry of ``runs`` (each a list of overrides; several: an array job). Returns submitit jobs."""
    import submitit

    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
    executor.update_parameters(**parameters(cfg))
    config_path = str(Path(config_path).resolve())
    if len(runs) == 1:
        return [executor.submit(run_config, config_path, runs[0])]
    return list(executor.map_array(run_config, [config_path] * len(runs), runs))
