"""The thin entry points in launchers/: torchrun on one node (CPU), mpirun for MPI-launched jobs (marker ``mpi``),
the Apptainer definition (parsed). The submitit launchers run in the Slurm tier (tests/test_slurm_jobs.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import require
from test_workers import SMALL

REPO = Path(__file__).resolve().parents[1]
TINY = SMALL  # two steps of two prompts x two samples, four new tokens, two trainer ranks


def _launch(script: str, run_dir: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # miles-hpc, torchrun of this venv
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "RANK", "WORLD_SIZE"))}
    return subprocess.run(
        [str(REPO / "launchers" / script), str(REPO / "configs/tiny_cpu.yaml"), f"run_dir={run_dir}", *TINY],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**clean, "PATH": path, **(env or {})},
        check=False,
    )


def _check_run(proc: subprocess.CompletedProcess[str], run_dir: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1] and steps[-1]["weight_version"] == 2
    assert (run_dir / "rendezvous" / "shutdown").exists()  # the engines were told to stop with training
    assert (run_dir / "checkpoints" / "step_2").is_dir()


@pytest.mark.process
def test_torchrun_launcher_runs_trainer_ranks_and_engines(tmp_path: Path) -> None:
    require(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is not None, "torchrun (torch's)")
    _check_run(_launch("torchrun.sh", tmp_path / "run"), tmp_path / "run")


@pytest.mark.mpi
@pytest.mark.process
def test_mpirun_launcher_runs_trainer_ranks_and_engines(tmp_path: Path) -> None:
    require(shutil.which("mpirun") is not None, "Open MPI's mpirun")
    proc = _launch("mpirun.sh", tmp_path / "run", {"MPIRUN_ARGS": "--allow-run-as-root --oversubscribe"})
    _check_run(proc, tmp_path / "run")


def _sections(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """An Apptainer definition: header (`Key: value` before the first section) and `%section` bodies."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("%"):
            current = sections.setdefault(line[1:].split()[0], [])
        elif current is not None:
            current.append(line)
        elif line.strip() and not line.startswith("#"):
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
    return header, sections


def test_apptainer_definition_is_complete() -> None:
    text = (REPO / "launchers" / "miles-hpc.def").read_text()
    header, sections = _sections(text)
    assert header["Bootstrap"] == "docker" and header["From"] == "{{ BASE }}"
    assert {"arguments", "files", "post", "environment", "runscript", "test", "help"} <= set(sections)
    args = dict(line.strip().split("=", 1) for line in sections["arguments"] if line.strip())
    used = set(re.findall(r"{{\s*(\w+)\s*}}", text))
    assert used == set(args), "every {{ ARG }} has a default in %arguments, and every argument is used"
    assert any(line.split() == [".", "/opt/miles-hpc"] for line in sections["files"])  # the project itself
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = re.search(r"/opt/miles-hpc\[([\w,]+)\]", "\n".join(sections["post"]))
    assert installed and set(installed.group(1).split(",")) <= set(extras)
    env = "\n".join(sections["environment"])
    assert "HF_HUB_OFFLINE=1" in env and "/opt/venv/bin" in env  # offline compute nodes
    assert "miles-hpc" in "\n".join(sections["runscript"])
