"""cluster/slurm.py: the batch script as a pure function of the config, checked against the files in the repo
(slurm/tiny_cpu.sbatch, tests/golden/*.sbatch: `./slurm/render.sh` re-renders them), with bash's syntax check and
the structure Slurm needs (components, task counts, signal, requeue). The local-Slurm tier runs them for real
(tests/test_slurm_jobs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_hpc.cluster.slurm import render_sbatch
from miles_hpc.config import load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("path", "config", "overrides"),
    [
        ("slurm/tiny_cpu.sbatch", "configs/tiny_cpu.yaml", []),
        ("tests/golden/tiny_cpu_split.sbatch", "configs/tiny_cpu.yaml", ["slurm.mode=split"]),
        ("slurm/glm52_64gpu.sbatch", "configs/experiments/glm52_64gpu.yaml", []),
    ],
)
@pytest.mark.process
def test_checked_in_scripts_are_current(path: str, config: str, overrides: list[str]) -> None:
    cfg = load_config(REPO / config, overrides)
    want = render_sbatch(cfg, config, overrides)
    assert (REPO / path).read_text() == want, f"{path} is stale: run ./slurm/render.sh"
    subprocess.run(["bash", "-n", str(REPO / path)], check=True)


def sbatch_lines(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if line.startswith("#SBATCH")]


def test_hetjob_components_and_preemption() -> None:
    cfg = load_config(
        REPO / "configs/tiny_cpu.yaml",
        [
            "train.world_size=8",
            "rollout.num_engines=4",
            "slurm.train_nodes=2",
            "slurm.rollout_nodes=4",
            "slurm.gpus_per_node=4",
            "slurm.partition=gpu",
            "slurm.account=proj123",
            "slurm.signal_s=300",
            "slurm.site=slurm/sites/frontier.sh",
        ],
    )
    script = render_sbatch(cfg, "configs/x.yaml")
    lines = sbatch_lines(script)
    het = lines.index("#SBATCH hetjob")
    first, second = lines[:het], lines[het + 1 :]
    assert "#SBATCH --nodes=2" in first and "#SBATCH --ntasks=8" in first and "#SBATCH --gpus-per-node=4" in first
    assert "#SBATCH --nodes=4" in second and "#SBATCH --ntasks=4" in second
    assert "#SBATCH --signal=B:USR2@300  # USR1 may be taken by NCCL" in lines and "#SBATCH --requeue" in lines
    assert "#SBATCH --account=proj123  # EDIT" in lines and "#SBATCH --partition=gpu  # EDIT" in lines
    assert "source slurm/sites/frontier.sh" in script and "export HF_HUB_OFFLINE=1" in script
    assert (
        "--het-group=1 -c 1 ${MILES_GPU_BIND:+--gpus-per-task=1 --gpu-bind=$MILES_GPU_BIND} miles-hpc worker --role "
        "rollout"
        in script
        and "--het-group=0 -c 1 ${MILES_GPU_BIND:+--gpus-per-task=1 --gpu-bind=$MILES_GPU_BIND} miles-hpc worker --role "
        "train"
        in script
    )
    # Training's end, whatever it was, stops the rollout step; a USR2 requeues after the checkpoint.
    assert script.index("worker --role shutdown") > script.index('wait_for "$TRAIN"')
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    over = ["rollout.backend=sglang", "rollout.engine_tp=16", "rollout.engine_nodes=2", "rollout.num_engines=2"]
    lines = sbatch_lines(render_sbatch(load_config(REPO / "configs/tiny_cpu.yaml", over), "c.yaml"))
    assert "#SBATCH --ntasks=4" in lines  # a rollout task per node of each engine
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", ["slurm.signal_s=0", "slurm.requeue=false"])
    lines = sbatch_lines(render_sbatch(cfg, "c.yaml"))
    assert not any("--signal" in x or "--requeue" in x for x in lines)


@pytest.mark.process
def test_submit_dry_run_prints_the_script() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "miles_hpc.cli", "submit", "--dry-run", "--no-preflight", "configs/tiny_cpu.yaml"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    assert out == (REPO / "slurm/tiny_cpu.sbatch").read_text()


@pytest.mark.process
def test_submit_runs_preflight_first(tmp_path: Path) -> None:
    """The flagship as checked in, on a machine without its checkpoint or SGLang's venv: `submit` names each
    problem with its key and submits nothing (no sbatch is called: exit 2 before it); --dry-run still prints the
    script and exits 2; submitit's dry run prints its job instead of submitting it."""
    flagship = ["configs/experiments/glm52_64gpu.yaml", f"run_dir={tmp_path / 'run'}"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "miles_hpc.cli", "submit", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, check=False)

    real = cli(*flagship)
    assert real.returncode == 2 and real.stdout == "", real.stderr
    assert (
        "error: preflight: model.path: " in real.stderr and "error: preflight: rollout.sglang_python: " in real.stderr
    )
    assert not (tmp_path / "run" / "job.sbatch").exists()
    dry = cli("--dry-run", *flagship)
    assert dry.returncode == 2 and dry.stdout.startswith("#!/bin/bash") and "error: preflight:" in dry.stderr
    tiny = ["configs/tiny_cpu.yaml", f"run_dir={tmp_path / 'tiny'}", "slurm.shared_fs_check=false"]
    job = cli("--launcher", "submitit", "--dry-run", *tiny)
    assert job.returncode == 0, job.stderr
    described = json.loads(job.stdout)
    assert described["launcher"] == "submitit" and described["parameters"]["nodes"] == 1
    assert described["jobs"][0]["args"][1] == tiny[1:]
    assert not (tmp_path / "tiny").exists()  # nothing submitted, nothing made


