"""Damaged trajectory shards of a real run (docs/reliability.md, "Damage"): `inspect --verify` exits non-zero naming
the file; a resume beside a damaged or truncated shard says so, quarantines it and goes on with exact accounting for
everything else, and the lost steps stay named (the resume's warning, `inspect --verify`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from fault_support import REPO, assert_exactly_once, run, stored

pytestmark = [pytest.mark.process, pytest.mark.faults]


def inspect(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles_hpc.cli", "inspect", *flags, str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def garble(shard: Path) -> None:
    """4 KB of garbage over the first raw chunk of the token ids (where a bad disk block would hurt most)."""
    with h5py.File(shard, "r") as f:
        offset = f["samples/tokens"].id.get_chunk_info(0).byte_offset
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(bytes((i * 37 + 11) % 256 for i in range(4096)))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damage_is_seen_and_quarantined_on_resume(tmp_path: Path, damage: str) -> None:
    run_dir = tmp_path / "run"
    proc = run(run_dir, "steps=4", "train.checkpoint_interval=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert inspect(run_dir, "--verify").returncode == 0
    before = stored(run_dir)
    victim = before.shards[0]
    with h5py.File(victim, "r") as f:
        lost = int(f["samples/reward"].shape[0])
        lost_steps = set(f["samples/train_step"][()].tolist())
    if damage == "garbage":
        garble(victim)
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    checked = inspect(run_dir, "--verify")
    assert checked.returncode != 0 and victim.name in checked.stdout + checked.stderr, checked.stdout + checked.stderr

    proc = run(run_dir, "steps=6", "train.checkpoint_interval=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert victim.name in said and "quarantine" in said, said[-3000:]
    assert (run_dir / "trajectories" / "quarantine" / victim.name).exists()
    assert not victim.exists()
    after = stored(run_dir)
    assert len(after.train_step) == 6 * 4 - lost  # only the damaged shard's samples are gone
    assert set(after.train_step.tolist()) == set(range(6)) - lost_steps  # the resume added steps 4 and 5
    # The loss stays visible: the resume warned, and `inspect --verify` names exactly the lost steps, nothing else.
    warned = {
        int(line.split("step ")[1].split(":")[0]) for line in said.splitlines() if "WARNING: trajectories: step" in line
    }
    assert warned == lost_steps, said[-3000:]
    checked = inspect(run_dir, "--verify")
    named = {int(line.split(": step ")[1].split(":")[0]) for line in checked.stdout.splitlines() if ": step " in line}
    assert checked.returncode == 1 and named == lost_steps, checked.stdout + checked.stderr
    assert all(line.startswith(str(run_dir / "metrics.jsonl")) for line in checked.stdout.splitlines())


def test_an_intact_run_accounts_exactly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run(run_dir, "steps=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_exactly_once(run_dir, 3)
