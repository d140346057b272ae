# Sourced by demo.sh / test.sh: create or refresh the local virtualenv (.venv) and install the project into it.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MILES_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "miles-hpc needs Python >= 3.11 (found: $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    # Debian ships venv separately; install it when we may, else say what to do.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      rm -rf "$VENV"; "$PYTHON" -m venv "$VENV"
    else
      echo "cannot create a virtualenv: install python3-venv (apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
fi
STAMP="$VENV/.miles-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[miles-hpc] installing into $VENV ..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # Pin the CPU torch first: on these machines 2.13.0 is a local CPU wheel; the project's range then accepts it
  # instead of pulling a multi-GB CUDA build. Set MILES_TORCH_SPEC to use another torch, MILES_TORCH_INDEX to take
  # it from another index (scripts/install.sh sets both for CUDA and ROCm builds).
  "$VENV/bin/python" -m pip install -q ${MILES_TORCH_INDEX:+--index-url "$MILES_TORCH_INDEX"} \
    "${MILES_TORCH_SPEC:-torch==2.13.0}"
  # mpi: mpi4py's wheels load the system MPI at run time; without one the MPI tier skips (CI installs Open MPI).
  # megatron: megatron-core for train.backend=megatron (2.4 MB; the CPU tests patch its CUDA-only helpers).
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,mpi,megatron]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
