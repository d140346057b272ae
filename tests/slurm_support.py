"""The ``slurm`` test tier's cluster: the session fixture ``slurm_cluster`` and a small job API over the Slurm
commands (no tests here). A test module imports ``slurm_cluster_fixture`` to get the fixture.

The fixture uses the cluster that ``SLURM_CONF`` names when one answers there (CI starts it with
``scripts/slurm_cluster.sh start`` and exports the line it prints); otherwise it starts the script's two-node cluster
in ``$MILES_SLURM_DIR`` (default /tmp/miles-slurm), installing Slurm first when it may (root with apt-get), and stops
it at session end. A cluster found already running is never stopped. Without Slurm, root or apt-get the tests skip,
and fail under MILES_REQUIRE_ALL=1 (:func:`conftest.require`). A ``slurm_cluster`` environment never carries the
``SLURM_*`` variables of a job the test session itself may run in (they would leak into the test jobs).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_cluster.sh"
CLUSTER_DIR = Path(os.environ.get("MILES_SLURM_DIR", "/tmp/miles-slurm"))
# Job states after which a job never runs again (squeue(1), JOB STATE CODES).
FINAL = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)
_KEY = re.compile(r"(?:^| )([A-Za-z:/_]+)=")


def parse_records(text: str) -> list[dict[str, str]]:
    """``scontrol show ... -o`` output: one ``Key=value ...`` line per record (values may contain spaces, e.g.
    ``Reason=...``, so a value runs up to the next `` Key=``)."""
    records = []
    for line in text.splitlines():
        keys = list(_KEY.finditer(line))
        ends = [k.start() for k in keys[1:]] + [len(line)]
        records.append({k.group(1): line[k.end() : end].strip() for k, end in zip(keys, ends, strict=True)})
    return [r for r in records if r]


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmCluster:
    env: dict[str, str]
    """Environment for sbatch/srun/sacct subprocesses: SLURM_CONF, PATH with the sacct stand-in first (when the
    cluster has one), and no SLURM_* job variables of a job this test session may itself run in."""
    workdir: Path
    """Where job scripts are written and jobs run (their default ``slurm-%j.out`` lands here)."""

    def run(self, *cmd: str, timeout: float = 30.0) -> str:
        proc = subprocess.run(
            cmd, env=self.env, cwd=self.workdir, capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, script: str | Path, *args: str) -> str:
        """Submit a job script (its text, or a path) with extra sbatch ``args``; returns the job id."""
        if isinstance(script, str) and "\n" in script:
            path = self.workdir / f"job-{time.monotonic_ns()}.sbatch"
            path.write_text(script)
            script = path
        out = self.run("sbatch", "--parsable", *args, str(script))
        return out.strip().split(";")[0]  # "ID" or "ID;CLUSTER"

    def records(self, job_id: str) -> list[dict[str, str]]:
        """The job's ``scontrol show job -o`` records: one, or one per array task / het component."""
        return parse_records(self.run("scontrol", "show", "job", "-o", job_id))

    def wait(self, job_id: str, timeout: float = 30.0, states: frozenset[str] = FINAL) -> str:
        """Poll until every record of the job is in ``states``; returns COMPLETED when all completed, else the first
        other state. Raises TimeoutError with the records' states."""
        deadline = time.monotonic() + timeout
        while True:
            found = [r["JobState"] for r in self.records(job_id)]
            if found and all(s in states for s in found):
                return next((s for s in found if s != "COMPLETED"), "COMPLETED")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {found} after {timeout:.0f} s")
            time.sleep(0.2)

    def output(self, job_id: str) -> str:
        """The job's stdout file (for an array task pass ``ID_TASK``; a het job's is its component 0's)."""
        return Path(self.records(job_id)[0]["StdOut"]).read_text()


def _answers(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _script(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), command, str(CLUSTER_DIR)], capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    started = False
    if "SLURM_CONF" in os.environ and _answers(dict(os.environ)):
        conf_dir = Path(os.environ["SLURM_CONF"]).parent
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    else:
        root = os.geteuid() == 0
        can_install = root and shutil.which("apt-get") is not None
        require(shutil.which("slurmctld") is not None or can_install, "Slurm (slurmctld), or root with apt-get")
        require(root, "root (scripts/slurm_cluster.sh runs slurmd, which needs root)")
        started = _script("status").returncode != 0
        proc = _script("start")
        if proc.returncode != 0:
            pytest.fail(f"scripts/slurm_cluster.sh start failed:\n{proc.stderr}", pytrace=False)
        conf_dir = CLUSTER_DIR
        env["SLURM_CONF"] = str(CLUSTER_DIR / "slurm.conf")
    if (conf_dir / "bin" / "sacct").exists() and not env.get("PATH", "").startswith(str(conf_dir / "bin")):
        env["PATH"] = f"{conf_dir / 'bin'}:{env.get('PATH', '')}"
    try:
        yield SlurmCluster(env=env, workdir=tmp_path_factory.mktemp("slurm"))
    finally:
        if started:
            _script("stop")