@pytest.mark.process
def test_flagship_script_shape() -> None:
    """slurm/glm52_64gpu.sbatch: 64 GPUs, 32 training ranks on 4 nodes and 4 TP-8 engines on 4 nodes, the site file,
    walltime signal and requeue."""
    script = (REPO / "slurm/glm52_64gpu.sbatch").read_text()
    lines = sbatch_lines(script)
    het = lines.index("#SBATCH hetjob")
    assert {
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks=32",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
    } <= set(lines[:het])
    assert {
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
    } <= set(lines[het:])
    assert "source slurm/sites/nvidia_ib.sh" in script and "#SBATCH --requeue" in lines
    sites = sorted((REPO / "slurm/sites").glob("*.sh"))
    assert {p.name for p in sites} >= {"frontier.sh", "nvidia_ib.sh", "mi300x.sh"}
    for site in sites:
        subprocess.run(["bash", "-n", str(site)], check=True)


def _bash(code: str) -> str:
    return subprocess.run(["bash", "-c", code], capture_output=True, text=True, check=True).stdout


@pytest.mark.process
def test_srun_binds_cpus_and_the_sites_gpu_policy() -> None:
    """Every srun names its CPUs per task; with GPUs, a site that sets MILES_GPU_BIND (Frontier's does) gives each
    trainer rank one GPU and each engine task engine_tp / engine_nodes, bound by that policy; unset, none."""
    script = (REPO / "slurm/glm52_64gpu.sbatch").read_text()
    train = next(x for x in script.splitlines() if "--role train" in x and x.startswith("srun"))
    roll = next(x for x in script.splitlines() if "--role rollout" in x and x.startswith("srun"))
    for line, n in ((train, 1), (roll, 8)):
        words = line.split(" miles-hpc ")[0]
        for bind, want in (("", []), ("closest", [f"--gpus-per-task={n}", "--gpu-bind=closest"])):
            shown = _bash(f'MILES_GPU_BIND={bind}; printf "%s\\n" {words.split("srun ", 1)[1]}').split()
            assert "-c" in shown and shown[shown.index("-c") + 1] == "8"
            assert [w for w in shown if w.startswith(("--gpus-per-task", "--gpu-bind"))] == want
    frontier = _bash(f"module() {{ :; }}; source {REPO / 'slurm/sites/frontier.sh'}; echo $MILES_GPU_BIND")
    assert frontier.strip() == "closest"
    cpu = (REPO / "slurm/tiny_cpu.sbatch").read_text()
    assert "--gpus-per-task" not in cpu and cpu.count("-c 1 miles-hpc worker") == 2


