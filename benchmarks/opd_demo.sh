#!/usr/bin/env bash
# On-policy distillation from a larger teacher, on CPU (docs/agents.md, "On-policy distillation").
# 1. teacher: the "small" preset (about 30x the tiny student's parameters) trained on the demo task
#    (configs/tiny_cpu.yaml: supervised format warm-up, then 300 GRPO steps), exported as an HF checkpoint;
# 2. student: a fresh tiny random init (seed 1, no warm-up), 300 steps with the teacher's per-token reverse KL
#    alone, and with it added to the task reward, next to the task reward alone.
# Usage: benchmarks/opd_demo.sh [OUT_DIR]   (default runs/opd_demo; about 25 minutes on 2 cores)
set -euo pipefail
OUT=${1:-runs/opd_demo}
PY=${PYTHON:-python}
mkdir -p "$OUT"
run() { "$PY" -m miles_hpc.cli run "$@"; }

if [ ! -f "$OUT/teacher_ckpt/config.json" ]; then
  run configs/tiny_cpu.yaml model.init_size=small run_dir="$OUT/teacher" resume=false
  "$PY" -m miles_hpc.cli export "$OUT/teacher" "$OUT/teacher_ckpt"
fi
STUDENT=(seed=1 train.world_size=1 train.sft_warmup_steps=0 train.lr=3e-3 resume=false)
run configs/tiny_cpu.yaml "${STUDENT[@]}" run_dir="$OUT/student_opd" \
  algo.opd_teacher="$OUT/teacher_ckpt" algo.opd_only=true
run configs/tiny_cpu.yaml "${STUDENT[@]}" run_dir="$OUT/student_opd_reward" algo.opd_teacher="$OUT/teacher_ckpt"
run configs/tiny_cpu.yaml "${STUDENT[@]}" run_dir="$OUT/student_reward"
"$PY" benchmarks/opd_summary.py "$OUT/teacher" "$OUT/student_opd" "$OUT/student_opd_reward" "$OUT/student_reward"
