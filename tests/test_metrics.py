"""`MetricsLogger` (issue 23 item 3): a resumed run never repeats a step in metrics.jsonl or TensorBoard; a torn
last line from a kill is dropped, every other line kept byte for byte; the progress line shows failure counts."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from miles_hpc.metrics import MetricsLogger, truncate_metrics


def rows(n: int) -> bytes:
    return b"".join(json.dumps({"step": s, "reward_mean": s / 10, "x": "é"}).encode() + b"\n" for s in range(n))


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_removes_the_steps_that_run_again(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(rows(6) + b'{"step": 6, "rew')  # killed mid-write of step 6
    os.chmod(metrics, 0o640)
    log = MetricsLogger(tmp_path, total_steps=10, console=None, resume_step=3)
    assert metrics.read_bytes() == rows(3)  # rows kept byte for byte, nothing repeated
    for step in range(3, 5):
        log.log(step, {"reward_mean": 1.0})
    log.close()
    assert steps(metrics) == [0, 1, 2, 3, 4]
    assert oct(metrics.stat().st_mode & 0o777) == "0o640"  # the atomic rewrite keeps the file's mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tb"]  # no temp file left


def test_a_torn_last_line_goes_even_without_resume(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(rows(2) + b'{"step": 2, "rew')
    assert truncate_metrics(metrics, None) == 1 and metrics.read_bytes() == rows(2)
    assert truncate_metrics(metrics, None) == 0  # idempotent
    metrics.write_bytes(rows(2) + b'{"step": 2}')  # whole, only the newline missing: kept, newline added
    assert truncate_metrics(metrics, None) == 0 and metrics.read_bytes() == rows(2) + b'{"step": 2}\n'
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == 0


def test_lines_that_do_not_parse_stay_in_place(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    body = rows(2) + b"not json \xff\n" + b'{"no_step": 1}\n' + rows(5)[len(rows(3)) :]
    metrics.write_bytes(body)
    assert truncate_metrics(metrics, 4) == 1  # only step 4 goes
    assert metrics.read_bytes() == rows(2) + b"not json \xff\n" + b'{"no_step": 1}\n' + rows(4)[len(rows(3)) :]


def test_a_fresh_start_over_a_crashed_attempt_clears_it(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(rows(3))
    MetricsLogger(tmp_path, total_steps=3, console=None, resume_step=0).close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == b""
    MetricsLogger(tmp_path, total_steps=3, console=None).close()  # no resume_step: nothing removed
    assert (tmp_path / "metrics.jsonl").read_bytes() == b""


def test_tensorboard_purges_the_steps_that_run_again(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, total_steps=6, console=None)
    for step in range(5):
        first.log(step, {"reward_mean": float(step)})
    first.close()
    second = MetricsLogger(tmp_path, total_steps=6, console=None, resume_step=2)
    for step in range(2, 6):
        second.log(step, {"reward_mean": 10.0 + step})
    second.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = [(e.step, e.value) for e in acc.Scalars("reward_mean")]
    assert events == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 15.0)]


@pytest.mark.parametrize(
    ("metrics", "shown", "hidden"),
    [
        ({"rollout/failed": 3, "rollout/skipped_prompts": 2}, ["failed 3", "skipped 2"], []),
        ({"rollout/failed": 0, "rollout/skipped_prompts": 0.0}, [], ["failed", "skipped"]),
        ({"rollout/failed": float("nan")}, [], ["failed"]),
    ],
)
def test_progress_line_shows_failure_counts(
    tmp_path: Path, metrics: dict[str, float], shown: list[str], hidden: list[str]
) -> None:
    console = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=4, console=console)
    log.log(0, {"reward_mean": 0.5, **metrics})
    log.close()
    line = console.getvalue()
    assert line.startswith("[miles-hpc] step 1/4 | reward 0.500")
    for words in shown:
        assert f"| {words} |" in line
    for words in hidden:
        assert words not in line
