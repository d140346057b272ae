#!/usr/bin/env bash
# Re-render the checked-in scripts that come from configs (tests/test_slurm_render.py checks they are current):
#   ./slurm/render.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
miles() { "${PYTHON:-.venv/bin/python}" -m miles_hpc.cli "$@"; }
miles submit --dry-run --no-preflight configs/tiny_cpu.yaml > slurm/tiny_cpu.sbatch
miles submit --dry-run --no-preflight configs/tiny_cpu.yaml slurm.mode=split > tests/golden/tiny_cpu_split.sbatch
miles submit --dry-run --no-preflight configs/experiments/glm52_64gpu.yaml > slurm/glm52_64gpu.sbatch
