"""The processes of a run launched by a scheduler (stage: loop; docs/design.md section 3): what `miles-hpc prepare` and
`miles-hpc worker --role train|rollout` do under srun (or mpirun, torchrun).

A Slurm heterogeneous job runs, in its batch script:

    miles-hpc prepare CONFIG [overrides]            # run dir, resolved config, starting model, keys; once
    srun --het-group=1 miles-hpc worker --role rollout RUN/config.yaml --het-group 1 &
    srun --het-group=0 miles-hpc worker --role train RUN/config.yaml --het-group 0
    miles-hpc worker --role shutdown RUN/config.yaml # whatever happened to training: the rollout step ends

Files in ``RUN/rendezvous/`` are the only coordination (a shared file system, no Ray): ``engine-<i>.json`` when
engine ``i`` listens (``.starting.json`` with its node when it begins), ``trainer.json`` with the master port
rank 0 chose (cluster/bootstrap.py), and ``shutdown`` once training has ended, for any reason, which stops every
rollout worker (so rollout nodes never idle until the walltime).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miles_hpc.atomic import write_text_atomic
from miles_hpc.cluster.bootstrap import Placement, bootstrap, master_port
from miles_hpc.cluster.lease import PARENT_PID_ENV
from miles_hpc.config import RunConfig
from miles_hpc.launch.local import attached_engines, engine_launch, write_key
from miles_hpc.launch.run_dir import RunPaths, lock_run_dir, prepare_run_dir, resolve_model
from miles_hpc.launch.sglang_engine import dist_attempt, engine_task, start_sglang

SHUTDOWN = "shutdown"
KEYS = ("api_key", "admin_api_key")


def prepare(cfg: RunConfig) -> RunPaths:
    """Once per job, before any worker: the run directory, the resolved config, the starting model, the API keys
    (kept across requeues: engines and trainer of one run share them), and no rendezvous left from before. First
    the megatron layout is checked against the training nodes' memory (`launch/layout_check.py`: ConfigError)."""
    from miles_hpc.launch.layout_check import check_train_layout

    print(f"[miles-hpc] {check_train_layout(cfg)}", file=sys.stderr, flush=True)
    lock_run_dir(Path(cfg.run_dir), hold=False)  # not while an earlier job's controller still runs (requeue)
    paths = prepare_run_dir(cfg)
    resolve_model(cfg, paths)
    for name in KEYS:
        if not (paths.root / "keys" / name).is_file():
            write_key(paths.root / "keys" / name)
    paths.rendezvous.mkdir(parents=True, exist_ok=True)
    for stale in paths.rendezvous.iterdir():  # a requeued job must not find the previous attempt's engines
        if stale.is_file():
            stale.unlink()
    return paths


