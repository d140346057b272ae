"""Content-level verification of trajectory shards, for ``miles-hpc inspect --verify`` and the start-up reconciler
(stage: data; docs/formats.md).

:func:`open_shard` checks a shard's layout; :func:`check_shard` goes on to read every byte and check every value
against what the writer guarantees, vectorised over the flat arrays (no Sample objects, so a large shard stays
cheap): offsets and per-sample row counts (the layout), a readable chunk everywhere (HDF5's fletcher32 checksum
makes a corrupted chunk fail its read), status in range, prompt conventions, ``loss_mask`` in {0, 1}, finite
rewards, log-probs neither NaN nor +inf (-inf is log 0, which a Sample allows), the recomputed token hash of every
sample, routing rows and expert ids, indexer rows and key positions (each in -1 .. its row, i.e. the query's own
position, and below ``max_context`` when the shard records one; read in bounded blocks, they are big), metadata
that parses as a JSON object. :func:`verify_shards` adds the checks
across shards: a ``group_id`` stored in more than one complete shard (a group is written by one append, so it
lives in exactly one shard; twice means samples stored twice), and for a run directory the trained steps whose
samples are not all in the shards (:mod:`miles_hpc.data.completeness`: a shard deleted or moved out).

Invariants: nothing is ever raised for bad content, it is returned as :class:`Problem` values naming the file (and
the sample index within it when one sample is at fault); at most :data:`SHOWN` samples are listed per kind of
problem per shard, then one line counts the rest. Optional datasets (``schema.OPTIONAL``) may be absent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from miles_hpc.data import completeness
from miles_hpc.data.sample import SampleStatus, token_hash
from miles_hpc.data.schema import PER_SAMPLE, PER_TOKEN, TrajectoryFileError, find_shards, iter_rows, open_shard

__all__ = ["SHOWN", "Problem", "ShardCheck", "check_shard", "duplicate_groups", "verify_shards"]

SHOWN = 5  # samples listed one by one per kind of problem per shard


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a shard: ``FILE: sample I: WHAT`` (``sample`` is the index within the file)."""

    path: Path
    what: str
    sample: int | None = None

    @property
    def detail(self) -> str:
        """The problem without the file name."""
        return ("" if self.sample is None else f"sample {self.sample}: ") + self.what

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}"


@dataclass(frozen=True, slots=True)
class ShardCheck:
    """What :func:`check_shard` found: the problems, and the per-sample columns the reconciler decides by."""

    path: Path
    problems: tuple[Problem, ...]
    samples: int | None  # None: the layout could not be read, so the count is unknown
    group_id: np.ndarray | None  # None when unreadable
    train_step: np.ndarray | None

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_shards(path: str | Path) -> list[Problem]:
    """Every problem of every complete shard under ``path`` (a shard, a directory or a run directory), then the
    groups stored in more than one shard, then (a run directory or its ``trajectories/``) the trained steps whose
    samples are not all in the shards (:mod:`miles_hpc.data.completeness`). Partial shards are not shards yet and
    are not checked."""
    shards, _ = find_shards(path)
    checks = [check_shard(p) for p in shards]
    return [p for c in checks for p in c.problems] + duplicate_groups(checks) + _missing(path, checks)


def _missing(path: str | Path, checks: Sequence[ShardCheck]) -> list[Problem]:
    """The steps whose metrics rows record more samples than the shards hold, as problems of ``metrics.jsonl``."""
    run = completeness.run_of(path)
    if run is None:
        return []
    stored = completeness.stored_counts(c.train_step for c in checks if c.train_step is not None)
    missing = completeness.missing_samples(run, stored)
    unread = sum(c.train_step is None for c in checks)
    note = f" ({unread} shard(s) could not be read: their samples are not counted)" if unread and missing else ""
    return [Problem(run / completeness.METRICS_FILE, line + note) for line in completeness.describe(missing, SHOWN)]


