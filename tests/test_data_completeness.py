"""Trained samples missing from the shards (a shard deleted or moved out): `inspect --verify RUN` names the steps
from metrics.jsonl's per-step counts, and a resume warns about the steps its checkpoint covers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_data_verify import sample, shard

from miles_hpc.cli import main
from miles_hpc.data import verify_shards
from miles_hpc.data.completeness import SAMPLES_KEY, missing_samples, recorded_counts, run_of
from miles_hpc.launch.controller import _warn_missing


def make_run(root: Path, per_step: list[int], rows: list[int] | None = None) -> tuple[Path, list[Path]]:
    """A run directory with one shard per step (step s: per_step[s] samples) and a metrics row for each of `rows`
    (default: every step) recording per_step[s]."""
    traj = root / "trajectories"
    traj.mkdir(parents=True)
    paths, i = [], 0
    for step, n in enumerate(per_step):
        paths.append(shard(traj, [sample(i + k, train_step=step) for k in range(n)], prefix=f"traj{step}"))
        i += n + n % 2  # groups of two never span steps
    lines = [{"step": s, "reward_mean": 0.5, SAMPLES_KEY: float(per_step[s])} for s in (rows or range(len(per_step)))]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root, paths


def moved_out(path: Path) -> None:
    aside = path.parent.parent.parent / "aside"  # not the run directory: shards there would be read instead
    aside.mkdir(exist_ok=True)
    path.rename(aside / path.name)


def test_a_complete_run_has_no_finding_and_a_deleted_shard_names_its_step(tmp_path: Path) -> None:
    run, paths = make_run(tmp_path / "run", [4, 2, 4])
    assert verify_shards(run) == [] and verify_shards(run / "trajectories") == []
    moved_out(paths[1])
    (p,) = verify_shards(run)
    assert p.path == run / "metrics.jsonl"
    assert p.what.startswith("step 1: 2 sample(s) trained, 0 in the shards: 2 missing")
    assert verify_shards(run / "trajectories") == [p]
    assert verify_shards(paths[0]) == []  # one shard alone: no run to compare with


def test_a_partial_shard_may_hold_any_step_so_nothing_is_compared(tmp_path: Path) -> None:
    run, paths = make_run(tmp_path / "run", [2, 2])
    moved_out(paths[1])
    assert len(verify_shards(run)) == 1
    (run / "trajectories" / "traj9-00000.h5.partial").write_bytes(b"being written")
    assert missing_samples(run) == [] and verify_shards(run) == []


def test_rows_without_a_count_a_torn_line_and_later_rows(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        json.dumps({"step": 0, SAMPLES_KEY: 4})
        + "\n"
        + json.dumps({"step": 1, "loss": 0.1})
        + "\n"
        + json.dumps({"step": 2, SAMPLES_KEY: 3})
        + "\n"
        + json.dumps({"step": 2, SAMPLES_KEY: 5})
        + "\n"
        + '{"step": 3, "rollout/sam'
    )
    assert recorded_counts(metrics) == {0: 4, 2: 5}
    assert recorded_counts(metrics, below=2) == {0: 4}


def test_steps_without_a_row_and_extra_samples_are_not_findings(tmp_path: Path) -> None:
    """A crash between the append and the row leaves a step's samples with no row (the reconciler drops them at
    the resume); a step's row is the only thing that says samples are missing."""
    run, _ = make_run(tmp_path / "run", [2, 4, 2], rows=[0, 2])
    assert verify_shards(run) == []
    assert missing_samples(run) == []


def test_many_steps_are_listed_up_to_a_count(tmp_path: Path) -> None:
    run, paths = make_run(tmp_path / "run", [2] * 8)
    for p in paths[1:]:
        moved_out(p)
    problems = verify_shards(run)
    assert [p.what.split(":")[0] for p in problems[:5]] == [f"step {s}" for s in range(1, 6)]
    assert problems[-1].what == "samples missing from 7 steps in all (14 samples)" and len(problems) == 6


def test_an_unreadable_shard_is_not_counted_and_says_so(tmp_path: Path) -> None:
    run, paths = make_run(tmp_path / "run", [2, 2])
    paths[1].write_bytes(b"not an HDF5 file")
    problems = verify_shards(run)
    assert problems[0].path == paths[1]
    assert problems[1].what.startswith("step 1: 2 sample(s) trained, 0 in the shards")
    assert problems[1].what.endswith("(1 shard(s) could not be read: their samples are not counted)")


def test_run_of(tmp_path: Path) -> None:
    run, paths = make_run(tmp_path / "run", [2])
    assert run_of(run) == run and run_of(run / "trajectories") == run
    assert run_of(paths[0]) is None and run_of(tmp_path) is None


def test_inspect_verify_exits_1_and_says_what(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, paths = make_run(tmp_path / "run", [2, 2, 2])
    assert main(["inspect", "--verify", str(run)]) == 0
    moved_out(paths[2])
    capsys.readouterr()
    assert main(["inspect", "--verify", str(run)]) == 1
    out = capsys.readouterr()
    assert out.out.startswith(f"{run / 'metrics.jsonl'}: step 2: 2 sample(s) trained, 0 in the shards")
    assert out.err == (
        f"verified 2 shard(s) under {run}: 1 problem(s) in 0 of 2 shard(s) and trained samples missing from the "
        "shards\n"
    )


def test_a_resume_warns_about_the_steps_its_checkpoint_covers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, paths = make_run(tmp_path / "run", [2, 2, 2])
    moved_out(paths[0])
    moved_out(paths[2])
    _warn_missing(run, 2)  # step 2 comes after the checkpoint: it will be trained and stored again
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[miles-hpc] WARNING: trajectories: step 0: 2 sample(s) trained")
    assert lines[0].endswith(f"see `miles-hpc inspect --verify {run}`")
    _warn_missing(run, 0)
    assert capsys.readouterr().out == ""


def test_a_run_without_metrics_or_trajectories_has_nothing_to_compare(tmp_path: Path) -> None:
    """A first attempt that ended before its first metrics row (or before its store opened) resumes at 0."""
    run, _ = make_run(tmp_path / "run", [2])
    (run / "metrics.jsonl").unlink()
    assert missing_samples(run) == [] and missing_samples(run, below=0) == []
    _warn_missing(run, 0)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert missing_samples(bare) == []
