"""`miles-hpc prepare` + `miles-hpc worker --role rollout|train|shutdown` (launch/workers.py) without a scheduler:
the processes a Slurm job starts, launched here by hand with torchrun-style variables. The controller waits for the
engine's rendezvous file, runs the loop, and its ``shutdown`` stops the rollout worker; a missing engine times out
with a message naming it and its node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_fsdp import free_port

from miles_hpc.config import load_config
from miles_hpc.launch.run_dir import RunPaths
from miles_hpc.launch.workers import prepare, train_placement

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "steps=2",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=4",
    "train.sft_warmup_steps=0",
    "train.world_size=2",
]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles_hpc.cli", *args]


@pytest.mark.process
def test_workers_run_the_loop_and_training_stops_rollout(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        cli("prepare", str(REPO / "configs/tiny_cpu.yaml"), f"run_dir={run_dir}", *SMALL),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    config = out.stdout.strip().splitlines()[-1]
    assert config == str(run_dir / "config.yaml") and (run_dir / "keys" / "admin_api_key").is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    rollout = subprocess.Popen(
        cli("worker", "--role", "rollout", config), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    port = str(free_port())
    trainers = [
        subprocess.Popen(
            cli("worker", "--role", "train", config),
            env={
                **env,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [t.communicate(timeout=300)[0] for t in trainers]
        assert [t.returncode for t in trainers] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
        assert "done: 2 steps" in outs[0]
        rollout_out = rollout.communicate(timeout=90)[0]  # training ended: the rollout worker stops by itself
        assert rollout.returncode == 0, rollout_out[-3000:]
    finally:
        for p in [rollout, *trainers]:
            if p.poll() is None:
                p.kill()
    assert json.loads((run_dir / "rendezvous" / "shutdown").read_text())["why"] == "training ended"
    assert [json.loads(x)["weight_version"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_prepare_clears_the_previous_attempts_rendezvous(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [f"run_dir={tmp_path / 'run'}", *SMALL])
    paths = prepare(cfg)
    keys = {n: (paths.root / "keys" / n).read_text() for n in ("api_key", "admin_api_key")}
    for name in ("engine-0.json", "shutdown", "trainer.json"):
        (paths.rendezvous / name).write_text("{}")
    paths = prepare(cfg)
    assert list(paths.rendezvous.iterdir()) == []
    assert {n: (paths.root / "keys" / n).read_text() for n in keys} == keys  # a requeue keeps the run's keys


def test_world_size_mismatch_names_both_numbers(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [f"run_dir={tmp_path / 'run'}", "train.world_size=4"])
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    try:
        train_placement(cfg)
    except ValueError as e:
        assert "train.world_size is 4" in str(e) and "started 2" in str(e)
    else:
        raise AssertionError("no error")


def test_controller_names_the_missing_engine_and_its_node(tmp_path: Path) -> None:
    from miles_hpc.rollout.sglang import mark_engine_starting, wait_for_engines

    rdv = RunPaths(tmp_path).rendezvous
    rdv.mkdir(parents=True)
    mark_engine_starting(rdv, 1, node="n7")
    try:
        wait_for_engines(rdv, 2, timeout=0.2, poll_s=0.05)
    except TimeoutError as e:
        assert "engine 0" in str(e) and "engine 1 (node n7, started, never ready)" in str(e)
    else:
        raise AssertionError("no timeout")


@pytest.mark.process
def test_sglang_backend_worker_waits_for_health_and_writes_the_record(tmp_path: Path) -> None:
    """Backend sglang: the rollout worker starts `SGLANG_PYTHON -m sglang.launch_server ...` (here a stand-in that
    serves our engine: tests/sglang_standin.py), waits for /health, writes engine-0.json itself (SGLang writes
    none), and stops the server at shutdown; the controller trains through it."""
    standin = tmp_path / "sglang-python"
    standin.write_text(f'#!/bin/bash\nexec {sys.executable} {REPO / "tests" / "sglang_standin.py"} "$@"\n')
    standin.chmod(0o755)
    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}",
        *SMALL,
        "train.world_size=1",
        "rollout.backend=sglang",
        f"rollout.sglang_python={standin}",
    ]
    config = (
        subprocess.run(
            cli("prepare", str(REPO / "configs/tiny_cpu.yaml"), *overrides),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    rollout = subprocess.Popen(
        cli("worker", "--role", "rollout", config), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    trainer = subprocess.Popen(
        cli("worker", "--role", "train", config), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out = trainer.communicate(timeout=300)[0]
        assert trainer.returncode == 0 and "done: 2 steps" in out, out[-3000:]
        rollout_out = rollout.communicate(timeout=90)[0]
        assert rollout.returncode == 0, rollout_out[-3000:]
    finally:
        for p in (rollout, trainer):
            if p.poll() is None:
                p.kill()
    record = json.loads((run_dir / "rendezvous" / "engine-0.json").read_text())
    assert record["backend"] == "sglang" and record["tp_size"] == 1
    assert oct((run_dir / "keys" / "sglang-0-0.yaml").stat().st_mode & 0o777) == "0o600"


@pytest.mark.process
def test_usr2_to_the_trainer_task_checkpoints_and_stops(tmp_path: Path) -> None:
    """`--signal=USR2@N` (without B:) reaches the tasks: trainer rank 0 asks itself to stop after its step, with a
    checkpoint; the rollout worker ignores the signal and stops at shutdown."""
    import signal
    import time

    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", *SMALL, "train.world_size=1", "steps=200"]
    config = (
        subprocess.run(
            cli("prepare", str(REPO / "configs/tiny_cpu.yaml"), *overrides),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    rollout = subprocess.Popen(cli("worker", "--role", "rollout", config), env=env)
    trainer = subprocess.Popen(
        cli("worker", "--role", "train", config), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        rollout.send_signal(signal.SIGUSR2)  # ignored there
        trainer.send_signal(signal.SIGUSR2)
        out = trainer.communicate(timeout=120)[0]
        assert trainer.returncode == 0 and "stop requested" in out, out[-3000:]
        assert rollout.wait(60) == 0
    finally:
        for p in (rollout, trainer):
            if p.poll() is None:
                p.kill()
    done = len(metrics.read_text().splitlines())
    assert 2 <= done < 200 and (run_dir / "checkpoints" / f"step_{done}").is_dir()
