#!/usr/bin/env bash
# Lint and types, as CI runs them (before the tests): ruff's rules, ruff's formatting (check only), mypy.
# `--fix` lets ruff fix and format instead of checking. Versions are pinned in pyproject's dev extra.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
PATHS=(miles_hpc tests benchmarks scripts launchers)
if [[ "${1:-}" == "--fix" ]]; then
  ruff check --fix "${PATHS[@]}"
  ruff format "${PATHS[@]}"
else
  ruff check "${PATHS[@]}"
  ruff format --check "${PATHS[@]}"
fi
mypy   # [tool.mypy] in pyproject.toml: the package and the Python launchers
