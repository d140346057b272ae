"""The run as a real Slurm job on the local cluster (marker ``slurm``; tests/slurm_support.py starts it).

`sbatch slurm/tiny_cpu.sbatch` runs the demo as a two-component heterogeneous job (2 trainer ranks on one node, the
engine on the other), to completion, and the rollout step ends with training. Preemption: a USR2 to the batch
shell (what `--signal=B:USR2@N` sends before the walltime) makes the trainer checkpoint after its step; the job
requeues itself, resumes from that checkpoint and finishes with every step trained once and no sample lost. A sweep
is one array job, a task per grid point, each in its own run directory, tabulated by `miles-hpc sweep-report`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require
from slurm_support import FINAL, SlurmCluster, slurm_cluster_fixture  # noqa: F401  (the fixture `slurm_cluster`)

from miles_hpc.config import load_config
from miles_hpc.data import TrajectoryReader

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=4",
    "train.sft_warmup_steps=0",
    "slurm.shared_fs_check=false",  # the local cluster's nodes are one host: its local disk is "shared"
]


def submit(cluster: SlurmCluster, run_dir: Path, *overrides: str) -> str:
    """`sbatch slurm/tiny_cpu.sbatch key=value...` from the repository (as a user would), log in the test's dir."""
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--output={cluster.workdir}/tiny-%j.out",
            "slurm/tiny_cpu.sbatch",
            f"run_dir={run_dir}",
            *SMALL,
            *overrides,
        ],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def log(cluster: SlurmCluster, job: str) -> str:
    path = cluster.workdir / f"tiny-{job}.out"
    return path.read_text() if path.exists() else "(no log)"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_hetjob_runs_the_demo_and_tears_rollout_down(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = submit(slurm_cluster, run_dir, "steps=3")
    state = slurm_cluster.wait(job, timeout=300)
    out = log(slurm_cluster, job)
    assert state == "COMPLETED", out[-4000:]
    assert [r["weight_version"] for r in metrics(run_dir)] == [1, 2, 3]
    assert "END " in out and "training exit 0" in out
    # The components ran on different nodes: the engine on component 1's, the trainer's master on component 0's.
    engine_node = json.loads((run_dir / "rendezvous" / "engine-0.starting.json").read_text())["node"]
    records = {r.get("HetJobOffset", "0"): r for r in slurm_cluster.records(job)}
    assert engine_node == records["1"]["NodeList"] != records["0"]["NodeList"]
    assert json.loads((run_dir / "rendezvous" / "shutdown").read_text())["why"] == "training ended"


def test_usr2_checkpoints_requeues_and_resumes_without_losing_a_sample(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # Long enough that the signal lands mid-run: a step takes ~0.2 s here, and at 30 steps a run finished before a
    # slow scancel delivered USR2 (the requeued job then resumed at its end, with no preemption checkpoint).
    steps = 120
    job = submit(slurm_cluster, run_dir, f"steps={steps}")
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3):
        assert time.monotonic() < deadline, log(slurm_cluster, job)[-4000:]
        time.sleep(0.2)
    slurm_cluster.run("scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@180 sends
    while not any(r.get("Restarts", "0") != "0" for r in slurm_cluster.records(job)):
        assert time.monotonic() < deadline, "the job was not requeued: " + log(slurm_cluster, job)[-4000:]
        time.sleep(0.2)
    # Slurm holds a requeued job for a while (about 2 min here) before it may start again; a test need not wait
    # that long, but a start in the same second as the requeue is refused ("Job credential revoked").
    time.sleep(3)
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    state = slurm_cluster.wait(job, timeout=max(10.0, deadline - time.monotonic()))
    assert state == "COMPLETED", log(slurm_cluster, job)[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps)), [r["step"] for r in rows]  # each step once, in order
    resumed_at = [p.name for p in sorted((run_dir / "checkpoints").iterdir())]
    assert len(resumed_at) >= 2, resumed_at  # the preemption checkpoint and the final one
    assert f"step_{steps}" in resumed_at and min(int(n.split("_")[1]) for n in resumed_at) < steps, resumed_at
    trained = sorted(s.train_step for s in TrajectoryReader(run_dir / "trajectories"))
    assert trained == sorted(list(range(steps)) * 4), "every step's 4 samples, once"


def test_sweep_runs_one_array_task_per_grid_point(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_hpc.cli",
            "sweep",
            "--grid",
            "train.lr=1e-3,3e-3",
            "configs/tiny_cpu.yaml",
            f"run_dir={root}",
            "steps=2",
            *SMALL,
            "train.world_size=1",
        ],
        cwd=REPO,
        env=slurm_cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split("submitted array job ")[1].split()[0]
    state = slurm_cluster.wait(job, timeout=300)
    logs = "\n".join(p.read_text() for p in root.glob("slurm-*.out"))
    assert state == "COMPLETED", logs[-4000:]
    report = subprocess.run(
        [sys.executable, "-m", "miles_hpc.cli", "sweep-report", str(root), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = json.loads(report)
    assert [(r["train.lr"], r["status"], r["steps"]) for r in rows] == [("1e-3", "done", 2), ("3e-3", "done", 2)]
    for task in json.loads((root / "sweep.json").read_text())["tasks"]:  # each point ran with its own values
        ran = load_config(Path(task["run_dir"]) / "config.yaml")
        assert ran.train.lr == float(task["point"]["train.lr"]) and ran.run_dir == task["run_dir"]


def test_a_preempted_sweep_task_resumes_where_it_stopped(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """An array task signalled as at its walltime (USR2 to its batch shell) checkpoints, requeues itself and, started
    again, resumes: every step once, every step's samples once."""
    root, steps = tmp_path / "sweep", 30
    proc = subprocess.run(
        [
            sys.executable, "-m", "miles_hpc.cli", "sweep", "--grid", "seed=0", "configs/tiny_cpu.yaml",
            f"run_dir={root}", f"steps={steps}", *SMALL, "train.world_size=1",
        ],
        cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    task = proc.stdout.split("submitted array job ")[1].split()[0] + "_0"
    run_dir = Path(json.loads((root / "sweep.json").read_text())["tasks"][0]["run_dir"])

    def logs() -> str:
        return "\n".join(p.read_text() for p in root.glob("slurm-*.out"))[-4000:]

    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3):
        assert time.monotonic() < deadline, logs()
        time.sleep(0.2)
    slurm_cluster.run("scancel", "--signal=USR2", "--batch", task)  # what --signal=B:USR2@N sends
    while not any(r.get("Restarts", "0") != "0" for r in slurm_cluster.records(task)):
        assert time.monotonic() < deadline, "the task was not requeued: " + logs()
        time.sleep(0.2)
    time.sleep(3)  # a start in the second of the requeue is refused (see the hetjob test above)
    slurm_cluster.run("scontrol", "update", f"JobId={task}", "StartTime=now")
    state = slurm_cluster.wait(task, timeout=max(10.0, deadline - time.monotonic()))
    assert state == "COMPLETED", logs()
    assert [r["step"] for r in metrics(run_dir)] == list(range(steps))
    trained = sorted(s.train_step for s in TrajectoryReader(run_dir / "trajectories"))
    assert trained == sorted(list(range(steps)) * 4), "every step's 4 samples, once"


BOOTSTRAP_PROG = """
import json
import shutil
from miles_hpc.cluster.bootstrap import _from_mpi, bootstrap
slurm, mpi = bootstrap(), _from_mpi()
print("PLACE " + json.dumps({"slurm": slurm.as_dict(), "mpi": mpi.as_dict()}), flush=True)
"""


def test_bootstrap_under_srun_pmix_agrees_with_mpi(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Two tasks on two nodes started by `srun --mpi=pmix`: Slurm's variables and MPI (mpi4py over PMIx) give the
    same ranks, world size and master node."""
    require(shutil.which("mpirun") is not None, "Open MPI (its libmpi, loaded by mpi4py in the tasks)")
    prog = tmp_path / "place.py"
    prog.write_text(BOOTSTRAP_PROG)
    script = (
        f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks=2 --ntasks-per-node=1 --time=2\n"
        f"#SBATCH --output={tmp_path}/place-%j.out\n"
        f"srun --mpi=pmix {sys.executable} {prog}\n"
    )
    job = slurm_cluster.sbatch(script)
    state = slurm_cluster.wait(job, timeout=120)
    out = (tmp_path / f"place-{job}.out").read_text()
    assert state == "COMPLETED", out[-3000:]
    places = sorted(
        (json.loads(line.split("PLACE ", 1)[1]) for line in out.splitlines() if "PLACE " in line),
        key=lambda p: p["slurm"]["rank"],
    )
    assert [p["slurm"]["rank"] for p in places] == [p["mpi"]["rank"] for p in places] == [0, 1], out
    assert {p["slurm"]["world_size"] for p in places} == {p["mpi"]["world_size"] for p in places} == {2}
    assert [p["slurm"]["node"] for p in places] == ["n1", "n2"]  # SLURMD_NODENAME: the fake nodes
    assert {p["slurm"]["master_addr"] for p in places} == {"n1"} and {p["slurm"]["source"] for p in places} == {"slurm"}
    assert len({p["mpi"]["master_addr"] for p in places}) == 1  # MPI's view: host names (one real host here)


def _launcher(cluster: SlurmCluster, script: str, *args: str) -> list[str]:
    """``python launchers/<script> ... --wait`` as a user types it; its stdout lines."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "launchers" / script), *args, "--wait"],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_submitit_launchers_run_a_single_job_and_a_sweep(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """launchers/submitit_run.py and submitit_sweep.py (submitit's Python API, single-component jobs and arrays): a
    whole run per allocation; --wait prints each run's summary (submitit polls sacct: the local cluster's stand-in
    answers)."""
    config = str(REPO / "configs/tiny_cpu.yaml")
    small = ["steps=2", *SMALL, "train.world_size=1"]
    out = _launcher(slurm_cluster, "submitit_run.py", config, f"run_dir={tmp_path / 'single'}", *small)
    assert out[0].startswith("submitted job "), out
    summary = json.loads(out[-1])
    assert summary["steps"] == 2 and Path(summary["metrics"]).exists()
    out = _launcher(
        slurm_cluster, "submitit_sweep.py", config, f"run_dir={tmp_path / 'sweep'}", *small, "--grid", "seed=0,1"
    )
    assert out[0].startswith("submitted 2 array tasks"), out
    summaries = [json.loads(line) for line in out[1:]]
    assert [s["steps"] for s in summaries] == [2, 2]
    points = sorted(p for p in (tmp_path / "sweep").iterdir() if (p / "checkpoints" / "step_2").is_dir())
    assert len(points) == 2, sorted((tmp_path / "sweep").iterdir())


def test_the_flagship_in_miniature_survives_preemption(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """configs/experiments/glm52_mini.yaml, submitted by `miles-hpc submit` (preflight, then the flagship's
    heterogeneous job shape): a megatron trainer at TP 2 x EP 2 on one component, 2 embedded engines of TP 2 on the
    other, fully async, the terminal agent, R3 and p2p. A USR2 in the middle checkpoints, requeues and resumes; the
    job completes with every step once, every drawn prompt trained once, every sample stored with its routing rows,
    both engines holding every version (p2p's checksums verified at each sync)."""
    run_dir, steps = tmp_path / "run", 6
    proc = subprocess.run(
        [sys.executable, "-m", "miles_hpc.cli", "submit", "configs/experiments/glm52_mini.yaml", f"run_dir={run_dir}",
         f"steps={steps}"],
        cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ")[1].split(";")[0]
    out = run_dir / "logs" / f"slurm-{job}.out"

    def tail() -> str:
        return out.read_text()[-4000:] if out.exists() else "(no log)"

    deadline = time.monotonic() + 900
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 2):
        assert time.monotonic() < deadline, tail()
        ended = [r["JobState"] for r in slurm_cluster.records(job) if r["JobState"] in FINAL]
        assert not ended, f"job {job} ended ({ended}) before its second step: " + tail()
        time.sleep(1)
    slurm_cluster.run("scancel", "--signal=USR2", "--batch", job)
    while not any(r.get("Restarts", "0") != "0" for r in slurm_cluster.records(job)):
        assert time.monotonic() < deadline, "the job was not requeued: " + tail()
        time.sleep(0.5)
    time.sleep(3)  # see test_usr2_checkpoints_requeues_and_resumes_without_losing_a_sample
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    state = slurm_cluster.wait(job, timeout=max(10.0, deadline - time.monotonic()))
    assert state == "COMPLETED", tail()
    assert {r.get("ExitCode") for r in slurm_cluster.records(job)} == {"0:0"}, slurm_cluster.records(job)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps)), [r["step"] for r in rows]
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["sync/engines"] == 2 and r["sync/dropped_engines"] == 0 for r in rows), rows
    assert all(r["sync/verified_tensors"] > 0 for r in rows), "a sync without checksums verified"
    assert len(list((run_dir / "checkpoints").iterdir())) >= 2  # the preemption's and the last
    samples = list(TrajectoryReader(run_dir / "trajectories"))
    cfg = load_config(REPO / "configs/experiments/glm52_mini.yaml")
    per_prompt, n = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    assert sorted(s.train_step for s in samples) == sorted(list(range(steps)) * per_prompt * n)
    groups: dict[int, set] = {}
    for s in samples:
        groups.setdefault(s.group_id, set()).add(s.prompt_id)
    prompts = [p for g in groups.values() for p in g]
    assert len(groups) == steps * per_prompt and len(prompts) == len(set(prompts)), "a prompt trained twice"
    for s in samples:
        assert s.routed_experts is not None and len(s.routed_experts) > 0, (s.group_id, s.prompt_id)
