#!/usr/bin/env bash
# A run on one node under torchrun: torchrun starts the trainer ranks (RANK/WORLD_SIZE/MASTER_* are torchrun's,
# read by miles_hpc/cluster/bootstrap.py), a second torchrun the engines (its RANK is the engine index).
#   launchers/torchrun.sh CONFIG [key.sub=value ...]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CONFIG [key.sub=value ...]" >&2; exit 2; }
RUN_CONFIG=$(miles-hpc prepare "$@")   # run dir, resolved config, starting model, keys (prints RUN/config.yaml)
value() { python3 -c "import sys,yaml; d=yaml.safe_load(open(sys.argv[1])); print(d[sys.argv[2]][sys.argv[3]])" "$RUN_CONFIG" "$@"; }
ENGINES=$(value rollout num_engines)
TRAINERS=$(value train world_size)
torchrun --standalone --nproc-per-node "$ENGINES" -m miles_hpc.cli worker --role rollout "$RUN_CONFIG" &
rollout=$!
trap 'miles-hpc worker --role shutdown "$RUN_CONFIG"; wait "$rollout" || true' EXIT  # rollout ends with training
torchrun --standalone --nproc-per-node "$TRAINERS" -m miles_hpc.cli worker --role train "$RUN_CONFIG"
