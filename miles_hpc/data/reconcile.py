"""Exactly-once trajectories across crashes (stage: data; docs/formats.md): make a trajectory directory hold every
sample that the resumed checkpoint covers, once, and nothing else. Run at start-up, before the writer opens.

The loop stores a step's samples after training it and rolls the open shard before each checkpoint is written, so
a crash at any instant leaves, beside the samples the checkpoint covers (``train_step < next_step``), samples of
steps that the resumed run will generate and store again. :func:`reconcile_trajectories` sorts the shards out:

- every ``*.h5.partial`` (unfinished or torn: never covered) moves to ``quarantine/``;
- every complete shard is verified (:func:`miles_hpc.data.verify.check_shard`); a damaged one moves to
  ``quarantine/`` and the loss is logged loudly (file, what is wrong, how many covered samples);
- a shard whose samples are all covered stays; one with none covered moves to ``quarantine/``;
- a mixed one has its covered samples rewritten into a new shard ``{name}-kept-NNNNN.h5`` (written like any shard:
  ``.partial``, fsync, atomic rename; file attributes ``reconciled_from`` and ``reconciled_next_step``), *then* the
  original moves to ``quarantine/``;
- a ``group_id`` in more than one shard (a group is stored in one append, so this is a sample stored twice) is kept
  in the shard whose name sorts first and dropped from the others, by the same rewrite. A rewritten shard's name
  sorts just before its original's, so the rewrite wins over the original that a kill left behind.

Invariants: nothing is deleted (quarantine keeps every file, a name taken there gets ``.1``, ``.2``...); every
step is a rename or an atomic shard write, and a rewrite lands before its original leaves, so a kill at any point
leaves each covered sample in at least one shard, and the next run converges to exactly once. Running it again
changes nothing (idempotent). Only ``directory`` itself is looked at, never ``quarantine/``. No writer may be open
in ``directory`` meanwhile (its ``.partial`` would be moved away under it): the controller runs this first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from miles_hpc.data.reader import TrajectoryReader
from miles_hpc.data.sample import Sample
from miles_hpc.data.schema import QUARANTINE_DIR, SHARD_SUFFIX, TrajectoryFileError, list_shards, open_shard
from miles_hpc.data.store import TrajectoryWriter, fsync_path
from miles_hpc.data.verify import SHOWN, ShardCheck, check_shard

__all__ = ["Quarantined", "ReconcileReport", "reconcile_trajectories"]

_BLOCK = 1024  # samples per append of a rewrite: bounded memory


class Quarantined(NamedTuple):
    path: Path  # where the file lies now, under quarantine/
    reason: str
    samples: int | None  # None: the file could not be read far enough to count them


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconcileReport:
    """What :func:`reconcile_trajectories` did. Sample counts, of complete shards that verified:
    ``dropped_uncovered`` (train_step >= next_step), ``dropped_duplicate`` (a group already in an earlier shard);
    ``lost_damaged``: covered samples of damaged shards (all their samples where train_step is unreadable; an
    unreadable shard adds nothing, its entry's ``samples`` is None). A partial's samples are in its entry only."""

    directory: Path
    next_step: int
    kept: tuple[Path, ...] = ()
    rewritten: tuple[tuple[Path, Path], ...] = ()  # (original's former path, the new shard)
    quarantined: tuple[Quarantined, ...] = ()
    dropped_uncovered: int = 0
    dropped_duplicate: int = 0
    lost_damaged: int = 0

    @property
    def damaged(self) -> tuple[Quarantined, ...]:
        return tuple(q for q in self.quarantined if q.reason.startswith("damaged"))

    @property
    def changed(self) -> bool:
        return bool(self.rewritten or self.quarantined)

    def describe(self) -> str:
        parts = [f"kept {len(self.kept)} shard(s)"]
        if self.rewritten:
            parts.append(f"rewrote {len(self.rewritten)}")
        if self.quarantined:
            parts.append(f"quarantined {len(self.quarantined)}")
        if self.dropped_uncovered:
            parts.append(f"dropped {self.dropped_uncovered} uncovered sample(s) (steps >= {self.next_step})")
        if self.dropped_duplicate:
            parts.append(f"dropped {self.dropped_duplicate} duplicate sample(s)")
        if self.damaged:
            uncounted = sum(q.samples is None for q in self.damaged)
            more = f" + those of {uncounted} unreadable shard(s)" if uncounted else ""
            parts.append(f"DAMAGED {len(self.damaged)} shard(s): {self.lost_damaged} covered sample(s){more} lost")
        return f"trajectories {self.directory} at next_step={self.next_step}: " + ", ".join(parts)


def reconcile_trajectories(
    directory: str | Path, next_step: int, *, log: Callable[[str], object] = print
) -> ReconcileReport:
    """Leave in ``directory`` exactly the samples with ``train_step < next_step``, each once (module docstring).
    ``next_step``: the resumed checkpoint's (0 on a fresh start). ``log`` gets one line per action."""
    if next_step < 0:
        raise ValueError(f"next_step must be >= 0, got {next_step}")
    d = Path(directory)
    if not d.is_dir():
        return ReconcileReport(directory=d, next_step=next_step)
    r = _Reconciler(d, next_step, log)
    shards, partials = list_shards(d)
    for p in partials:
        r.quarantine(p, "partial: an unfinished or torn shard (its writer never closed it), never covered", _count(p))
    good = []
    for c in map(check_shard, shards):
        if c.ok:
            good.append(c)
        else:
            r.damaged(c)
    seen: dict[int, Path] = {}  # group_id -> the shard that keeps it
    for c in good:
        r.decide(c, seen)
    return r.report()


class _Reconciler:
    def __init__(self, d: Path, next_step: int, log: Callable[[str], object]) -> None:
        self.d, self.next_step, self.log = d, next_step, log
        self.kept: list[Path] = []
        self.rewritten: list[tuple[Path, Path]] = []
        self.quarantined: list[Quarantined] = []
        self.uncovered = self.duplicate = self.lost = 0

    def report(self) -> ReconcileReport:
        return ReconcileReport(
            directory=self.d,
            next_step=self.next_step,
            kept=tuple(self.kept),
            rewritten=tuple(self.rewritten),
            quarantined=tuple(self.quarantined),
            dropped_uncovered=self.uncovered,
            dropped_duplicate=self.duplicate,
            lost_damaged=self.lost,
        )

    def quarantine(self, path: Path, reason: str, samples: int | None) -> None:
        qdir = self.d / QUARANTINE_DIR
        qdir.mkdir(exist_ok=True)
        target, k = qdir / path.name, 0
        while target.exists() or target.is_symlink():  # never overwrite an earlier quarantined file
            k += 1
            target = qdir / f"{path.name}.{k}"
        os.rename(path, target)  # same directory tree: atomic
        fsync_path(qdir)
        fsync_path(self.d)
        self.quarantined.append(Quarantined(target, reason, samples))
        self.log(f"[miles-hpc] trajectories: moved {path.name} to {QUARANTINE_DIR}/{target.name}: {reason}")

    def damaged(self, c: ShardCheck) -> None:
        covered = None if c.train_step is None else int((c.train_step < self.next_step).sum())
        lost = covered if covered is not None else c.samples
        self.lost += lost or 0
        count = "an unknown number of" if lost is None else str(lost)
        of = "" if c.samples is None else f" (of its {c.samples})"
        reason = f"damaged: {c.problems[0].detail}" + (
            f" (and {len(c.problems) - 1} more problem(s))" if len(c.problems) > 1 else ""
        )
        self.log(
            f"[miles-hpc] WARNING: trajectory shard {c.path} is DAMAGED: {count} covered sample(s) lost{of}; "
            f"it moves to {QUARANTINE_DIR}/. Problems:"
        )
        for p in c.problems[:SHOWN]:
            self.log(f"[miles-hpc]   {p}")
        self.quarantine(c.path, reason, c.samples)

    def decide(self, c: ShardCheck, seen: dict[int, Path]) -> None:
        """Keep, quarantine or rewrite one verified shard; ``seen`` maps the groups kept so far to their shard."""
        assert c.train_step is not None and c.group_id is not None and c.samples is not None
        covered = c.train_step < self.next_step
        groups, inverse = np.unique(c.group_id, return_inverse=True)
        elsewhere = [seen.get(g) for g in groups.tolist()]
        dup = np.array([e is not None for e in elsewhere], dtype=bool)[inverse.reshape(-1)]
        keep = covered & ~dup
        self.uncovered += int((~covered).sum())
        self.duplicate += int((covered & dup).sum())
        if keep.all():
            self.kept.append(c.path)
            home = c.path
        else:
            why = self._why(c, covered, dup, {e for e in elsewhere if e is not None})
            if not keep.any():
                self.quarantine(c.path, why, c.samples)
                return
            home = self._rewrite(c, keep, why)  # lands whole before the original moves
            self.rewritten.append((c.path, home))
            self.quarantine(
                c.path, f"rewritten: its {int(keep.sum())} kept sample(s) are in {home.name}; {why}", c.samples
            )
        for g in np.unique(c.group_id[keep]).tolist():
            seen[g] = home

    def _why(self, c: ShardCheck, covered: np.ndarray, dup: np.ndarray, others: set[Path]) -> str:
        assert c.train_step is not None
        out = []
        if not covered.all():
            late = c.train_step[~covered]
            out.append(
                f"uncovered: {int((~covered).sum())} sample(s) of steps {int(late.min())}..{int(late.max())} come "
                f"after checkpoint next_step={self.next_step}"
            )
        if (covered & dup).any():
            names = ", ".join(sorted(p.name for p in others))
            out.append(f"duplicate: {int((covered & dup).sum())} sample(s) whose groups are already in {names}")
        return "; ".join(out)

    def _rewrite(self, c: ShardCheck, keep: np.ndarray, why: str) -> Path:
        """The kept samples of ``c`` as a new shard beside it; checked before the caller quarantines ``c``."""
        with h5py.File(c.path, "r") as f:
            model, run_id = str(f.attrs["model"]), str(f.attrs["run_id"])
            experts = int(f["routing"].attrs.get("num_experts", -1))
            compression = f["samples/tokens"].compression
            max_context = _max_context(f)
        w = TrajectoryWriter(
            self.d,
            prefix=c.path.name.removesuffix(SHARD_SUFFIX) + "-kept",
            model=model,
            run_id=run_id,
            max_shard_bytes=1 << 62,  # one shard, whatever its size
            num_experts=experts if experts > 0 else None,
            max_context=max_context,
            compression=compression,
            attrs={"reconciled_from": c.path.name, "reconciled_next_step": self.next_step},
        )
        try:
            for block in _blocks(c.path, keep):
                w.append(block)
        except BaseException:
            w.abort()  # stays .partial: the next run quarantines it and rewrites again
            raise
        w.close()
        (new,) = w.paths
        check = check_shard(new)
        if not check.ok or check.samples != int(keep.sum()):
            raise TrajectoryFileError(new, f"the rewrite of {c.path.name} does not verify: {check.problems[:1]}")
        self.log(f"[miles-hpc] trajectories: rewrote {c.path.name} as {new.name} ({int(keep.sum())} sample(s)): {why}")
        return new


def _max_context(f: h5py.File) -> int | None:
    """The ``max_context`` a rewrite of ``f`` needs to keep its indexer records' dtype: the original's, or (unknown
    there) the bound of its dtype, since a rewrite's first block need not hold the positions that chose it."""
    if "indexer" not in f:
        return None
    known = int(f["indexer"].attrs.get("max_context", -1))
    return known if known > 0 else int(np.iinfo(f["indexer/topk"].dtype).max) + 1


def _blocks(path: Path, keep: np.ndarray) -> Iterator[list[Sample]]:
    block: list[Sample] = []
    for sample, k in zip(TrajectoryReader(path), keep.tolist(), strict=True):
        if k:
            block.append(sample)
        if len(block) == _BLOCK:
            yield block
            block = []
    if block:
        yield block


def _count(path: Path) -> int | None:
    """Samples of a partial shard, when its layout reads (a writer killed mid-append leaves one that does not)."""
    try:
        f, n = open_shard(path)
    except TrajectoryFileError:
        return None
    f.close()
    return n
