"""cluster/sweep.py without Slurm: grid expansion, the plan file, the array script, the report's statuses (the
array job itself runs in tests/test_slurm_jobs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_hpc.cluster.sweep import expand_grid, point_name, render_array, report, write_plan
from miles_hpc.config import load_config

REPO = Path(__file__).resolve().parents[1]


def test_expand_grid_is_the_product_first_key_slowest() -> None:
    assert expand_grid(["a=1,2", "b=x,y,z"]) == [{"a": "1", "b": b} for b in "xyz"] + [
        {"a": "2", "b": b} for b in "xyz"
    ]
    assert expand_grid(["train.lr=3e-4"]) == [{"train.lr": "3e-4"}]
    for bad, msg in [(["a"], "key=v1"), (["a="], "key=v1"), (["a=1", "a=2"], "twice")]:
        with pytest.raises(ValueError, match=msg):
            expand_grid(bad)
    assert point_name(3, {"train.lr": "3e-4", "data.prompts": "/x y"}) == "003-train.lr=3e-4,data.prompts=_x_y"


def test_plan_script_and_report(tmp_path: Path) -> None:
    points = expand_grid(["seed=0,1,2"])
    plan = write_plan(tmp_path, "configs/tiny_cpu.yaml", ["steps=4"], points)
    tasks = json.loads(plan.read_text())["tasks"]
    assert [t["overrides"] for t in tasks][1] == ["steps=4", "seed=1", f"run_dir={tmp_path / '001-seed=1'}"]
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", ["slurm.partition=cpu"])
    script = render_array(cfg, plan, len(points), max_parallel=2)
    assert "#SBATCH --array=0-2%2" in script and "#SBATCH --partition=cpu  # EDIT" in script
    assert f'miles-hpc sweep-task {plan} "$SLURM_ARRAY_TASK_ID"' in script
    # Point 0 finished its 4 steps, point 1 is part-way, point 2 has not started.
    for i, n in ((0, 4), (1, 2)):
        run = Path(tasks[i]["run_dir"])
        run.mkdir()
        (run / "config.yaml").write_text("name: x\nsteps: 4\n")
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(n))
        )
    rows = report(tmp_path, last=2)
    assert [(r["seed"], r["status"], r["steps"]) for r in rows] == [
        ("0", "done", 4),
        ("1", "running", 2),
        ("2", "missing", 0),
    ]
    assert rows[0]["reward_last"] == pytest.approx(0.25)


def test_walltime_to_minutes() -> None:
    from miles_hpc.launch.submitit_jobs import _minutes

    times = ("30", "00:30:00", "04:00:00", "1-00:00:00", "00:00:30", "2:05", "1-12", "2-01:30")
    assert [_minutes(t) for t in times] == [30, 30, 240, 1440, 1, 3, 2160, 2970]


@pytest.mark.process
def test_a_signalled_array_task_checkpoints_and_requeues_itself(tmp_path: Path) -> None:
    """The array script under bash, with a stand-in `miles-hpc` (a run that checkpoints on USR2 and returns 0, as the
    controller does) and `scontrol`: the batch shell's USR2 reaches the run at once, and the task requeues itself."""
    import os
    import signal
    import subprocess
    import time

    plan = write_plan(tmp_path, "configs/tiny_cpu.yaml", [], expand_grid(["seed=0"]))
    script = render_array(load_config(REPO / "configs/tiny_cpu.yaml", ["slurm.setup=[]"]), plan, 1)  # no venv
    assert "#SBATCH --signal=B:USR2@180" in script and "trap on_usr2 USR2" in script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "miles-hpc").write_text(
        "#!/bin/bash\n"
        f'echo "run $*" >> {log}\n'
        f"trap 'echo checkpointed >> {log}; exit 0' USR2\n"
        "while true; do sleep 0.05; done\n"
    )
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {log}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "0"}
    env.update(SLURM_ARRAY_JOB_ID="76", SLURM_SUBMIT_DIR=str(REPO), TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        ["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 30
    while not (log.exists() and "run sweep-task" in log.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert log.read_text().splitlines()[1:] == ["checkpointed", "scontrol requeue 77"], log.read_text()
    assert "requeueing 77 (task 0)" in out


@pytest.mark.process
def test_sweep_runs_preflight_on_every_point_before_anything_is_written(tmp_path: Path) -> None:
    """A point that fails preflight (here its site file does not exist) stops the whole sweep with the point and
    the key named, exit 2, and nothing written or submitted; --no-preflight renders it anyway; with submitit the
    dry run prints the jobs instead of submitting them."""
    root = tmp_path / "sweep"
    argv = [sys.executable, "-m", "miles_hpc.cli", "sweep", "--dry-run", "--grid",
            "slurm.site=slurm/sites/nvidia_ib.sh,slurm/sites/no_such_site.sh", "configs/tiny_cpu.yaml",
            f"run_dir={root}"]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "point slurm.site=slurm/sites/no_such_site.sh" in proc.stderr and "error: preflight: slurm.site" in proc.stderr
    )
    assert "1 of 2 sweep points failed preflight" in proc.stderr and not root.exists()
    proc = subprocess.run([*argv[:4], "--no-preflight", *argv[4:]], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0 and "#SBATCH --array=0-1" in proc.stdout, proc.stderr
    # submitit's dry run prints the array's jobs instead of submitting them.
    argv = [*argv[:4], "--launcher", "submitit", *argv[4:6], "slurm.site=slurm/sites/nvidia_ib.sh", *argv[7:]]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    described = json.loads(proc.stdout)
    assert described["launcher"] == "submitit" and len(described["jobs"]) == 1
