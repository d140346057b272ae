#!/usr/bin/env bash
# A learning-rate x seed sweep of the demo task as one Slurm array job (one task per grid point, each a whole
# single-node run in its own run directory under ROOT). Run from the repository root:
#   ./slurm/sweep_tiny_lr.sh [ROOT]           # then: miles-hpc sweep-report ROOT
# `--dry-run` after ROOT writes ROOT/sweep.json and prints the array script without submitting it.
set -euo pipefail
ROOT="${1:-runs/sweep_tiny_lr}"
shift || true
miles-hpc sweep "$@" --grid train.lr=3e-4,1e-3,3e-3 --grid seed=0,1 --max-parallel 4 \
  configs/tiny_cpu.yaml "run_dir=$ROOT" steps=200
