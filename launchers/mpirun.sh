#!/usr/bin/env bash
# An MPI-launched run (no Slurm needed): engines and trainer ranks are MPI processes; ranks, local ranks and the
# master come from the MPI launcher (miles_hpc/cluster/bootstrap.py), the rendezvous is RUN/rendezvous/ on a shared
# file system. Under Slurm with PMIx, srun does the same (slurm/*.sbatch).
#   launchers/mpirun.sh CONFIG [key.sub=value ...]
# MPIRUN (default: mpirun) and MPIRUN_ARGS (e.g. "--hostfile hosts --map-by ppr:8:node") say how to launch.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CONFIG [key.sub=value ...]" >&2; exit 2; }
MPIRUN=${MPIRUN:-mpirun}
read -r -a EXTRA <<<"${MPIRUN_ARGS:-}"
RUN_CONFIG=$(miles-hpc prepare "$@")   # run dir, resolved config, starting model, keys (prints RUN/config.yaml)
value() { python3 -c "import sys,yaml; d=yaml.safe_load(open(sys.argv[1])); print(d[sys.argv[2]][sys.argv[3]])" "$RUN_CONFIG" "$@"; }
ENGINES=$(value rollout num_engines)
TRAINERS=$(value train world_size)
"$MPIRUN" "${EXTRA[@]}" -np "$ENGINES" miles-hpc worker --role rollout "$RUN_CONFIG" &
rollout=$!
trap 'miles-hpc worker --role shutdown "$RUN_CONFIG"; wait "$rollout" || true' EXIT  # rollout ends with training
"$MPIRUN" "${EXTRA[@]}" -np "$TRAINERS" miles-hpc worker --role train "$RUN_CONFIG"
