#!/usr/bin/env bash
# Install only (a cluster's login node): the project's venv with a torch for the compute nodes' GPUs, and SGLang's
# own venv beside it. Nothing is run. docs/hpc.md, "Set-up on a cluster".
#
#   scripts/install.sh --gpu cuda [--sglang]        # NVIDIA: torch from PyTorch's CUDA index
#   scripts/install.sh --gpu rocm [--sglang]        # AMD: torch from PyTorch's ROCm index
#   scripts/install.sh --gpu cpu                    # CPU torch (laptops, CI)
#   scripts/install.sh --gpu cuda --download DIR    # on a machine with internet: every wheel into DIR, to copy over
#   scripts/install.sh --gpu cuda --from DIR        # on the offline cluster: install from DIR only (--no-index)
#   scripts/install.sh ... --dry-run                # print what would run
#
# Env: MILES_VENV (default .venv), SGLANG_VENV (default .venv-sglang), MILES_TORCH_SPEC (default torch==2.13.0),
#      MILES_TORCH_INDEX (default per --gpu below: EDIT to the CUDA or ROCm release of your nodes' driver),
#      SGLANG_SPEC (default sglang==0.5.23, the release preflight accepts), PYTHON (a Python >= 3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPU="" SGLANG=0 DOWNLOAD="" FROM="" DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) GPU="${2:-}"; shift 2 ;;
    --sglang) SGLANG=1; shift ;;
    --download) DOWNLOAD="${2:-}"; shift 2 ;;
    --from) FROM="${2:-}"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$GPU" in
  cuda) INDEX="${MILES_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}" ;;
  rocm) INDEX="${MILES_TORCH_INDEX:-https://download.pytorch.org/whl/rocm6.4}" ;;
  cpu) INDEX="${MILES_TORCH_INDEX:-}" ;;
  *) echo "install.sh: --gpu cuda, rocm or cpu is required (the compute nodes' GPUs)" >&2; exit 2 ;;
esac
if [ -n "$DOWNLOAD" ] && [ -n "$FROM" ]; then
  echo "install.sh: --download (online machine) and --from (offline cluster) are two steps: use one" >&2; exit 2
fi
TORCH="${MILES_TORCH_SPEC:-torch==2.13.0}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"
run() { if [ "$DRY" = 1 ]; then echo "+ $*"; else "$@"; fi; }

if [ -n "$DOWNLOAD" ]; then
  run mkdir -p "$DOWNLOAD"
  run "${PYTHON:-python3}" -m pip download -q -d "$DOWNLOAD" ${INDEX:+--index-url "$INDEX"} "$TORCH"
  # what _venv.sh installs, and the build backend of the editable install (pip download does not keep it)
  run "${PYTHON:-python3}" -m pip download -q -d "$DOWNLOAD" "$ROOT[dev,mpi,megatron]" "setuptools>=68" wheel pip
  [ "$SGLANG" = 1 ] && run "${PYTHON:-python3}" -m pip download -q -d "$DOWNLOAD/sglang" "$SGLANG_SPEC"
  echo "[install] copy $DOWNLOAD and this checkout to the cluster, then: scripts/install.sh --gpu $GPU --from DIR" >&2
  exit 0
fi
if [ -n "$FROM" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$FROM"  # pip reads both: nothing is fetched
  INDEX=""
fi
if [ "$DRY" = 1 ]; then
  echo "+ MILES_TORCH_SPEC=$TORCH MILES_TORCH_INDEX=${INDEX} source scripts/_venv.sh  # ${MILES_VENV:-$ROOT/.venv}"
else
  MILES_TORCH_SPEC="$TORCH" MILES_TORCH_INDEX="$INDEX" source "$ROOT/scripts/_venv.sh"
  python -c "import torch, miles_hpc; print('[install] torch', torch.__version__, '| cuda', torch.version.cuda, '| hip', torch.version.hip)"
fi
if [ "$SGLANG" = 1 ]; then
  [ -n "$FROM" ] && export PIP_FIND_LINKS="$FROM/sglang"
  run env SGLANG_SPEC="$SGLANG_SPEC" "$ROOT/scripts/test_sglang.sh" --install-only
  echo "[install] set rollout.sglang_python: ${SGLANG_VENV:-$ROOT/.venv-sglang}/bin/python" >&2
fi
