"""Exactly-once trajectories (issue 23): the start-up reconciler on every layout a crash can leave, real HDF5 files.

Layouts are written as the loop writes them: one append per step (its groups), ``roll()`` at each checkpoint; a
crash is a writer that never closes (``abort``: its shard stays ``.partial``). Every test checks the exact sample
accounting: the samples left are the covered ones (``train_step < next_step``), each once, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from miles_hpc.data import (
    Sample,
    TrajectoryFileError,
    TrajectoryReader,
    TrajectoryWriter,
    reconcile_trajectories,
    summarize,
)
from miles_hpc.data import reconcile as reconcile_mod
from miles_hpc.data.reconcile import ReconcileReport

GROUPS, PER_GROUP = 2, 2  # per step


def step_samples(step: int) -> list[Sample]:
    out = []
    for g in range(GROUPS):
        gid = step * 1_000_000 + g  # as the sync loop numbers groups: unique per step, the same when regenerated
        for j in range(PER_GROUP):
            response = 2 + (step + j) % 3
            out.append(
                Sample(
                    prompt_id=step * 10 + g,
                    group_id=gid,
                    tokens=[(step * 7 + g * 3 + j + k) % 250 for k in range(3 + response)],
                    prompt_len=3,
                    loss_mask=[0, 0, 0] + [1] * response,
                    rollout_logprobs=[0.0] * 3 + [-0.125 * (k + 1) for k in range(response)],
                    policy_version=[-1] * 3 + [step] * response,
                    reward=float(j) - 0.5,
                    routed_experts=(np.arange((2 + response) * 4) % 8).reshape(2 + response, 2, 2),
                    metadata={"j": j},
                    train_step=step,
                )
            )
    return out


def key(s: Sample) -> tuple[Any, ...]:
    """Everything a sample holds (Sample has no equality of its own)."""
    routing = (
        None if s.routed_experts is None else (s.routed_experts.shape, s.routed_experts.astype(np.int64).tobytes())
    )
    return (
        s.group_id,
        s.prompt_id,
        s.train_step,
        tuple(s.tokens),
        s.prompt_len,
        tuple(s.loss_mask),
        tuple(s.rollout_logprobs),
        tuple(s.policy_version),
        s.reward,
        int(s.status),
        s.token_hash,
        json.dumps(s.metadata),
        routing,
    )


def covered(next_step: int, first: int = 0) -> Counter[tuple[Any, ...]]:
    return Counter(key(s) for step in range(first, next_step) for s in step_samples(step))


def stored(d: Path) -> Counter[tuple[Any, ...]]:
    return Counter(key(s) for s in TrajectoryReader(d))


def readable(d: Path) -> Counter[tuple[Any, ...]]:
    """The samples of every complete shard in ``d`` that reads (damaged ones not yet moved are left out)."""
    out: Counter[tuple[Any, ...]] = Counter()
    for shard in sorted(d.glob("*.h5")):
        try:
            out.update(key(s) for s in TrajectoryReader(shard))
        except TrajectoryFileError:
            pass
    return out


def run(d: Path, steps: range, checkpoints: set[int], *, prefix: str, crash: bool = False) -> TrajectoryWriter:
    """Store ``steps`` as the loop does: append per step, roll before the checkpoint of next_step in ``checkpoints``
    is written; ``crash``: the run dies after its last step (the open shard stays .partial)."""
    w = TrajectoryWriter(d, prefix=prefix, model="tiny-moe", run_id="r1", max_shard_bytes=1 << 20, num_experts=8)
    for step in steps:
        w.append(step_samples(step))
        if step + 1 in checkpoints:
            w.roll()
    if crash:
        w.abort()
    else:
        w.close()
    return w


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_file())


def quarantined(d: Path) -> list[str]:
    return names(d / "quarantine") if (d / "quarantine").is_dir() else []


def reconcile(d: Path, next_step: int) -> tuple[ReconcileReport, list[str]]:
    lines: list[str] = []
    return reconcile_trajectories(d, next_step, log=lines.append), lines


def test_all_covered_is_left_alone(tmp_path: Path) -> None:
    run(tmp_path, range(10), {5, 10}, prefix="traj-s000000")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    report, lines = reconcile(tmp_path, 10)
    assert [p.name for p in report.kept] == ["traj-s000000-00000.h5", "traj-s000000-00001.h5"]
    assert not report.changed and lines == [] and report.dropped_uncovered == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # not even rewritten
    assert stored(tmp_path) == covered(10)


def test_all_uncovered_goes_to_quarantine(tmp_path: Path) -> None:
    # Rolled at 5 for a checkpoint whose meta.json never landed: the run resumes from step_0... a fresh start.
    run(tmp_path, range(5), {5}, prefix="traj-s000000")
    report, lines = reconcile(tmp_path, 0)
    assert report.kept == () and report.dropped_uncovered == 5 * GROUPS * PER_GROUP
    (q,) = report.quarantined
    assert q.path == tmp_path / "quarantine" / "traj-s000000-00000.h5" and q.samples == 20
    assert q.reason == "uncovered: 20 sample(s) of steps 0..4 come after checkpoint next_step=0"
    assert names(tmp_path) == [] and quarantined(tmp_path) == ["traj-s000000-00000.h5"]
    assert len(TrajectoryReader(tmp_path)) == 0 and len(TrajectoryReader(q.path)) == 20  # kept, never deleted
    assert "traj-s000000-00000.h5" in lines[0] and "next_step=0" in lines[0]


def test_the_issue_layout_roll_then_kill_before_meta(tmp_path: Path) -> None:
    """Issue 23 item 3: checkpoint 10 rolled the shard of steps 0-9, then the kill came before its meta.json; the
    run resumes from scratch and stores steps 0-9 again. Before reconcile: 640 duplicates in the real run."""
    run(tmp_path, range(10), {10}, prefix="traj-s000000", crash=True)  # rolled, then killed
    report, _ = reconcile(tmp_path, 0)
    assert report.dropped_uncovered == 40 and names(tmp_path) == []
    run(tmp_path, range(10), {10}, prefix="traj-s000000")  # the rerun
    assert stored(tmp_path) == covered(10)


def test_mixed_shard_is_rewritten_with_its_covered_samples(tmp_path: Path) -> None:
    run(tmp_path, range(3), {3}, prefix="traj-s000000")  # shard 0: steps 0-2
    run(tmp_path, range(3, 8), set(), prefix="traj-s000003")  # steps 3-7 in one shard, no roll at 5
    run(tmp_path, range(8, 9), set(), prefix="traj-s000008")  # all after the checkpoint
    with h5py.File(tmp_path / "traj-s000003-00000.h5") as f:
        old_writer = f.attrs["writer"]
    report, lines = reconcile(tmp_path, 5)
    assert stored(tmp_path) == covered(5)  # exactly steps 0-4, each once
    ((orig, new),) = report.rewritten
    assert orig == tmp_path / "traj-s000003-00000.h5" and new.name == "traj-s000003-00000-kept-00000.h5"
    assert names(tmp_path) == ["traj-s000000-00000.h5", "traj-s000003-00000-kept-00000.h5"]
    assert quarantined(tmp_path) == ["traj-s000003-00000.h5", "traj-s000008-00000.h5"]
    assert [p.name for p in report.kept] == ["traj-s000000-00000.h5"]
    assert report.dropped_uncovered == (3 + 1) * GROUPS * PER_GROUP and report.dropped_duplicate == 0
    # Reading order is the order of the steps: the rewrite sorts where its original did.
    assert [s.train_step for s in TrajectoryReader(tmp_path)] == sorted(
        s.train_step for s in TrajectoryReader(tmp_path)
    )
    with h5py.File(new) as f:
        assert f.attrs["reconciled_from"] == "traj-s000003-00000.h5" and f.attrs["reconciled_next_step"] == 5
        assert (f.attrs["model"], f.attrs["run_id"]) == ("tiny-moe", "r1") and f.attrs["writer"] != "" and old_writer
        assert f["routing"].attrs["num_experts"] == 8 and f["routing/experts"].dtype == np.uint8
        assert f["samples/tokens"].fletcher32
    moved = {q.path.name: q for q in report.quarantined}["traj-s000003-00000.h5"]
    assert moved.samples == 20 and "kept sample(s) are in traj-s000003-00000-kept-00000.h5" in moved.reason
    assert "steps 5..7 come after checkpoint next_step=5" in moved.reason
    assert any("rewrote traj-s000003-00000.h5" in line for line in lines)
    assert "rewrote 1" in report.describe() and "quarantined 2" in report.describe()


def test_compressed_shard_is_rewritten_compressed(tmp_path: Path) -> None:
    w = TrajectoryWriter(tmp_path, prefix="t", model="m", run_id="r", compression="gzip")
    for step in range(4):
        w.append(step_samples(step))
    w.close()
    report, _ = reconcile(tmp_path, 2)
    ((_, new),) = report.rewritten
    with h5py.File(new) as f:
        assert f["samples/tokens"].compression == "gzip" and f["routing"].attrs["num_experts"] == -1
    assert stored(tmp_path) == covered(2)


def test_partial_shards_go_to_quarantine(tmp_path: Path) -> None:
    run(tmp_path, range(4), {2}, prefix="traj-s000000", crash=True)  # steps 2-3 in a partial
    report, _ = reconcile(tmp_path, 2)
    (q,) = report.quarantined
    assert q.path.name == "traj-s000000-00001.h5.partial" and q.samples == 8 and q.reason.startswith("partial")
    assert names(tmp_path) == ["traj-s000000-00000.h5"] and stored(tmp_path) == covered(2)
    assert summarize(tmp_path)["partial_shards"] == 0


def test_duplicate_groups_across_shards_keep_the_first(tmp_path: Path) -> None:
    """Shards from before this fix: steps 0-4 stored twice (once by the killed run, once by its resume), both
    complete and both covered by checkpoint 5. The first by name stays; the second goes."""
    run(tmp_path, range(5), {5}, prefix="traj-s000000")
    run(tmp_path, range(3, 7), {5}, prefix="traj-s000003")  # 3-4 again (rolled at 5), then 5-6
    report, _ = reconcile(tmp_path, 7)
    assert stored(tmp_path) == covered(7)
    assert report.dropped_duplicate == 2 * GROUPS * PER_GROUP and report.dropped_uncovered == 0
    assert [p.name for p in report.kept] == ["traj-s000000-00000.h5", "traj-s000003-00001.h5"]
    (q,) = report.quarantined
    assert q.path.name == "traj-s000003-00000.h5"
    assert q.reason == "duplicate: 8 sample(s) whose groups are already in traj-s000000-00000.h5"


def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_reward(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        f["samples/reward"][3] = np.nan


def _garbage(path: Path) -> None:
    with h5py.File(path) as f:
        info = f["samples/tokens"].id.get_chunk_info(0)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset)
        f.write(os.urandom(info.size))


@pytest.mark.parametrize(
    ("damage", "counted"), [(lambda p: _cut(p, 0.5), False), (_flip_reward, True), (_garbage, True)]
)
def test_a_damaged_shard_is_quarantined_loudly(tmp_path: Path, damage: Any, counted: bool) -> None:
    run(tmp_path, range(6), {3}, prefix="traj-s000000")  # shards: steps 0-2, steps 3-5
    damage(tmp_path / "traj-s000000-00000.h5")
    report, lines = reconcile(tmp_path, 5)
    assert stored(tmp_path) == covered(5, first=3)  # what survives: steps 3-4; the damaged shard's are gone
    (q,) = report.damaged
    assert q.path.name == "traj-s000000-00000.h5" and q.reason.startswith("damaged: ")
    assert report.lost_damaged == (12 if counted else 0) and (q.samples == 12) == counted
    assert lines[0].startswith("[miles-hpc] WARNING: trajectory shard") and "DAMAGED" in lines[0]
    assert str(tmp_path / "traj-s000000-00000.h5") in lines[0]
    assert ("12 covered sample(s) lost" in lines[0]) == counted
    assert "DAMAGED 1 shard(s)" in report.describe()
    assert ("unreadable" in report.describe()) != counted


def test_a_fresh_start_and_a_missing_directory(tmp_path: Path) -> None:
    report = reconcile_trajectories(tmp_path / "nothing", 0, log=pytest.fail)
    assert report == ReconcileReport(directory=tmp_path / "nothing", next_step=0) and not report.changed
    with pytest.raises(ValueError, match="next_step"):
        reconcile_trajectories(tmp_path, -1)


def test_no_descent_into_quarantine(tmp_path: Path) -> None:
    run(tmp_path / "trajectories", range(4), {2}, prefix="traj-s000000")
    reconcile(tmp_path / "trajectories", 2)
    assert quarantined(tmp_path / "trajectories") == ["traj-s000000-00001.h5"]
    assert stored(tmp_path) == covered(2)  # a run directory: its trajectories/, not trajectories/quarantine/
    assert summarize(tmp_path)["shards"] == 1
    report, lines = reconcile(tmp_path / "trajectories", 2)
    assert not report.changed and lines == []  # the quarantined shard stays where it is


def _complex(d: Path) -> None:
    """Every kind at once, as runs before this fix could leave them; a checkpoint of next_step 6 is the latest."""
    run(d, range(4), {2, 4}, prefix="traj-s000000")  # 0-1 | 2-3 (rolled for checkpoint 4, whose meta never landed)
    run(d, range(2, 9), {4, 8}, prefix="traj-s000002", crash=True)  # 2-3 again (dup) | 4-7 (mixed at 6) | 8 partial
    run(d, range(9, 10), set(), prefix="traj-s000009")
    _flip_reward(d / "traj-s000009-00000.h5")  # damaged
    (d / "traj-s000001-00000.h5.partial").write_bytes(os.urandom(100))  # a torn file


COMPLEX_NEXT_STEP = 6
COMPLEX_EXPECTED = covered(6)


def test_idempotent_on_every_layout_at_once(tmp_path: Path) -> None:
    _complex(tmp_path)
    first, _ = reconcile(tmp_path, COMPLEX_NEXT_STEP)
    assert stored(tmp_path) == COMPLEX_EXPECTED
    assert len(first.quarantined) == 5 and len(first.rewritten) == 1 and len(first.damaged) == 1
    assert first.dropped_duplicate == 8 and first.dropped_uncovered == 2 * 4 and first.lost_damaged == 0
    assert names(tmp_path) == ["traj-s000000-00000.h5", "traj-s000000-00001.h5", "traj-s000002-00001-kept-00000.h5"]
    after = (names(tmp_path), quarantined(tmp_path))
    second, lines = reconcile(tmp_path, COMPLEX_NEXT_STEP)
    assert not second.changed and lines == [] and (names(tmp_path), quarantined(tmp_path)) == after
    assert [p.name for p in second.kept] == after[0]


class Killed(BaseException):
    """The process dies here (SIGKILL): nothing after this point runs."""


def _kill_at(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    """Make the k-th file-system step of the reconciler (a rename, a shard's final rename, an append) the last."""
    done: list[str] = []

    def wrap(name: str, owner: Any, attr: str) -> None:
        real = getattr(owner, attr)

        def step(*a: Any, **kw: Any) -> Any:
            if len(done) == k:
                raise Killed(name)
            done.append(name)
            return real(*a, **kw)

        monkeypatch.setattr(owner, attr, step)

    wrap("rename", os, "rename")
    wrap("replace", os, "replace")
    wrap("append", TrajectoryWriter, "append")
    return done


def test_a_kill_at_any_step_of_reconcile_converges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kill the reconciler after each of its file-system steps in turn (one sample per append, so a rewrite dies
    half-written too); then a second run, unhindered, must leave exactly the covered samples, each once."""
    monkeypatch.setattr(reconcile_mod, "_BLOCK", 1)
    template = tmp_path / "template"
    _complex(template)
    k = 0
    while True:
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d)
        with monkeypatch.context() as m:
            done = _kill_at(m, k)
            try:
                reconcile(d, COMPLEX_NEXT_STEP)
                finished = True
            except Killed:
                finished = False
        # Mid-way nothing covered is missing (duplicates may exist until the next run).
        left = readable(d)
        assert all(left[s] >= n for s, n in COMPLEX_EXPECTED.items()), f"kill after step {k}: covered sample lost"
        reconcile(d, COMPLEX_NEXT_STEP)
        assert stored(d) == COMPLEX_EXPECTED, f"kill after step {k} ({done[-1:]})"
        again, _ = reconcile(d, COMPLEX_NEXT_STEP)
        assert not again.changed
        if finished:
            break
        k += 1
    # 14 steps: 2 partials, the damaged and the duplicate shard moved, 8 appends (one per kept sample) and the final
    # rename of the rewrite, then its original moved.
    assert k == 14


def test_a_second_kill_during_the_rerun_converges_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconcile_mod, "_BLOCK", 1)
    _complex(tmp_path)
    for k in (9, 3, 5, 2):  # killed again and again, each time a little way in
        with monkeypatch.context() as m:
            _kill_at(m, k)
            with pytest.raises(Killed):
                reconcile(tmp_path, COMPLEX_NEXT_STEP)
    reconcile(tmp_path, COMPLEX_NEXT_STEP)
    assert stored(tmp_path) == COMPLEX_EXPECTED
    # Each killed rewrite left its .partial; quarantine keeps them all, under names that never overwrite.
    torn = "traj-s000002-00001-kept-00000.h5.partial"
    assert quarantined(tmp_path) == sorted(
        [torn, f"{torn}.1", f"{torn}.2", f"{torn}.3", "traj-s000002-00001.h5"]
        + ["traj-s000001-00000.h5.partial", "traj-s000002-00000.h5", "traj-s000002-00002.h5.partial"]
        + ["traj-s000009-00000.h5"]
    )


def test_a_later_reconcile_at_an_earlier_step_shrinks_a_rewrite(tmp_path: Path) -> None:
    run(tmp_path, range(6), set(), prefix="t")
    reconcile(tmp_path, 4)
    report, _ = reconcile(tmp_path, 2)  # the checkpoint of step 4 was lost: back to 2
    assert stored(tmp_path) == covered(2)
    ((orig, new),) = report.rewritten
    assert (orig.name, new.name) == ("t-00000-kept-00000.h5", "t-00000-kept-00000-kept-00000.h5")
