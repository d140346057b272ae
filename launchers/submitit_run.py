#!/usr/bin/env python3
"""Submit one whole run as a single Slurm job through submitit's Python API (no hetjob; the config's `slurm:`
section sizes the allocation); prints the job id, and with --wait the run's summary.

    python launchers/submitit_run.py configs/tiny_cpu.yaml steps=10 [--wait]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miles_hpc.config import load_config
from miles_hpc.launch.submitit_jobs import submit_runs

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("config")
ap.add_argument("overrides", nargs="*", metavar="key.sub=value")
ap.add_argument("--wait", action="store_true", help="wait for the job and print its summary (job.result())")
args = ap.parse_args()
cfg = load_config(args.config, args.overrides)
(job,) = submit_runs(cfg, args.config, [args.overrides], Path(cfg.run_dir) / "submitit")
print(f"submitted job {job.job_id}; run dir {cfg.run_dir}", flush=True)
if args.wait:
    print(json.dumps(job.result()))
