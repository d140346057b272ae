"""The local Slurm cluster (scripts/slurm_cluster.sh, tests/slurm_support.py) does what the Slurm tier relies on.

Against a real slurmctld and two slurmd (fake nodes on this machine): both nodes idle; a batch job runs and its output
is read back (and a failing one ends FAILED); a heterogeneous job puts its two components on different nodes and
runs one ``srun --het-group=K`` step per component at the same time; an array job runs each task; the ``sacct``
stand-in answers submitit's status query (``sacct -o JobID,State,NodeList --parsable2 -j ID ...``) for finished,
cancelled, array and het jobs.
"""

from __future__ import annotations

import shutil
import time

import pytest
from slurm_support import SlurmCluster, slurm_cluster_fixture  # noqa: F401  (the fixture `slurm_cluster`)

pytestmark = pytest.mark.slurm

# Each het step announces itself in a file, then waits for the other's: "met=yes" only if both ran at once.
HET_JOB = """#!/bin/bash
#SBATCH --job-name=het --ntasks=1 --cpus-per-task=1 --time=2
#SBATCH hetjob
#SBATCH --ntasks=1 --cpus-per-task=1
step='touch "started.$1"; met=no
for _ in $(seq 100); do [ -e "started.$((1 - $1))" ] && { met=yes; break; }; sleep 0.1; done
echo "HET group=$1 node=$SLURMD_NODENAME size=$SLURM_HET_SIZE" \
  "nodes0=$SLURM_JOB_NODELIST_HET_GROUP_0 nodes1=$SLURM_JOB_NODELIST_HET_GROUP_1 met=$met"'
srun --het-group=0 bash -c "$step" _ 0 &
srun --het-group=1 bash -c "$step" _ 1 &
wait
"""


def idle_nodes(cluster: SlurmCluster) -> set[str]:
    lines = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").split()
    return {node for node, state in zip(lines[::2], lines[1::2], strict=True) if state == "idle"}


def sacct_rows(cluster: SlurmCluster, *job_ids: str) -> dict[str, dict[str, str]]:
    """submitit 1.5.4's query (SlurmInfoWatcher._make_command), read the way its read_info reads it."""
    cmd = ["sacct", "-o", "JobID,State,NodeList", "--parsable2"]
    for job_id in job_ids:
        cmd += ["-j", job_id]
    header, *lines = cluster.run(*cmd).splitlines()
    assert header == "JobID|State|NodeList"
    rows = [dict(zip(header.split("|"), line.split("|"), strict=True)) for line in lines]
    return {row["JobID"]: row for row in rows}


def test_two_idle_nodes(slurm_cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + 10  # a job of another test may still be completing
    while len(idle_nodes(slurm_cluster)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(idle_nodes(slurm_cluster)) >= 2, slurm_cluster.run("sinfo", "-N")


def test_batch_job_output(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.sbatch("#!/bin/bash\n#SBATCH --time=1\necho hello from $SLURM_JOB_ID on $SLURMD_NODENAME\n")
    assert slurm_cluster.wait(job) == "COMPLETED"
    (record,) = slurm_cluster.records(job)
    assert slurm_cluster.output(job) == f"hello from {job} on {record['NodeList']}\n"
    failing = slurm_cluster.sbatch("#!/bin/bash\nexit 3\n")
    assert slurm_cluster.wait(failing) == "FAILED"
    assert slurm_cluster.records(failing)[0]["ExitCode"] == "3:0"


def test_het_job_components_on_two_nodes(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.sbatch(HET_JOB)
    assert slurm_cluster.wait(job, timeout=30) == "COMPLETED", slurm_cluster.output(job)
    components = slurm_cluster.records(job)
    assert [c["HetJobOffset"] for c in components] == ["0", "1"]
    out = slurm_cluster.output(job)
    lines = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("HET "))
    assert len(lines) == 2, out
    steps = [dict(field.split("=", 1) for field in line) for line in lines]
    assert [s["group"] for s in steps] == ["0", "1"]
    assert steps[0]["node"] != steps[1]["node"], out
    for k, step in enumerate(steps):
        assert step["size"] == "2"
        assert step["node"] == step[f"nodes{k}"] == components[k]["NodeList"]
        assert step["met"] == "yes", f"het steps did not run concurrently:\n{out}"


def test_array_job(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.sbatch(
        "#!/bin/bash\necho task $SLURM_ARRAY_TASK_ID of $SLURM_ARRAY_JOB_ID\n",
        "--array=0-2",
        "--output=array-%A_%a.out",
    )
    assert slurm_cluster.wait(job) == "COMPLETED"
    assert len(slurm_cluster.records(job)) == 3
    for task in range(3):
        assert slurm_cluster.output(f"{job}_{task}") == f"task {task} of {job}\n"
        assert (slurm_cluster.workdir / f"array-{job}_{task}.out").exists()


def test_sacct_stand_in(slurm_cluster: SlurmCluster) -> None:
    sacct = shutil.which("sacct", path=slurm_cluster.env["PATH"]) or ""
    assert sacct.endswith("/bin/sacct") and not sacct.startswith("/usr/"), f"sacct stand-in not first: {sacct}"
    done = slurm_cluster.sbatch("#!/bin/bash\ntrue\n")
    array = slurm_cluster.sbatch("#!/bin/bash\ntrue\n", "--array=0-1")
    het = slurm_cluster.sbatch("#!/bin/bash\n#SBATCH -n1\n#SBATCH hetjob\n#SBATCH -n1\ntrue\n")
    cancelled = slurm_cluster.sbatch("#!/bin/bash\nexec sleep 300\n")  # exec: no child to outlive the cancel
    slurm_cluster.wait(cancelled, states=frozenset({"RUNNING"}))
    slurm_cluster.run("scancel", cancelled)
    for job in (done, array, het, cancelled):
        slurm_cluster.wait(job)
    rows = sacct_rows(slurm_cluster, done, cancelled, array, het, "999999")  # an unknown id prints no row
    assert set(rows) == {done, cancelled, f"{array}_0", f"{array}_1", f"{het}+0", f"{het}+1"}
    assert rows[done]["State"] == "COMPLETED"
    assert rows[done]["NodeList"] == slurm_cluster.records(done)[0]["NodeList"]
    assert rows[cancelled]["State"].startswith("CANCELLED")  # submitit: finished, not "RUNNING" forever
    assert [rows[f"{array}_{k}"]["State"] for k in range(2)] == ["COMPLETED", "COMPLETED"]
    assert rows[f"{het}+0"]["NodeList"] != rows[f"{het}+1"]["NodeList"]
    assert sacct_rows(slurm_cluster, "999999") == {}
