"""Faults in the inputs of a real run (docs/reliability.md, "Bad inputs"): every one ends the run within seconds with
one message naming the cause, a non-zero exit and no process left; failures of the reward function are counted, kept
out of the loss and stop the run only past ``reward.max_failed_frac``; over-long prompts are skipped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fault_support import REPO, assert_exactly_once, no_orphans, run

pytestmark = [pytest.mark.process, pytest.mark.faults]

REWARDS = """
import math

def raises(inp):
    raise ZeroDivisionError("the reward's own bug")

def odd_prompts_nan(inp):
    return math.nan if inp.sample.prompt_id % 2 else 1.0

def too_big(inp):
    return 1e39
"""


@pytest.fixture()
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "fault_rewards.py").write_text(REWARDS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    return tmp_path


def one_message(proc, *needles: str) -> None:  # noqa: ANN001
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in err, err[-3000:]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    ("override", "code", "needle"),
    [
        ("data.prompts=/nonexistent.jsonl", 2, "data.prompts"),
        ("data.task=no_such_task", 2, "data.task"),
    ],
)
def test_bad_data_source_fails_before_anything_starts(
    tmp_path: Path, world: int, override: str, code: int, needle: str
) -> None:
    t0 = time.monotonic()
    proc = run(tmp_path / "run", "steps=1", f"train.world_size={world}", override)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
    one_message(proc, needle)
    assert time.monotonic() - t0 < 60
    no_orphans(tmp_path / "run")


@pytest.mark.parametrize("world", [1, 2])
def test_malformed_prompt_row_names_file_and_line(tmp_path: Path, world: int) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n')
    proc = run(tmp_path / "run", "steps=1", f"train.world_size={world}", f"data.prompts={data}")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    one_message(proc, f"{data}:2: invalid JSON")
    assert (tmp_path / "run" / "logs" / "controller.traceback").is_file()
    no_orphans(tmp_path / "run")


@pytest.mark.parametrize("fn", ["raises", "too_big"])
def test_a_reward_that_always_fails_stops_the_run_with_its_traceback(tmp_path: Path, plugin: Path, fn: str) -> None:
    proc = run(tmp_path / "run", "steps=3", f"reward.fn=fault_rewards:{fn}")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "samples failed their reward function" in proc.stderr
    assert "reward.max_failed_frac=0.5" in proc.stderr
    if fn == "raises":
        assert "ZeroDivisionError: the reward's own bug" in proc.stderr and "fault_rewards.py" in proc.stderr
    else:
        assert "outside the float32 range" in proc.stderr
    no_orphans(tmp_path / "run")


def test_failed_rewards_are_counted_stored_and_not_trained(tmp_path: Path, plugin: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run(run_dir, "steps=3", "reward.fn=fault_rewards:odd_prompts_nan", "reward.max_failed_frac=1.0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = assert_exactly_once(run_dir, 3)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    odd = [int((got.prompt_id[got.train_step == r["step"]] % 2).sum()) for r in rows]
    assert [r["rollout/failed"] for r in rows] == odd
    assert any(odd), "the seeded prompts of this run include odd ids"
    assert "failed" in proc.stdout  # the progress line shows the count


def test_a_prompt_longer_than_the_context_is_skipped_and_counted(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(4) for b in range(3)]
    rows[5]["prompt"] = "9+" * 1500 + "1="  # far past the tiny model's context
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = run(run_dir, "steps=6", f"data.prompts={data}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["rollout/skipped_prompts"] for m in metrics) >= 1
    assert "skipped 1 prompts longer than" in proc.stdout


def test_a_binary_config_file_is_one_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(bytes(range(256)) * 4)
    proc = subprocess.run(
        [sys.executable, "-m", "miles_hpc.cli", "run", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and str(cfg) in proc.stderr


@pytest.mark.parametrize(
    ("damage", "part"),
    [
        (lambda p: p.write_text('{"next_step": 4, "weight_ver'), "extra.json"),
        (lambda p: p.write_bytes(p.read_bytes()[:100]), "trainer.pt"),
    ],
)
def test_a_damaged_checkpoint_file_is_named_not_a_trainer_rank(tmp_path: Path, damage, part: str) -> None:  # noqa: ANN001
    """Every rank reads the damaged file; the message names it and what to do, not the rank that exited after."""
    run_dir = tmp_path / "run"
    first = run(run_dir, "steps=2", "train.checkpoint_interval=2", "train.world_size=2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    ckpt = run_dir / "checkpoints" / "step_2"
    damage(ckpt / part)
    proc = run(run_dir, "steps=3", "train.checkpoint_interval=2", "train.world_size=2")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    one_message(proc, f"{ckpt / part}: the checkpoint cannot be read", f"move {ckpt} aside")
    assert "trainer rank 1 exited" not in proc.stderr
    no_orphans(run_dir)