def duplicate_groups(checks: Sequence[ShardCheck]) -> list[Problem]:
    """One problem per (shard, earlier shard) pair that share group ids; shards are taken in the order given."""
    first: dict[int, Path] = {}
    out: list[Problem] = []
    for c in checks:
        if c.group_id is None:
            continue
        groups, index = np.unique(c.group_id, return_index=True)
        clashes: dict[Path, list[tuple[int, int]]] = {}
        for g, i in zip(groups.tolist(), index.tolist(), strict=True):
            other = first.setdefault(g, c.path)
            if other != c.path:
                clashes.setdefault(other, []).append((g, i))
        for other, hits in clashes.items():
            shown = ", ".join(str(g) for g, _ in hits[:SHOWN]) + (", ..." if len(hits) > SHOWN else "")
            rows = int(np.isin(c.group_id, [g for g, _ in hits]).sum())
            out.append(
                Problem(
                    c.path,
                    f"{len(hits)} group(s) ({rows} samples) also stored in {other.name}: stored twice "
                    f"(group_id {shown})",
                    hits[0][1],
                )
            )
    return out


def check_shard(path: str | Path) -> ShardCheck:
    """Read all of one shard and check every value (module docstring); never raises for bad content."""
    path = Path(path)
    try:
        f, n = open_shard(path)
    except TrajectoryFileError as e:
        return ShardCheck(path, (Problem(path, e.problem),), None, None, None)
    with f:
        problems: list[Problem] = []
        data = _read_all(f, path, problems)
        num_experts = int(f["routing"].attrs.get("num_experts", -1)) if "routing" in f else -1
        if _has(data, "token_offsets", "tokens", "prompt_len"):
            _check_values(data, n, num_experts, _Report(path, problems))
        if "indexer" in f and "token_offsets" in data:
            _check_indexer(f["indexer"], np.diff(data["token_offsets"]), _Report(path, problems))
    group_id, train_step = data.get("group_id"), data.get("train_step")
    return ShardCheck(path, tuple(problems), n, group_id, train_step)


def _read_all(f: h5py.File, path: Path, problems: list[Problem]) -> dict[str, np.ndarray]:
    """Every dataset into memory (bounded by the shard size); a read that fails (a checksum mismatch or a damaged
    chunk or heap) is a problem naming the dataset, and that column is left out."""
    data: dict[str, np.ndarray] = {}
    names = [f"samples/{x}" for x in (*PER_TOKEN, *PER_SAMPLE, "token_offsets")] + [
        "routing/offsets",
        "routing/experts",
    ]
    for name in names:
        if name not in f:  # only an optional one can be absent: open_shard checked the rest
            continue
        ds = f[name]
        try:
            data[name.removeprefix("samples/")] = ds.asstr()[()] if name == "samples/metadata" else ds[()]
        except (OSError, ValueError, TypeError, RuntimeError, UnicodeDecodeError) as e:
            problems.append(Problem(path, f"cannot read {name}: {e} (damaged bytes: a checksum or format mismatch)"))
    return data


def _has(data: dict[str, np.ndarray], *names: str) -> bool:
    return all(n in data for n in names)


class _Report:
    """Collects problems for one shard, listing at most SHOWN samples per kind, then a count of all of them."""

    def __init__(self, path: Path, problems: list[Problem]) -> None:
        self.path, self.problems = path, problems

    def samples(self, bad: np.ndarray, what: str) -> None:
        idx = np.flatnonzero(bad)
        for i in idx[:SHOWN].tolist():
            self.problems.append(Problem(self.path, what, i))
        if len(idx) > SHOWN:
            self.problems.append(Problem(self.path, f"{what}: {len(idx)} samples in all"))


