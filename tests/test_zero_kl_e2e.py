"""Zero-KL mode end to end on the CPU: `miles-hpc run ... zero_kl=true` (an engine server with `--batch-invariant`,
FSDP2 trainer ranks with `zero_kl`, broadcast weight sync) reports `mismatch/max_abs_logprob_diff == 0.0` at every
step while the weights change (a short SFT warm-up, then RL with a partial-credit reward). The same run without the
mode reports a nonzero mismatch, so the test can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "steps=4",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "train.sft_warmup_steps=5",
    "reward.fn=miles_hpc.rollout.rewards:char_match",
    "train.lr=1e-2",
    "train.max_tokens_per_microbatch=64",
]


def run(run_dir: Path, *overrides: str) -> list[dict]:
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={run_dir}",
        *RUN,
        *overrides,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("world_size", [1, 2])
def test_rl_run_has_zero_mismatch_at_every_step(tmp_path: Path, world_size: int) -> None:
    m = run(tmp_path / "run", "zero_kl=true", f"train.world_size={world_size}")
    assert [r["step"] for r in m] == [0, 1, 2, 3]
    assert [r["mismatch/max_abs_logprob_diff"] for r in m] == [0.0] * 4
    assert sum(r["grad_norm"] > 0 for r in m) >= 2  # the policy moved, and the engines followed it exactly


def test_control_run_without_the_mode_has_a_mismatch(tmp_path: Path) -> None:
    m = run(tmp_path / "run", "train.world_size=1")
    diffs = [r["mismatch/max_abs_logprob_diff"] for r in m]
    assert max(diffs) > 0.0 and max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_moe_rl_run_with_routing_replay_has_zero_mismatch(tmp_path: Path, arch: str) -> None:
    """MoE families (DeepSeek-V3's MLA and group-limited router too) with R3: zero mismatch at every step, and the
    trainer's live top-k equals every recorded route (the same bits pick the same experts)."""
    m = run(
        tmp_path / "run", "zero_kl=true", "train.world_size=1", f"model.init_arch={arch}", "algo.routing_replay=true"
    )
    assert [r["mismatch/max_abs_logprob_diff"] for r in m] == [0.0] * 4
    assert all(r["r3/coverage"] > 0.5 and r["r3/topk_agreement"] == 1.0 for r in m), m
    assert sum(r["grad_norm"] > 0 for r in m) >= 2
