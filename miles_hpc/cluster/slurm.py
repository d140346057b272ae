"""The Slurm batch script of a run, as a pure function of its config (stage: cluster; docs/design.md sections 3 and 10).

`render_sbatch(cfg, config_path, overrides)` gives a heterogeneous job (component 0: `train.world_size` trainer
ranks, component 1: `rollout.num_engines` engines) or, with `slurm.mode: split`, one allocation whose node list is
split by role (for sites that forbid hetjobs). House style (docs/design.md section 10): `set -euo pipefail`, START/END
stamps, `# EDIT` on site values, `srun --kill-on-bad-exit=1 --wait=60`, `--signal=B:USR2@N` + `--requeue` with a
handler that has the trainer checkpoint at the end of its step and then requeues the job, offline by default,
a short TMPDIR, debug variables present but commented out.

The script's flow is launch/workers.py's: `miles-hpc prepare`, the rollout step in the background, the training
step, then `worker --role shutdown` whatever training did, so rollout nodes never idle until the walltime.
"""

from __future__ import annotations

import shlex

from miles_hpc.config import RunConfig

__all__ = ["render_sbatch"]


def _sbatch_lines(cfg: RunConfig, *, nodes: int, ntasks: int, partition: str | None) -> list[str]:
    s = cfg.slurm
    per_node = [f"#SBATCH --ntasks-per-node={ntasks // nodes}"] if ntasks % nodes == 0 and nodes > 1 else []
    lines = [
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks={ntasks}",
        *per_node,
        f"#SBATCH --cpus-per-task={s.cpus_per_task}",
    ]
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}  # EDIT")
    if s.mem:
        lines.append(f"#SBATCH --mem={s.mem}")
    return lines


def _header(cfg: RunConfig) -> list[str]:
    s = cfg.slurm
    lines = [
        "#!/bin/bash",
        "# Rendered by `miles-hpc submit --dry-run` from the run's config: change the config (its",
        "# slurm: section) and render again rather than editing here. Extra key=value arguments to sbatch",
        "# override the config.",
        f"#SBATCH --job-name={cfg.name}",
        f"#SBATCH --time={s.time}",
        f"#SBATCH --output={s.output or cfg.run_dir + '/logs/slurm-%j.out'}",
    ]
    if s.account:
        lines.append(f"#SBATCH --account={s.account}  # EDIT")
    if s.qos:
        lines.append(f"#SBATCH --qos={s.qos}  # EDIT")
    if s.signal_s:
        lines.append(f"#SBATCH --signal=B:USR2@{s.signal_s}  # USR1 may be taken by NCCL")
    if s.requeue:
        lines.append("#SBATCH --requeue")
    lines += [f"#SBATCH {x}" for x in s.extra_sbatch]
    return lines


_ENV = """\
set -euo pipefail
echo "START $(date -u +%FT%TZ) job ${SLURM_JOB_ID} attempt ${SLURM_RESTART_COUNT:-0} on $(hostname)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # compute nodes have no internet
export TMPDIR="/tmp/mh-${SLURM_JOB_ID}"  # short: unix socket paths have a 107-byte limit
mkdir -p "$TMPDIR"
export PYTHONUNBUFFERED=1
# export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET   # debug a hang at the first collective
# export TORCH_DISTRIBUTED_DEBUG=DETAIL
# export FI_LOG_LEVEL=warn                            # libfabric (Slingshot)
"""

_PREEMPT = """\
REQUEUE=0
on_usr2() {  # walltime or preemption: the trainer checkpoints after its current step, then we requeue
  echo "[miles-hpc] USR2 at $(date -u +%FT%TZ): checkpoint, then requeue"
  miles-hpc worker --role preempt "$CONFIG" || true
  REQUEUE=1
}
trap on_usr2 USR2
"""

_FINISH = """\
wait_for() {  # a trap interrupts `wait`: wait again until the process has really ended
  local rc=0
  while kill -0 "$1" 2>/dev/null; do wait "$1" && rc=0 || rc=$?; done
  wait "$1" 2>/dev/null && rc=0 || rc=${rc}
  return "$rc"
}
TRAIN_RC=0
wait_for "$TRAIN" || TRAIN_RC=$?
miles-hpc worker --role shutdown "$CONFIG"  # whatever training did: the rollout step ends now
wait_for "$ROLLOUT" || true
if [ "$REQUEUE" = 1 ]; then
  echo "[miles-hpc] requeueing job ${SLURM_JOB_ID}"
  scontrol requeue "$SLURM_JOB_ID"
fi
echo "END $(date -u +%FT%TZ) training exit ${TRAIN_RC}"
exit "$TRAIN_RC"
"""


