#!/usr/bin/env bash
# The test suite: every CPU tier (Slurm/MPI/SGLang where available; -m gpu tests skip without a GPU). Extra args go
# to pytest. `--fast` first runs the edit-test tier: no test that starts a process, a server or a cluster, nothing
# marked slow (tests/conftest.py keeps it honest: an unmarked test that starts one fails).
# The full suite runs in MILES_TEST_WORKERS pytest-xdist workers (default 2): most of its time goes to tests that
# keep one core busy (a run's engine and trainer) or wait on a process, so two workers on CI's 2 cores halve it.
# The Slurm tests share one cluster: one runs at a time (a lock in tests/conftest.py). `-n 0` runs serially.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
if [[ "${1:-}" == "--fast" ]]; then
  shift
  exec python -m pytest -q -m "not (process or slurm or mpi or sglang or slow or gpu)" "$@"
fi
exec python -m pytest -q -n "${MILES_TEST_WORKERS:-2}" "$@"
