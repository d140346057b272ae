#!/usr/bin/env bash
# Reward vs wall-clock, sync against fully async, on the long-tailed echo task (configs/tiny_echo.yaml), on the CPU
# or on one GPU (trainer and engine share it: colocated weight sync). Prints bench_async-style JSON lines (one per
# run: final reward, wall time, when it reached the sync run's final reward) and writes OUT/reward.svg.
# Usage: benchmarks/async_reward.sh cpu|gpu [OUT_DIR] [extra overrides...]
set -euo pipefail
WHERE=${1:?cpu or gpu}; shift
OUT=${1:-runs/async_reward_$WHERE}; shift || true
PY=${PYTHON:-python}
mkdir -p "$OUT"
case "$WHERE" in
  cpu) DEV=() ;;
  gpu) DEV=(train.device=cuda rollout.device=cuda sync.strategy=colocated) ;;
  *) echo "first argument: cpu or gpu, got $WHERE" >&2; exit 2 ;;
esac
for mode in sync fully_async; do
  "$PY" -m miles_hpc.cli run configs/tiny_echo.yaml mode=$mode run_dir="$OUT/$mode" resume=false "${DEV[@]}" "$@" \
    > "$OUT.$mode.log" 2>&1 || { tail -20 "$OUT.$mode.log" >&2; exit 1; }
done
"$PY" benchmarks/plot_reward.py "$OUT/sync" "$OUT/fully_async" --labels sync,fully_async \
  --title "echo task, $WHERE: reward vs wall-clock" --out "$OUT/reward.svg"