def _binding(cfg: RunConfig, gpus_per_task: int) -> str:
    s = cfg.slurm
    gpus = (
        f" ${{MILES_GPU_BIND:+--gpus-per-task={gpus_per_task} --gpu-bind=$MILES_GPU_BIND}}" if s.gpus_per_node else ""
    )
    return f"-c {s.cpus_per_task}{gpus}"


def render_sbatch(cfg: RunConfig, config_path: str, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The batch script for ``cfg``, read by the job from ``config_path`` with ``overrides`` (a pure function)."""
    s = cfg.slurm
    ntrain, nroll = cfg.train.world_size, cfg.rollout.num_engines * cfg.rollout.engine_nodes  # a task per engine node
    lines = _header(cfg)
    if s.mode == "hetjob":
        lines += ["# component 0: training"]
        lines += _sbatch_lines(cfg, nodes=s.train_nodes, ntasks=ntrain, partition=s.partition)
        lines += ["#SBATCH hetjob", "# component 1: rollout"]
        lines += _sbatch_lines(cfg, nodes=s.rollout_nodes, ntasks=nroll, partition=s.rollout_partition or s.partition)
    else:
        lines += ["# one allocation: the first train_nodes nodes train, the others run the engines"]
        lines += _sbatch_lines(cfg, nodes=s.train_nodes + s.rollout_nodes, ntasks=ntrain + nroll, partition=s.partition)
    body = [_ENV]
    if s.site:
        body.append(f"source {shlex.quote(s.site)}  # site settings (ROCm/RCCL, NICs)\n")
    if s.setup:
        body.append("# EDIT: environment\n" + "".join(f"{x}\n" for x in s.setup))
    args = " ".join(shlex.quote(x) for x in (config_path, *overrides))
    body.append(
        "# run dir, resolved config, starting model, keys; extra key=value arguments of sbatch override "
        "the config\n"
        f'CONFIG=$(miles-hpc prepare --batch {args} "$@" | tail -n 1)\nRUN=$(dirname "$CONFIG")\n'
    )
    body.append(_PREEMPT)
    srun = "srun --kill-on-bad-exit=1 --wait=60"
    # Binding: CPUs per task on every srun (Slurm 22.05+ does not pass sbatch's --cpus-per-task on to srun); with
    # GPUs and a site file that sets MILES_GPU_BIND (e.g. closest: ROCm sites bind each task to its GPUs), each task
    # gets its own GPUs (a trainer rank one, an engine task engine_tp / engine_nodes) and indexes them from 0
    # (cluster/bootstrap.device_index); unset, every task sees its node's GPUs and takes its block by local rank.
    bind_train = _binding(cfg, 1)
    bind_roll = _binding(cfg, cfg.rollout.engine_tp // cfg.rollout.engine_nodes)
    if s.mode == "hetjob":
        rollout = f'{srun} --het-group=1 {bind_roll} miles-hpc worker --role rollout "$CONFIG" --het-group 1 &'
        train = f'{srun} --het-group=0 {bind_train} miles-hpc worker --role train "$CONFIG" --het-group 0 &'
    else:
        body.append(
            'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")\n'
            f'TRAIN_NODES=$(IFS=,; echo "${{NODES[*]:0:{s.train_nodes}}}")\n'
            f'ROLLOUT_NODES=$(IFS=,; echo "${{NODES[*]:{s.train_nodes}}}")\n'
        )
        rollout = (
            f'{srun} --nodes={s.rollout_nodes} --ntasks={nroll} --nodelist="$ROLLOUT_NODES" {bind_roll} '
            'miles-hpc worker --role rollout "$CONFIG" &'
        )
        train = (
            f'{srun} --nodes={s.train_nodes} --ntasks={ntrain} --nodelist="$TRAIN_NODES" {bind_train} '
            'miles-hpc worker --role train "$CONFIG" &'
        )
    body.append(f"{rollout}\nROLLOUT=$!\n{train}\nTRAIN=$!\n")
    body.append(_FINISH)
    return "\n".join(lines) + "\n\n" + "\n".join(body)