def _read_key(paths: RunPaths, name: str) -> str:
    path = paths.root / "keys" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `miles-hpc prepare` (the batch script's first line) first")
    return path.read_text().strip()


def run_rollout_worker(cfg: RunConfig, het_group: int | None = None) -> int:
    """One engine (or, for SGLang engines spanning nodes, one node of one) per task: ``miles-hpc serve`` for the
    run's model, index = the task's rank in its step (launch/sglang_engine.py for SGLang); returns when
    ``RUN/rendezvous/shutdown`` appears (or Slurm signals us). An engine that dies is started again, at most
    ``rollout.engine_restarts`` times (its record is removed first; the controller follows the new one); the other
    nodes of a multi-node engine restart theirs when its node 0 does."""
    from miles_hpc.rollout.sglang import mark_engine_starting

    paths = RunPaths(Path(cfg.run_dir))
    place = bootstrap(het_group=het_group)
    index, node_rank = engine_task(place.rank, cfg.rollout.engine_nodes)
    _read_key(paths, "api_key")  # fail here, with the fix, rather than in the engine
    model_dir = resolve_model(cfg, paths) if cfg.model.path else paths.init_model
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: run `miles-hpc prepare` first")
    if node_rank == 0:
        mark_engine_starting(paths.rendezvous, index, node=place.node)
    attempt = -1

    def start() -> subprocess.Popen[bytes]:
        nonlocal attempt
        if cfg.rollout.backend == "sglang":
            child, attempt = start_sglang(cfg, paths, model_dir, place.rank, place, after=attempt)
            return child
        placement = {"host": "0.0.0.0"}
        if place.source != "single" and _cuda_available():
            from miles_hpc.cluster.bootstrap import device_index, visible_gpus

            tp = cfg.rollout.engine_tp  # its TP ranks: the next GPUs
            node_gpus = cfg.slurm.gpus_per_node or (place.local_rank + 1) * tp
            placement["device"] = f"cuda:{device_index(place.local_rank, tp, visible_gpus(os.environ, node_gpus))}"
        argv = engine_launch(
            cfg, model_dir, paths.root / "keys", paths.rendezvous / f"engine-{index}.json", index, **placement
        ).argv()
        # The engine ends with this worker, even after its SIGKILL (cluster/lease.py), never serving on alone.
        return subprocess.Popen(argv, env={**os.environ, PARENT_PID_ENV: str(os.getpid())})

    child = start()
    signal.signal(signal.SIGTERM, lambda sig, _frame: child.send_signal(sig))  # scancel/walltime: engine first
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # preemption is the trainer's business (it checkpoints); we go on
    restarts = 0
    try:
        while True:
            if (paths.rendezvous / SHUTDOWN).exists():
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
                    child.wait(60)
                return 0
            if node_rank and (seen := dist_attempt(paths, index)) is not None and seen[0] > attempt:
                print(f"[miles-hpc] engine {index}: node 0 restarted (attempt {seen[0]}): restarting node {node_rank}")
                child.kill()
                child.wait()
                child = start()
                continue
            code = child.poll()
            if code is not None:
                if restarts >= cfg.rollout.engine_restarts:
                    print(f"[miles-hpc] engine {index} on {place.node} exited with code {code}: no restart left")
                    return code
                restarts += 1
                # The controller follows engine-<i>.json: it must never see the dead engine's URL again.
                if node_rank == 0:
                    (paths.rendezvous / f"engine-{index}.json").unlink(missing_ok=True)
                print(f"[miles-hpc] engine {index} on {place.node} exited with code {code}: restart {restarts}")
                time.sleep(min(30.0, 2.0**restarts))
                child = start()
            time.sleep(0.5)
    finally:
        if child.poll() is None:
            child.kill()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def train_placement(cfg: RunConfig, het_group: int | None = None) -> tuple[Placement, dict[str, str]]:
    """This trainer rank's placement and its torchrun-style world variables (rank 0 picks the master port)."""
    place = bootstrap(het_group=het_group)
    if place.world_size != cfg.train.world_size:
        raise ValueError(
            f"train.world_size is {cfg.train.world_size} but the launcher started {place.world_size} "
            f"trainer tasks ({place.source}): make them agree (sbatch --ntasks of the training "
            "component)"
        )
    place = master_port(place, RunPaths(Path(cfg.run_dir)).rendezvous, name="trainer")
    return place, place.env()


def run_scheduled_train_worker(cfg: RunConfig, het_group: int | None = None) -> dict[str, Any] | None:
    """A trainer rank under srun/mpirun: rank 0 waits for the engines and runs the loop (then says ``shutdown``);
    the others follow it. Returns rank 0's summary."""
    from miles_hpc.launch.controller import controller, follow_controller
    from miles_hpc.launch.signals import StopControl
    from miles_hpc.rollout.sglang import wait_for_engines

    paths = RunPaths(Path(cfg.run_dir))
    place, world_env = train_placement(cfg, het_group)
    model_dir = resolve_model(cfg, paths) if cfg.model.path else paths.init_model
    if place.rank != 0:
        _follower_signals()
        follow_controller(cfg, model_dir, world_env)
        return None
    lock_run_dir(paths.root)  # the controller's process holds the run directory while it runs
    # SIGTERM/SIGINT/USR2 to the task (scancel, `--signal=USR2@N` without `B:`): checkpoint after this step.
    control = StopControl(paths.rendezvous).install()
    try:
        if cfg.rollout.engine_urls:  # engines this run did not start (a shared pool, another job)
            urls, key, admin = attached_engines(cfg)
        else:
            records = wait_for_engines(paths.rendezvous, cfg.rollout.num_engines, timeout=cfg.rollout.engine_timeout_s)
            urls, key, admin = [r.url for r in records], _read_key(paths, "api_key"), _read_key(paths, "admin_api_key")
        return controller(cfg, paths, model_dir, urls, key, admin, world_env, control=control)
    finally:
        control.restore()
        request_shutdown(paths)


def _follower_signals() -> None:
    """Trainer ranks > 0: rank 0 decides when to stop, so a USR2 is ignored, and under a scheduler (which signals
    every task at once) so is the first SIGTERM/SIGINT: the ranks must live to take part in rank 0's checkpoint. A
    second one ends the rank. A rank that `miles-hpc run` started is only ever signalled by it: it obeys at once."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if os.environ.get(PARENT_PID_ENV):
        return
    seen: set[int] = set()

    def on_signal(sig: int, _frame: object) -> None:
        if sig in seen:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        seen.add(sig)
        print(f"[miles-hpc] trainer rank: {signal.Signals(sig).name} left to rank 0 (again to stop now)", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def request_preempt(paths: RunPaths, why: str = "preempted") -> None:
    """Ask the controller to checkpoint at the end of its current step and return (the batch script's USR2
    handler; the job is then requeued and resumes from that checkpoint)."""
    paths.rendezvous.mkdir(parents=True, exist_ok=True)
    write_text_atomic(paths.rendezvous / "preempt", json.dumps({"why": why, "time": time.time()}) + "\n")


def request_shutdown(paths: RunPaths, why: str = "training ended") -> None:
    """Tell every rollout worker of the run to stop (idempotent: the first reason given stays)."""
    paths.rendezvous.mkdir(parents=True, exist_ok=True)
    if (paths.rendezvous / SHUTDOWN).exists():
        return
    write_text_atomic(
        paths.rendezvous / SHUTDOWN, json.dumps({"why": why, "time": time.time(), "pid": os.getpid()}) + "\n"
    )
