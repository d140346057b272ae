#!/usr/bin/env bash
# The test suite (CPU tier + Slurm/MPI tiers where available; -m gpu tests skip without a GPU). Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
