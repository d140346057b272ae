"""The `miles-hpc` command line: init-model, run (config resolution + model stage), inspect."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_hpc.cli import main
from miles_hpc.config import load_config
from miles_hpc.data import Sample, TrajectoryWriter
from miles_hpc.models import load_pretrained

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "arch", ["qwen3", "qwen3_moe", "llama", "qwen2", "deepseek_v3", "glm4_moe", "glm_moe_dsa", "deepseek_v32"]
)
def test_init_model_loads_in_transformers(tmp_path: Path, arch: str) -> None:
    out = tmp_path / arch
    assert main(["init-model", "--arch", arch, "--size", "tiny", "--seed", "3", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok("12+34=46", add_special_tokens=False)["input_ids"]])
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_pretrained(out)
    with torch.no_grad():
        diff = (ref(ids).logits - ours(ids)).abs().max().item()
    assert diff < 1e-4
    # seeded: the same seed gives the same weights, another seed different ones
    again = tmp_path / "again"
    main(["init-model", "--arch", arch, "--seed", "3", str(again)])
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.process
def test_run_writes_resolved_config_and_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    # One short step: the full loop runs (its own tests are in test_loop_e2e.py); here the CLI's part matters.
    overrides = [
        f"run_dir={run_dir}",
        "rollout.temperature=0.5",
        "steps=1",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "train.sft_warmup_steps=0",
        "train.world_size=1",
    ]
    rc = main(["run", str(REPO / "configs/tiny_cpu.yaml"), *overrides])
    assert rc == 0
    resolved = load_config(run_dir / "config.yaml")
    assert resolved == load_config(REPO / "configs/tiny_cpu.yaml", overrides)
    assert (run_dir / "model" / "config.json").is_file()
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".model-")]  # temp dir renamed away
    assert "model ok" in capsys.readouterr().out


def test_run_config_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(REPO / "configs/tiny_cpu.yaml"), "rollout.temprature=1"]) == 2
    err = capsys.readouterr().err
    assert "rollout.temprature" in err and "tiny_cpu.yaml" in err
    assert main(["run", str(REPO / "configs/tiny_cpu.yaml"), f"model.path={tmp_path}"]) == 2
    assert "model.path" in capsys.readouterr().err


def test_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with TrajectoryWriter(run / "trajectories", prefix="t", model="m", run_id="r", max_shard_bytes=1 << 20) as w:
        w.append(
            [
                Sample(
                    prompt_id=0,
                    group_id=0,
                    tokens=[1, 2, 3, 4],
                    prompt_len=2,
                    loss_mask=[0, 0, 1, 1],
                    rollout_logprobs=[0.0, 0.0, -0.5, -0.25],
                    policy_version=[-1, -1, 0, 0],
                    reward=1.0,
                    status=0,
                    routed_experts=None,
                    metadata={},
                ),
            ]
        )
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"samples\s+1\n", out) and re.search(r"response tokens\s+2\s", out)
    assert "mean 1.0000" in out and "completed 1" in out
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = [1, 2]
    assert main(["inspect", str(foreign)]) == 1
    assert str(foreign) in capsys.readouterr().err


@pytest.mark.process
def test_console_script_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "miles_hpc.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("run", "init-model", "inspect"):
        assert command in out.stdout


def test_run_bad_reward_plugin_fails_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", str(REPO / "configs/tiny_cpu.yaml"), f"run_dir={tmp_path / 'r'}", "reward.fn=no_such_pkg.mod:f"])
    assert rc == 2
    assert "no_such_pkg" in capsys.readouterr().err
    assert not (tmp_path / "r" / "rendezvous").exists()  # failed before any engine started
