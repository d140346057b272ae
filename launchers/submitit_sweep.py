#!/usr/bin/env python3
"""Submit a hyperparameter sweep as one Slurm array through submitit's Python API: one whole run per grid point,
each in ROOT/<point>/ (ROOT = the config's run_dir); `miles-hpc sweep-report ROOT` tabulates them.

    python launchers/submitit_sweep.py configs/tiny_cpu.yaml --grid algo.lr=1e-4,3e-4 --grid seed=0,1 [--wait]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miles_hpc.cluster.sweep import expand_grid, write_plan
from miles_hpc.config import load_config
from miles_hpc.launch.submitit_jobs import submit_runs

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("config")
ap.add_argument("overrides", nargs="*", metavar="key.sub=value", help="shared by every point")
ap.add_argument("--grid", action="append", required=True, metavar="key=v1,v2")
ap.add_argument("--wait", action="store_true", help="wait for every task and print their summaries")
args = ap.parse_args()
cfg = load_config(args.config, args.overrides)
root = Path(cfg.run_dir)
plan = write_plan(root, str(Path(args.config).resolve()), args.overrides, expand_grid(args.grid))
tasks = json.loads(plan.read_text())["tasks"]
jobs = submit_runs(cfg, args.config, [t["overrides"] for t in tasks], root / "submitit")
print(f"submitted {len(jobs)} array tasks (job {jobs[0].job_id.split('_')[0]}); plan {plan}", flush=True)
if args.wait:
    for job in jobs:
        print(json.dumps(job.result()))
