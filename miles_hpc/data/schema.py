"""The HDF5 trajectory shard layout (stage: data; docs/design.md section 7, a contract) and its validation.

One shard = one HDF5 file, written by one writer. Layout (N samples, T tokens, T_r routing rows, T_i indexer rows)::

    attrs: schema_version, model, run_id, writer
    /samples/tokens int32[T]  token_offsets int64[N+1]  loss_mask uint8[T]  rollout_logprobs float32[T]
             policy_version int32[T]  reward float32[N]  prompt_len int32[N]  group_id int64[N]  status uint8[N]
             train_step int32[N]  prompt_id int64[N]  token_hash S32[N]  metadata vlen-utf8-JSON[N]
    /routing/experts uint8|int16|int32[T_r, layers, top_k]  offsets int64[N+1]   attrs: num_experts (-1 = unknown)
    /indexer/topk int16|int32[T_i, indexer_layers, index_topk]  offsets int64[N+1]   attrs: max_context (-1 = unknown)

The datasets in :data:`OPTIONAL` (``prompt_id``, ``token_hash``, ``metadata``) may be absent; the others must be
there. The ``/indexer`` group is optional as a whole: a shard holds it only when one of its samples has indexer
records (shards written before indexer replay never do). Invariants checked by :func:`open_shard` before anything
is read: every dataset present with its dtype, ``token_offsets``, ``routing/offsets`` and ``indexer/offsets`` start
at 0, never decrease and end at the length of the data they index, and every per-sample dataset has N rows. A file that breaks any of them raises :class:`TrajectoryFileError`
naming the file; h5py's own exceptions never reach the user unwrapped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np

from miles_hpc.data.sample import SCHEMA_VERSION

__all__ = [
    "FILE_ATTRS",
    "OPTIONAL",
    "PER_SAMPLE",
    "QUARANTINE_DIR",
    "PER_TOKEN",
    "INDEXER_DTYPES",
    "ROUTING_DTYPES",
    "TrajectoryFileError",
    "expert_dtype",
    "find_shards",
    "iter_rows",
    "list_shards",
    "open_shard",
    "position_dtype",
]

# name -> numpy dtype; the order is the order datasets are created in (cosmetic only).
PER_TOKEN: dict[str, np.dtype] = {
    "tokens": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "rollout_logprobs": np.dtype("<f4"),
    "policy_version": np.dtype("<i4"),
}
PER_SAMPLE: dict[str, np.dtype] = {
    "reward": np.dtype("<f4"),
    "prompt_len": np.dtype("<i4"),
    "group_id": np.dtype("<i8"),
    "status": np.dtype("u1"),
    "train_step": np.dtype("<i4"),
    "prompt_id": np.dtype("<i8"),
    "token_hash": np.dtype("S32"),
    "metadata": h5py.string_dtype("utf-8"),
}
# Per-sample datasets a shard may lack (docs/formats.md marks them +): without them a Sample still reads, with
# prompt_id -1 (unknown), the token hash computed from the tokens (nothing to check it against) and metadata {}.
OPTIONAL: frozenset[str] = frozenset({"prompt_id", "token_hash", "metadata"})
OFFSETS_DTYPE = np.dtype("<i8")
ROUTING_DTYPES = (np.dtype("u1"), np.dtype("<i2"), np.dtype("<i4"))
INDEXER_DTYPES = (np.dtype("<i2"), np.dtype("<i4"))  # signed: -1 is the padding entry
FILE_ATTRS = ("schema_version", "model", "run_id", "writer")
SHARD_SUFFIX = ".h5"
PARTIAL_SUFFIX = ".h5.partial"
QUARANTINE_DIR = "quarantine"  # under a trajectories directory: shards moved aside by the reconciler, never read


class TrajectoryFileError(Exception):
    """A trajectory file or directory is missing, unreadable, not HDF5, or not a valid shard of this schema."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


_Bad = Callable[[str], TrajectoryFileError]


