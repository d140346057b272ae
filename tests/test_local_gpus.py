"""`miles-hpc run` on GPUs: where trainer ranks and engines go (launch/local.py `gpu_plan`), what the weight sync
can reach from there (refused before anything starts, naming the key), and the engines' command lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_hpc.config import ConfigError, load_config
from miles_hpc.engine.launch import EngineLaunch
from miles_hpc.launch.local import LocalCluster, gpu_plan

REPO = Path(__file__).resolve().parents[1]


def cfg(*overrides: str):
    return load_config(REPO / "configs/tiny_cpu.yaml", list(overrides))


def test_one_gpu_shared_by_trainer_and_engine_with_colocated_sync() -> None:
    plan = gpu_plan(
        cfg("train.device=cuda", "rollout.device=cuda", "train.world_size=1", "sync.strategy=colocated"), num_gpus=1
    )
    assert plan.trainer == (0,) and plan.engines == (0,) and plan.shares_trainer_gpu(0)


def test_engines_go_after_the_trainer_gpus_and_wrap_around() -> None:
    plan = gpu_plan(
        cfg(
            "train.device=cuda",
            "rollout.device=cuda",
            "train.world_size=2",
            "rollout.num_engines=3",
            "sync.strategy=colocated",
        ),
        num_gpus=4,
    )
    assert plan.trainer == (0, 1) and plan.engines == (2, 3, 0)
    assert not plan.shares_trainer_gpu(0) and plan.shares_trainer_gpu(2)
    plan = gpu_plan(cfg("train.device=cuda", "rollout.device=cuda", "train.world_size=1"), num_gpus=2)
    assert plan.engines == (1,)  # broadcast over NCCL between GPU 0 and GPU 1
    assert gpu_plan(cfg(), num_gpus=8) == gpu_plan(cfg(), num_gpus=0)  # the CPU default uses no GPU
    assert gpu_plan(cfg(), num_gpus=0).engines == ()


@pytest.mark.parametrize(
    "gpus, overrides, match",
    [
        (1, ("train.device=cuda", "rollout.device=cuda", "train.world_size=1"), "NCCL refuses two ranks.*colocated"),
        (2, ("train.device=cuda", "rollout.device=cuda", "train.world_size=2", "sync.strategy=p2p"), "NCCL refuses"),
        (1, ("train.device=cuda", "train.world_size=2"), "train.world_size=2 ranks on its own GPU; this machine has 1"),
        (1, ("train.device=cuda", "train.world_size=1"), "train.device=cuda and rollout.device=cpu differ"),
        (1, ("train.device=cuda", "train.world_size=1", "sync.strategy=colocated"), "set rollout.device=cuda"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_key(gpus: int, overrides: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        gpu_plan(cfg(*overrides), num_gpus=gpus)
    with pytest.raises(ConfigError, match="rollout.device: cuda, but this machine has no GPU"):
        gpu_plan(cfg("rollout.device=cuda", "sync.strategy=delta"), num_gpus=0)
    gpu_plan(cfg("train.device=cuda", "train.world_size=1", "sync.strategy=delta"), num_gpus=1)  # files: any mix


@pytest.mark.process
def test_engine_command_lines_name_their_gpu_and_kv_share(tmp_path: Path) -> None:
    c = cfg(
        "train.device=cuda",
        "rollout.device=cuda",
        "train.world_size=1",
        "rollout.num_engines=2",
        "sync.strategy=colocated",
    )
    cluster = LocalCluster(c, tmp_path, tmp_path / "model", tmp_path / "config.yaml", gpu_plan(c, num_gpus=2))
    spawned: list[list[str]] = []
    cluster._spawn = lambda name, argv, env=None: spawned.append(argv)  # type: ignore[method-assign]
    cluster._wait_engines = lambda n, timeout_s: []  # type: ignore[method-assign]  # nothing was started
    cluster.start_engines()
    launches = [EngineLaunch.parse(argv[4:]) for argv in spawned]  # what each `miles-hpc serve` will run with
    assert [(e.device, e.kv_cache_fraction) for e in launches] == [("cuda:1", 0.85), ("cuda:0", 0.25)]


@pytest.mark.process
def test_run_refuses_before_anything_starts(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={tmp_path / 'run'}",
        "train.device=cuda",
        "train.world_size=64",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "train.device: cuda puts each of train.world_size=64 ranks" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
def test_tiny_loop_on_one_gpu_with_colocated_sync(tmp_path: Path) -> None:
    # Trainer rank and engine share GPU 0; weights go by CUDA IPC and every version is verified by checksums.
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={run_dir}",
        "steps=3",
        "train.world_size=1",
        "train.device=cuda",
        "rollout.device=cuda",
        "sync.strategy=colocated",
        "train.sft_warmup_steps=5",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in m] == [1, 2, 3] and all(r["sync/engines"] == 1 for r in m)


def test_local_processes_share_the_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each local process gets the machine's CPUs shared out as intra-op threads (OMP_NUM_THREADS in its
    environment, torch.set_num_threads in the run itself), unless the user set OMP_NUM_THREADS."""
    from miles_hpc.launch.local import local_processes, threads_per_process

    demo = cfg()  # 2 trainer ranks, 1 engine
    assert local_processes(demo) == 3
    assert [threads_per_process(demo, n) for n in (1, 2, 3, 8, 128)] == [1, 1, 1, 2, 42]
    tp = cfg("rollout.num_engines=2", "rollout.engine_tp=2")
    assert local_processes(tp) == 6 and threads_per_process(tp, 64) == 10
    attached = cfg("rollout.engine_urls=[http://10.0.0.1:30000]")
    assert local_processes(attached) == 2  # engines of another allocation compute elsewhere
    taught = cfg(f"algo.opd_teacher={tmp_path}", "rollout.num_engines=3")
    assert local_processes(taught) == 6  # 2 ranks, 3 engines, the teacher's engine
    assert local_processes(cfg("algo.opd_teacher=http://10.0.0.2:30000")) == 3

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cluster = LocalCluster(demo, tmp_path, tmp_path / "model", tmp_path / "config.yaml")
    expected = max(1, len(os.sched_getaffinity(0)) // 3)
    assert cluster.threads == expected and cluster.child_env == {"OMP_NUM_THREADS": str(expected)}
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    cluster = LocalCluster(demo, tmp_path, tmp_path / "model", tmp_path / "config.yaml")
    assert cluster.threads is None and cluster.child_env == {}


def test_free_ports_are_picked_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch/local.free_port: a port no outgoing connection can take before its listener binds it; where the
    ephemeral range leaves too little room below it, the kernel's own pick."""
    from miles_hpc.launch import local

    low, _ = local._ephemeral_range()
    ports = {local.free_port() for _ in range(20)}
    if low - local._LOWEST_PICKED >= 1000:
        assert all(local._LOWEST_PICKED <= p < low for p in ports) and len(ports) > 1
    assert all(local._bindable(p) for p in ports)
    monkeypatch.setattr(local, "_ephemeral_range", lambda: (local._LOWEST_PICKED + 10, 60999))
    assert local._bindable(local.free_port())