def _check_values(d: dict[str, np.ndarray], n: int, num_experts: int, report: _Report) -> None:
    off = d["token_offsets"]
    lens = np.diff(off)
    prompt_len = d["prompt_len"].astype(np.int64)
    report.samples((prompt_len < 0) | (prompt_len > lens), "prompt_len outside 0..number of tokens")
    # Per-token facts back to their sample: the sample of token t, and whether t is a prompt token.
    owner = np.repeat(np.arange(n), lens)
    in_prompt = (np.arange(int(off[-1])) - np.repeat(off[:-1], lens)) < np.repeat(prompt_len, lens)

    def per_token(bad: np.ndarray) -> np.ndarray:
        out = np.zeros(n, dtype=bool)
        out[owner[bad]] = True
        return out

    token_checks: list[tuple[str, Callable[[np.ndarray], np.ndarray], str]] = [
        ("tokens", lambda t: t < 0, "negative token id"),
        ("loss_mask", lambda m: m > 1, "loss_mask not in {0, 1}"),
        ("loss_mask", lambda m: in_prompt & (m != 0), "loss_mask is not 0 on a prompt token"),
        ("rollout_logprobs", lambda x: np.isnan(x) | (x == np.inf), "rollout_logprobs holds NaN or +inf"),
        ("rollout_logprobs", lambda x: in_prompt & (x != 0), "rollout_logprobs is not 0.0 on a prompt token"),
        ("policy_version", lambda v: v < -1, "policy_version below -1"),
        ("policy_version", lambda v: in_prompt & (v != -1), "policy_version is not -1 on a prompt token"),
    ]
    for name, test, what in token_checks:
        if name in d:
            with np.errstate(invalid="ignore"):
                report.samples(per_token(test(d[name])), what)
    if "status" in d:
        report.samples(d["status"] >= len(SampleStatus), f"status not one of 0..{len(SampleStatus) - 1}")
    if "reward" in d:
        report.samples(~np.isfinite(d["reward"]), "reward is not finite")
    if "train_step" in d:
        report.samples(d["train_step"] < -1, "train_step below -1")
    if _has(d, "tokens", "token_hash"):
        report.samples(_hash_mismatch(d["tokens"], off, d["token_hash"]), "token_hash does not match the tokens")
    if "metadata" in d:
        report.samples(np.array([not _json_object(m) for m in d["metadata"]], dtype=bool), "metadata is not JSON")
    if _has(d, "routing/offsets", "routing/experts"):
        _check_routing(d["routing/offsets"], d["routing/experts"], lens, num_experts, report)


def _hash_mismatch(tokens: np.ndarray, off: np.ndarray, stored: np.ndarray) -> np.ndarray:
    bounds = off.tolist()
    return np.array(
        [stored[i] != token_hash(tokens[bounds[i] : bounds[i + 1]]).encode() for i in range(len(stored))],
        dtype=bool,
    )


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _check_routing(r_off: np.ndarray, experts: np.ndarray, lens: np.ndarray, num_experts: int, report: _Report) -> None:
    rows = np.diff(r_off)
    # A routed sample has 1..len(tokens) rows (SGLang returns len - 1); 0 rows = no routing.
    report.samples(rows > lens, "routing has more rows than the sample has tokens")
    if experts.size:
        owner = np.repeat(np.arange(len(rows)), rows)
        flat = experts.reshape(experts.shape[0], -1).astype(np.int64)
        bad = (flat < 0).any(axis=1)
        what = "negative expert id"
        if num_experts > 0:
            bad |= (flat >= num_experts).any(axis=1)
            what = f"expert id outside 0..{num_experts - 1}"
        hit = np.zeros(len(rows), dtype=bool)
        hit[owner[bad]] = True
        report.samples(hit, what)


def _check_indexer(group: h5py.Group, lens: np.ndarray, report: _Report) -> None:
    """Rows per sample and every key position of ``/indexer``, ``topk`` read block by block (it is big)."""
    try:
        offsets = group["offsets"][()]
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        report.problems.append(Problem(report.path, f"cannot read indexer/offsets: {e} (damaged bytes)"))
        return
    rows = np.diff(offsets)
    report.samples(rows > lens, "indexer has more rows than the sample has tokens")
    max_context = int(group.attrs.get("max_context", -1))
    owner = np.repeat(np.arange(len(rows)), rows)
    query = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], rows)  # row t = the query of token t
    below, after, beyond = (np.zeros(len(rows), dtype=bool) for _ in range(3))
    try:
        for a, block in iter_rows(group["topk"]):
            flat = block.reshape(len(block), -1)
            lo, hi = flat.min(axis=1).astype(np.int64), flat.max(axis=1).astype(np.int64)
            who, t = owner[a : a + len(block)], query[a : a + len(block)]
            below[who[lo < -1]] = True
            after[who[hi > t]] = True
            if max_context > 0:
                beyond[who[hi >= max_context]] = True
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        report.problems.append(
            Problem(report.path, f"cannot read indexer/topk: {e} (damaged bytes: a checksum or format mismatch)")
        )
    report.samples(below, "indexer key position below -1 (-1 is the padding)")
    report.samples(after, "indexer key position after its query's own position (a row t sees keys 0..t)")
    report.samples(beyond, f"indexer key position at or beyond max_context {max_context}")