def expert_dtype(num_experts: int | None) -> np.dtype:
    """The smallest dtype that holds expert ids ``0 .. num_experts-1``.

    ``None`` (unknown count) gets int16: a later batch may hold larger ids than the first, and HDF5 cannot widen
    a dataset in place, so the writer starts wide enough for any real MoE (<= 32768 experts).
    """
    if num_experts is None:
        return np.dtype("<i2")
    if num_experts <= 256:
        return np.dtype("u1")
    return np.dtype("<i2") if num_experts <= 32768 else np.dtype("<i4")


def position_dtype(max_position: int) -> np.dtype:
    """The smaller of int16 / int32 that holds key positions ``-1 .. max_position`` (the indexer's records)."""
    return np.dtype("<i2") if max_position <= np.iinfo(np.int16).max else np.dtype("<i4")


def iter_rows(ds: h5py.Dataset, max_bytes: int = 1 << 26) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, rows)`` blocks of ``ds`` along axis 0, each at most ``max_bytes`` (at least one row): a
    dataset too big to read whole (the indexer's records) read in bounded memory."""
    row_bytes = max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64)))
    step = max(1, max_bytes // row_bytes)
    for a in range(0, ds.shape[0], step):
        yield a, ds[a : a + step]


def find_shards(path: str | Path) -> tuple[list[Path], list[Path]]:
    """``(complete shards, partial shards)`` under ``path``, each sorted by name.

    ``path`` is a shard file, a directory of shards, or a run directory (whose ``trajectories/`` is used).
    Partial shards (``*.h5.partial``) are never read: they are being written, or their writer crashed. Only the
    directory itself is listed: ``quarantine/`` (and any other subdirectory) is never descended into.
    """
    p = Path(path)
    if p.is_file():
        return [p], []
    if not p.is_dir():
        raise TrajectoryFileError(p, "no such file or directory")
    if not any(p.glob(f"*{SHARD_SUFFIX}*")) and (p / "trajectories").is_dir():
        p = p / "trajectories"
    return list_shards(p)


def list_shards(directory: Path) -> tuple[list[Path], list[Path]]:
    """``(complete, partial)`` shard files directly in ``directory`` (no subdirectory), each sorted by name."""
    shards = sorted(q for q in directory.glob(f"*{SHARD_SUFFIX}") if q.is_file())
    partials = sorted(q for q in directory.glob(f"*{PARTIAL_SUFFIX}") if q.is_file())
    return shards, partials


def shard_index(name: str, prefix: str) -> int | None:
    """The index of ``{prefix}-{index:05d}.h5[.partial]``, or None when ``name`` is not such a shard."""
    m = re.fullmatch(re.escape(prefix) + r"-(\d+)\.h5(\.partial)?", name)
    return int(m.group(1)) if m else None


def open_shard(path: str | Path) -> tuple[h5py.File, int]:
    """Open ``path`` read-only and validate its layout; return ``(file, number of samples)``.

    The caller owns the returned file and must close it.
    """
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError as e:
        raise TrajectoryFileError(path, "no such file") from e
    except OSError as e:
        # h5py reports truncation and foreign bytes as OSError; keep its reason, drop its traceback.
        why = "truncated or corrupt HDF5 file" if h5py.is_hdf5(path) or "truncated" in str(e) else "not an HDF5 file"
        raise TrajectoryFileError(path, f"{why} ({e})") from e
    try:
        n = _validate(f, path)
    except TrajectoryFileError:
        f.close()
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        f.close()
        raise TrajectoryFileError(path, f"unreadable trajectory shard ({type(e).__name__}: {e})") from e
    return f, n


def _validate(f: h5py.File, path: Path) -> int:
    def bad(problem: str) -> TrajectoryFileError:
        return TrajectoryFileError(path, problem)

    if "samples" not in f or not isinstance(f["samples"], h5py.Group):
        raise bad("not a miles_hpc trajectory shard: no /samples group")
    missing = [a for a in FILE_ATTRS if a not in f.attrs]
    if missing:
        raise bad(f"missing file attribute(s) {missing}")
    version = f.attrs["schema_version"]
    if not isinstance(version, (int, np.integer)) or int(version) != SCHEMA_VERSION:
        shown = int(version) if isinstance(version, (int, np.integer)) else repr(version)
        raise bad(f"schema_version is {shown}, this reader understands {SCHEMA_VERSION}")
    samples = f["samples"]
    for name, dtype in {**PER_TOKEN, **PER_SAMPLE, "token_offsets": OFFSETS_DTYPE}.items():
        if name not in OPTIONAL or name in samples:
            _check_dataset(samples, name, dtype, 1, bad)
    offsets = samples["token_offsets"][()]
    n = len(offsets) - 1
    _check_offsets(offsets, "samples/token_offsets", bad)
    for name in PER_TOKEN:
        if samples[name].shape[0] != offsets[-1]:
            raise bad(f"samples/{name} has {samples[name].shape[0]} rows, token_offsets ends at {offsets[-1]}")
    for name in PER_SAMPLE:
        if name in samples and samples[name].shape[0] != n:
            raise bad(f"samples/{name} has {samples[name].shape[0]} rows, expected {n} (one per sample)")
    if "routing" not in f:
        raise bad("missing group /routing")
    routing = f["routing"]
    _check_dataset(routing, "offsets", OFFSETS_DTYPE, 1, bad)
    experts = _check_dataset(routing, "experts", None, 3, bad)
    if experts.dtype not in ROUTING_DTYPES:
        raise bad(f"routing/experts has dtype {experts.dtype}, expected one of {[str(d) for d in ROUTING_DTYPES]}")
    r_offsets = routing["offsets"][()]
    if len(r_offsets) != n + 1:
        raise bad(f"routing/offsets has {len(r_offsets)} entries, expected {n + 1}")
    _check_offsets(r_offsets, "routing/offsets", bad)
    if r_offsets[-1] != experts.shape[0]:
        raise bad(f"routing/experts has {experts.shape[0]} rows, routing/offsets ends at {r_offsets[-1]}")
    if "indexer" in f:
        _validate_indexer(f["indexer"], n, bad)
    return n


def _validate_indexer(group: h5py.Group, n: int, bad: _Bad) -> None:
    if not isinstance(group, h5py.Group):
        raise bad("/indexer is not a group")
    _check_dataset(group, "offsets", OFFSETS_DTYPE, 1, bad)
    topk = _check_dataset(group, "topk", None, 3, bad)
    if topk.dtype not in INDEXER_DTYPES:
        raise bad(f"indexer/topk has dtype {topk.dtype}, expected one of {[str(d) for d in INDEXER_DTYPES]}")
    offsets = group["offsets"][()]
    if len(offsets) != n + 1:
        raise bad(f"indexer/offsets has {len(offsets)} entries, expected {n + 1}")
    _check_offsets(offsets, "indexer/offsets", bad)
    if offsets[-1] != topk.shape[0]:
        raise bad(f"indexer/topk has {topk.shape[0]} rows, indexer/offsets ends at {offsets[-1]}")


def _check_dataset(group: h5py.Group, name: str, dtype: np.dtype | None, ndim: int, bad: _Bad) -> h5py.Dataset:
    where = f"{group.name.strip('/')}/{name}"
    if name not in group or not isinstance(group[name], h5py.Dataset):
        raise bad(f"missing dataset {where}")
    ds = group[name]
    if len(ds.shape) != ndim:
        raise bad(f"{where} has shape {ds.shape}, expected {ndim} dimension(s)")
    if dtype is not None and not _same_dtype(ds.dtype, dtype):
        raise bad(f"{where} has dtype {ds.dtype}, expected {dtype}")
    return ds


def _same_dtype(actual: np.dtype, expected: np.dtype) -> bool:
    # Variable-length strings are object dtype plus h5py metadata: compare what the metadata says.
    want = h5py.check_string_dtype(expected)
    if want is not None and want.length is None:
        have = h5py.check_string_dtype(actual)
        return have is not None and have.length is None and have.encoding == want.encoding
    return actual == expected


def _check_offsets(offsets: np.ndarray, where: str, bad: _Bad) -> None:
    if len(offsets) < 1 or offsets[0] != 0:
        raise bad(f"{where} must start at 0 (got {offsets[:1].tolist()})")
    if (np.diff(offsets) < 0).any():
        raise bad(f"{where} decreases at index {int(np.argmax(np.diff(offsets) < 0))}")
