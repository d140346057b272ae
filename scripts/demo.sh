#!/usr/bin/env bash
# The main job on the embedded default: a tiny model, our engine, FSDP2 on CPU. Extra args are config overrides.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec miles-hpc run configs/tiny_cpu.yaml "$@"
