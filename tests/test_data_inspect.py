"""`miles-hpc inspect` backend: summarize / format_summary numbers against hand-computed values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from miles_hpc.data import Sample, SampleStatus, TrajectoryFileError, TrajectoryWriter, format_summary, summarize


def make(
    i: int, prompt: int, mask: list[int], versions: list[int], reward: float, status: SampleStatus, rows: int = 0
) -> Sample:
    n = prompt + len(mask)
    return Sample(
        prompt_id=i,
        group_id=0,
        tokens=list(range(n)),
        prompt_len=prompt,
        loss_mask=[0] * prompt + mask,
        rollout_logprobs=[0.0] * prompt + [-0.5 if m else 0.0 for m in mask],
        policy_version=[-1] * prompt + versions,
        reward=reward,
        status=status,
        routed_experts=np.ones((rows, 2, 2), dtype=np.int64) if rows else None,
    )


SAMPLES = [
    make(0, 3, [1, 1], [4, 5], 1.0, SampleStatus.COMPLETED, rows=4),
    make(1, 2, [1, 0, 1], [2, -1, 3], 0.0, SampleStatus.TRUNCATED),  # a tool-output token in the middle
    make(2, 4, [], [], -1.0, SampleStatus.ABORTED, rows=3),  # prompt only
    make(3, 1, [1], [7], 0.5, SampleStatus.COMPLETED),
]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    traj = tmp_path / "trajectories"
    with TrajectoryWriter(traj, prefix="rank0", model="tiny-moe", run_id="r7", max_shard_bytes=1, num_experts=8) as w:
        w.append(SAMPLES[:2])
        w.append(SAMPLES[2:])
    crashed = TrajectoryWriter(traj, prefix="rank1", model="tiny-moe", run_id="r7", max_shard_bytes=1 << 20)
    crashed.append([make(9, 1, [1], [9], 5.0, SampleStatus.FAILED)])  # never closed: stays .partial
    crashed.flush()
    return tmp_path


def test_summarize_counts_by_hand(run_dir: Path) -> None:
    s = summarize(run_dir)  # a run directory: looks in RUN/trajectories
    assert (s["shards"], s["partial_shards"]) == (2, 1)
    assert [Path(p).name for p in s["shard_paths"]] == ["rank0-00000.h5", "rank0-00001.h5"]
    assert [Path(p).name for p in s["partial_paths"]] == ["rank1-00000.h5.partial"]
    assert s["models"] == ["tiny-moe"] and s["run_ids"] == ["r7"]
    assert s["samples"] == 4
    assert s["prompt_tokens"] == 3 + 2 + 4 + 1
    assert s["response_tokens"] == 2 + 3 + 0 + 1
    assert s["loss_tokens"] == 2 + 2 + 0 + 1
    assert s["reward_mean"] == pytest.approx((1.0 + 0.0 - 1.0 + 0.5) / 4)
    # population std: squared deviations 0.875^2 + 0.125^2 + 1.125^2 + 0.375^2 = 2.1875
    assert s["reward_std"] == pytest.approx(math.sqrt(2.1875 / 4))
    assert s["status_counts"] == {"COMPLETED": 2, "TRUNCATED": 1, "ABORTED": 1, "FAILED": 0}
    assert (s["policy_version_min"], s["policy_version_max"]) == (2, 7)  # prompt/tool tokens (-1) excluded
    assert s["routing"] == {
        "samples_with_routing": 2,
        "coverage": 0.5,
        "rows": 4 + 3,
        "shapes": [[2, 2]],
        "dtypes": ["uint8"],
        "num_experts": 8,
    }
    assert json.loads(json.dumps(s)) == s  # scripts can dump it as JSON
    assert summarize(run_dir / "trajectories") == {**s, "path": str(run_dir / "trajectories")}


def test_summarize_one_file(run_dir: Path) -> None:
    s = summarize(run_dir / "trajectories" / "rank0-00001.h5")
    assert (s["shards"], s["partial_shards"], s["samples"]) == (1, 0, 2)
    assert s["reward_mean"] == pytest.approx(-0.25) and s["routing"]["coverage"] == 0.5


def test_format_summary_is_readable(run_dir: Path) -> None:
    text = format_summary(summarize(run_dir))
    lines = text.splitlines()
    assert lines[0] == f"trajectories: {run_dir}"
    assert "2  (1 partial, not read: rank1-00000.h5.partial)" in lines[1]
    for want in [
        "model / run      tiny-moe / r7",
        "samples          4",
        "prompt tokens    10  (2.5/sample)",
        "response tokens  6  (1.5/sample)",
        "loss tokens      5  (1.2/sample)",
        "reward           mean 0.1250  std 0.7395",
        "status           completed 2, truncated 1, aborted 1, failed 0",
        "policy versions  2 .. 7",
        "routing          2/4 samples (50.0%), 7 rows, 2 layers x top-2, dtype uint8, experts 8",
    ]:
        assert f"  {want}" in lines, want


def test_empty_directory(tmp_path: Path) -> None:
    s = summarize(tmp_path)
    assert s["samples"] == 0 and s["reward_mean"] is None and s["policy_version_min"] is None
    assert s["routing"]["coverage"] == 0.0 and s["routing"]["dtypes"] == []
    text = format_summary(s)
    assert "samples          0" in text and "reward           -" in text and "routing          none" in text


def test_bad_input_raises(tmp_path: Path) -> None:
    with pytest.raises(TrajectoryFileError, match="missing"):
        summarize(tmp_path / "missing")
    (tmp_path / "junk.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 10)
    with pytest.raises(TrajectoryFileError, match="junk.h5"):
        summarize(tmp_path)
