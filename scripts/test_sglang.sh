#!/usr/bin/env bash
# SGLang schema-conformance tier: check every request body our rollout client sends, and every flag our launcher
# passes, against the real sglang package's own definitions (io_struct dataclasses, SamplingParams, ServerArgs).
#
# sglang pulls a CUDA torch (~11 GB, ~3.5 min to install), so it lives in its OWN venv (default .venv-sglang), never
# in the main .venv. Our side of the check imports only miles_hpc/rollout/requests.py and sglang_launch.py, which need
# nothing but the stdlib, so the project itself is not installed there.
#
# Env: SGLANG_VENV (venv path), SGLANG_SPEC (pip spec, default sglang==0.5.23; falls back to the newest that installs),
#      PYTHON (interpreter that creates the venv). Extra args go to the check script (e.g. -v); --install-only
#      makes the venv and stops (CI then runs the check through pytest: tests/test_sglang_schema.py).
set -euo pipefail
START=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
SPEC="${SGLANG_SPEC:-sglang==0.5.23}"
PYTHON="${PYTHON:-python3}"

if [ "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd)/$(basename "$VENV")" = "$ROOT/.venv" ]; then
  echo "refusing to install sglang into the main venv ($VENV): it replaces the CPU torch" >&2
  exit 2
fi

STAMP="$VENV/.sglang-installed"
if [ ! -f "$STAMP" ]; then
  # The install peaks at ~14 GB on disk (venv + unpacked wheels): say so before pip fails half-way with ENOSPC.
  FREE_GB=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$FREE_GB" -lt 16 ]; then
    echo "[test_sglang] only ${FREE_GB} GB free under $(dirname "$VENV"); the sglang venv needs ~16 GB" \
      "(set SGLANG_VENV to a roomier disk)" >&2
    df -h "$(dirname "$VENV")" >&2
    exit 3
  fi
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  echo "[test_sglang] installing $SPEC into $VENV (CUDA torch: ~11 GB, a few minutes) ..." >&2
  if ! "$VENV/bin/python" -m pip install -q --no-cache-dir "$SPEC"; then
    echo "[test_sglang] $SPEC did not install; trying the newest sglang that does" >&2
    "$VENV/bin/python" -m pip install -q --no-cache-dir sglang
  fi
  touch "$STAMP"
fi

"$VENV/bin/python" -c 'import importlib.metadata as m; print("[test_sglang] sglang", m.version("sglang"), "torch", m.version("torch"))'
if [ "${1:-}" = "--install-only" ]; then exit 0; fi
"$VENV/bin/python" "$ROOT/tests/sglang_schema_check.py" "$@"
echo "[test_sglang] done in $(( $(date +%s) - START )) s"