def _site_env(site: str, code: str = "env", **env: str) -> str:
    """What ``code`` prints after sourcing ``site`` in a bash started with an empty environment (plus ``env``), under
    the batch script's own `set -euo pipefail`."""
    cmd = [
        "env",
        "-i",
        *(f"{k}={v}" for k, v in env.items()),
        "bash",
        "-c",
        f"set -euo pipefail; source {site}; {code}",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout


@pytest.mark.process
def test_mi300x_site_sets_rccl_hip_and_the_gpu_binding() -> None:
    """slurm/sites/mi300x.sh (MI300X/MI355X): sourced in an empty environment (no module command: its module line is
    commented out), it sets AMD's RCCL and HIP settings and the NIC examples marked EDIT, binds GPUs per task
    (MILES_GPU_BIND=closest) and drops an inherited HIP_VISIBLE_DEVICES; every export says why on its line or the one
    above; the rendered srun lines then carry --gpus-per-task and --gpu-bind=closest."""
    site = "slurm/sites/mi300x.sh"
    got = dict(line.split("=", 1) for line in _site_env(site, HIP_VISIBLE_DEVICES="3").splitlines() if "=" in line)
    assert {
        "NCCL_MIN_NCHANNELS": "112",
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        "GPU_MAX_HW_QUEUES": "2",
        "HIP_FORCE_DEV_KERNARG": "1",
        "HSA_OVERRIDE_CPU_AFFINITY_DEBUG": "0",
        "PYTORCH_ROCM_ARCH": "gfx942;gfx950",
        "MILES_GPU_BIND": "closest",
    }.items() <= got.items()
    assert got["GLOO_SOCKET_IFNAME"] == got["NCCL_SOCKET_IFNAME"] and got["NCCL_IB_HCA"].startswith("rdma0,")
    assert "HIP_VISIBLE_DEVICES" not in got and "NCCL_DEBUG" not in got
    assert _site_env(site, "echo $PYTORCH_ROCM_ARCH", PYTORCH_ROCM_ARCH="gfx950").strip() == "gfx950"
    lines = (REPO / site).read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("export "):
            assert " # " in line or lines[i - 1].startswith("#"), f"{site}:{i + 1} exports without saying why"
    over = ["slurm.site=slurm/sites/mi300x.sh"]
    script = render_sbatch(load_config(REPO / "configs/experiments/glm52_64gpu.yaml", over), "c.yaml", over)
    assert "source slurm/sites/mi300x.sh" in script
    for role, n in (("train", 1), ("rollout", 8)):
        srun = next(x for x in script.splitlines() if x.startswith("srun") and f"--role {role}" in x)
        words = _site_env(site, f'printf "%s\\n" {srun.split(" miles-hpc ")[0].split("srun ", 1)[1]}').split()
        assert words[words.index("-c") + 1] == "8"
        assert [w for w in words if w.startswith(("--gpus-per-task", "--gpu-bind"))] == [
            f"--gpus-per-task={n}",
            "--gpu-bind=closest",
        ]


@pytest.mark.process
def test_install_script_picks_the_torch_index_and_the_offline_steps(tmp_path: Path) -> None:
    """scripts/install.sh --dry-run: the GPU flag picks PyTorch's CUDA or ROCm index (MILES_TORCH_INDEX overrides),
    --download fetches every wheel (SGLang's apart) for an offline cluster, and a missing --gpu is refused."""

    def dry(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        cmd = ["bash", str(REPO / "scripts" / "install.sh"), *args, "--dry-run"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **env})

    cuda, rocm = dry("--gpu", "cuda").stdout, dry("--gpu", "rocm", "--sglang").stdout
    assert "MILES_TORCH_INDEX=https://download.pytorch.org/whl/cu128" in cuda and "test_sglang.sh" not in cuda
    assert (
        "MILES_TORCH_INDEX=https://download.pytorch.org/whl/rocm6.4" in rocm and "test_sglang.sh --install-only" in rocm
    )
    assert (
        "MILES_TORCH_INDEX=https://example/whl" in dry("--gpu", "rocm", MILES_TORCH_INDEX="https://example/whl").stdout
    )
    down = dry("--gpu", "cuda", "--download", str(tmp_path / "wh"), "--sglang").stdout
    assert f"-d {tmp_path / 'wh'} --index-url https://download.pytorch.org/whl/cu128 torch==" in down
    assert f"-d {tmp_path / 'wh'}/sglang sglang==0.5.23" in down and "setuptools>=68" in down
    bad = dry()
    assert bad.returncode == 2 and "--gpu cuda, rocm or cpu is required" in bad.stderr
    both = dry("--gpu", "cuda", "--download", "a", "--from", "b")
    assert both.returncode == 2 and "two steps" in both.stderr
