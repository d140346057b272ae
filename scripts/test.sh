#!/usr/bin/env bash
# The test suite: every CPU tier (Slurm/MPI/SGLang where available; -m gpu tests skip without a GPU). Extra args go
# to pytest. `--fast` first runs the edit-test tier: no test that starts a process, a server or a cluster, nothing
# marked slow (tests/conftest.py keeps it honest: an unmarked test that starts one fails).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
if [[ "${1:-}" == "--fast" ]]; then
  shift
  exec python -m pytest -q -m "not (process or slurm or mpi or sglang or slow or gpu)" "$@"
fi
exec python -m pytest -q "$@"
