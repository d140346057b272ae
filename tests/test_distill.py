"""On-policy distillation (rollout/distill.py): the per-token reverse-KL term on loss tokens only, combined with or
replacing the task advantage, and the loop end to end with a teacher engine that `miles-hpc run` starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_hpc.config import ConfigError, load_config
from miles_hpc.data.sample import Sample, SampleStatus
from miles_hpc.models.presets import init_model
from miles_hpc.rollout.distill import opd_advantages

REPO = Path(__file__).resolve().parents[1]


def sample(mask: list[int], lps: list[float]) -> Sample:
    n = len(mask)
    return Sample(
        prompt_id=0,
        group_id=0,
        tokens=list(range(n)),
        prompt_len=mask.index(1),
        loss_mask=mask,
        rollout_logprobs=lps,
        policy_version=[-1 if m == 0 else 0 for m in mask],
        reward=0.0,
        status=SampleStatus.COMPLETED,
    )


def test_reverse_kl_term_on_loss_tokens() -> None:
    s = sample([0, 0, 1, 1], [0.0, 0.0, -1.0, -2.0])
    teacher = [[0.0, -3.0, -0.5, -2.5]]
    adv, kl = opd_advantages([[0.0, 0.0, 0.7, 0.7]], [s], teacher, coef=2.0)
    assert adv == [[0.0, 0.0, 0.7 - 2.0 * (-0.5), 0.7 - 2.0 * 0.5]] and kl == pytest.approx(0.0)
    only, _ = opd_advantages([[0.0, 0.0, 0.7, 0.7]], [s], teacher, coef=1.0, only=True)
    assert only == [[0.0, 0.0, 0.5, -0.5]]


@pytest.mark.process
def test_config_checks(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={tmp_path / 'run'}",
        f"algo.opd_teacher={tmp_path / 'nothing'}",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "algo.opd_teacher" in proc.stderr and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="opd_only"):
        load_config(REPO / "configs/tiny_cpu.yaml", ["algo.opd_only=true"])


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
@pytest.mark.parametrize("teacher_seed", [0, 5])
@pytest.mark.process
def test_loop_with_a_teacher_engine(teacher_seed: int, mode: str, tmp_path: Path) -> None:
    # Seed 0 is the run's own initial model (`model.init_*` with seed 0): before any update the teacher agrees
    # with the student exactly; another seed is another model, which disagrees. (Fully async: step 0 trains on
    # groups generated before the first update, so the same holds.)
    teacher = init_model("qwen3", "tiny", tmp_path / "teacher", seed=teacher_seed)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={run_dir}",
        "steps=2",
        "train.world_size=1",
        "train.sft_warmup_steps=0",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        f"algo.opd_teacher={teacher}",
        "algo.opd_coef=0.5",
        f"mode={mode}",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl0 = m[0]["opd/reverse_kl"]
    # (A sampled estimate of the reverse KL: positive in expectation, either sign on four short samples.)
    assert len(m) == 2 and (abs(kl0) < 1e-5 if teacher_seed == 0 else abs(kl0) > 0.01), kl0
    assert (run_dir / "logs" / "teacher.log").is_file()


@pytest.mark.process
def test_an_agent_in_fully_async_mode_with_r3_and_a_teacher(tmp_path: Path) -> None:
    # The flagship's combination in miniature: multi-turn agent episodes in fully async mode on a tiny MoE, R3 on,
    # and an OPD teacher scoring each whole conversation in one prefill. The teacher is the run's own initial model,
    # so before any update it agrees with every generated token of every turn (a teacher row misaligned with the
    # conversation's tokens, or a tool token scored, would not): the reverse KL of step 0 is 0.
    teacher = init_model("qwen3_moe", "tiny", tmp_path / "teacher", seed=0)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_agent_cpu.yaml"),
        f"run_dir={run_dir}",
        "steps=2",
        "mode=fully_async",
        "model.init_arch=qwen3_moe",
        "algo.routing_replay=true",
        f"algo.opd_teacher={teacher}",
        "algo.opd_coef=0.5",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "fully_async.max_inflight=4",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 2 and all(r["rollout/turns_mean"] > 1 for r in m)
    assert abs(m[0]["opd/reverse_kl"]) < 1e-5, m[0]["opd/reverse_kl"]
    assert all(0.9 < r["r3/coverage"] < 1 for r in m)
