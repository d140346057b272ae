"""HDF5 trajectory store, writing side (stage: data; docs/design.md section 7): batches of Samples -> rolled shards.

Invariants:
- A shard is written as ``{prefix}-{index:05d}.h5.partial`` and renamed to ``{prefix}-{index:05d}.h5`` only after
  HDF5 closed it and the bytes reached the disk (fsync, then an atomic rename, then fsync of the directory).
  A crash, a kill or a failed write therefore leaves at most a ``*.partial``, never a torn ``*.h5``.
- ``append`` validates the whole batch before touching the file, then grows every dataset once per batch.
- A batch never straddles shards: the writer rolls *after* a batch that took the shard's payload (uncompressed
  bytes of the arrays, so roll points do not depend on compression or HDF5 caching) to ``max_shard_bytes``.
- Index numbering continues after any shard (complete or partial) of the same prefix already in the directory,
  so a requeued job never overwrites what an earlier attempt wrote. Files are opened with mode ``w-``.
- One writer owns its prefix; routing (layers, top_k) and the expert-id dtype are fixed for the whole writer, and
  so are the indexer's (indexer_layers, index_topk) and key-position dtype (int16/int32, from ``max_context`` or
  else from the first batch with indexer records).
- A shard holds an ``/indexer`` group only once a sample with indexer records is written to it (created then, with
  zero-length ranges for the samples before): a shard without any is byte for byte what it was before indexer
  replay existed.
- Every chunked dataset carries HDF5's fletcher32 checksum filter, so a corrupted chunk fails its read; shards
  written before the filter (no checksum) still read.

The layout and its validation live in :mod:`miles_hpc.data.schema`; reading in :mod:`miles_hpc.data.reader`.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import h5py
import numpy as np

from miles_hpc import __version__
from miles_hpc.data.reader import TrajectoryReader
from miles_hpc.data.sample import SCHEMA_VERSION, Sample, SampleError
from miles_hpc.data.schema import (
    FILE_ATTRS,
    OFFSETS_DTYPE,
    PARTIAL_SUFFIX,
    PER_SAMPLE,
    PER_TOKEN,
    SHARD_SUFFIX,
    TrajectoryFileError,
    expert_dtype,
    position_dtype,
    shard_index,
)

__all__ = ["TrajectoryFileError", "TrajectoryReader", "TrajectoryWriter"]

# Chunk sizes (elements): big enough for streaming reads, small enough that a tiny shard stays tiny.
_TOKEN_CHUNK = 1 << 14
_SAMPLE_CHUNK = 1 << 10
_ROUTING_CHUNK_BYTES = 1 << 18
_COMPRESSIONS = (None, "none", "gzip", "lzf")


@dataclass(slots=True)
class _Batch:
    """One append's worth of samples, already flattened into the on-disk arrays."""

    per_token: dict[str, np.ndarray]
    per_sample: dict[str, np.ndarray]
    token_lens: np.ndarray
    experts: np.ndarray | None  # [rows, layers, top_k] of every routed sample, concatenated
    routing_lens: np.ndarray
    topk: np.ndarray | None  # [rows, indexer_layers, index_topk] of every sample with indexer records
    indexer_lens: np.ndarray

    @property
    def nbytes(self) -> int:
        """Uncompressed payload; the indexer's offsets are counted where they are written (TrajectoryWriter.append)."""
        arrays = [*self.per_token.values(), *self.per_sample.values(), self.token_lens, self.routing_lens]
        meta = sum(len(m) for m in self.per_sample["metadata"])  # object array: count the strings
        records = sum(0 if a is None else a.nbytes for a in (self.experts, self.topk))
        return sum(a.nbytes for a in arrays) + meta + records


class TrajectoryWriter:
    """Append batches of :class:`Sample` to size-rolled HDF5 shards in ``directory``. Use as a context manager."""

    def __init__(
        self,
        directory: str | Path,
        *,
        prefix: str = "traj",
        model: str,
        run_id: str,
        max_shard_bytes: int = 256 << 20,
        num_experts: int | None = None,
        max_context: int | None = None,
        compression: str | None = None,
        attrs: Mapping[str, str | int] | None = None,
    ) -> None:
        if not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a non-empty file-name prefix, got {prefix!r}")
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {_COMPRESSIONS}, got {compression!r}")
        if num_experts is not None and num_experts < 1:
            raise ValueError(f"num_experts must be >= 1 or None, got {num_experts}")
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be >= 1 or None, got {max_context}")
        clash = sorted(set(attrs or ()) & set(FILE_ATTRS))
        if clash:
            raise ValueError(f"attrs may not set the writer's own file attributes {clash}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix, self.model, self.run_id = prefix, model, run_id
        self.max_shard_bytes = max_shard_bytes
        self.num_experts = num_experts
        self.compression = None if compression == "none" else compression
        self.attrs = dict(attrs or {})  # extra file attributes of every shard (the reconciler records its source)
        self.paths: list[Path] = []  # completed shards, in order
        self.num_samples = 0
        self._routing_shape: tuple[int, int] | None = None
        self._expert_dtype = expert_dtype(num_experts) if num_experts is not None else None
        # Indexer records: key positions -1 .. max_context - 1, in the smallest dtype that holds them.
        self.max_context = max_context
        self._indexer_shape: tuple[int, int] | None = None
        self._position_dtype = position_dtype(max_context - 1) if max_context is not None else None
        existing = [shard_index(p.name, prefix) for p in self.directory.iterdir()]
        self._next_index = 1 + max((i for i in existing if i is not None), default=-1)
        self._file: h5py.File | None = None
        self._partial: Path | None = None
        self._payload = 0
        self._torn = False  # an append failed half-way: the open shard must stay .partial
        self._closed = False

    # -- public API -----------------------------------------------------------------------------------------

    @property
    def current_path(self) -> Path | None:
        """The ``*.h5.partial`` being written, or None between shards."""
        return self._partial

    def append(self, samples: Sequence[Sample]) -> None:
        """Write ``samples`` (one batch) to the current shard; roll to a new shard once it is full."""
        if self._closed:
            raise ValueError("TrajectoryWriter is closed")
        if self._torn:
            raise ValueError(f"an earlier append to {self._partial} failed; the shard was left as .partial")
        if not samples:
            return
        batch = self._flatten(samples)
        if self._file is None:
            self._open_next()
        self._torn = True
        written = self._write(batch)
        self._torn = False
        self.num_samples += len(samples)
        self._payload += written
        if self._payload >= self.max_shard_bytes:
            self._finish_shard()

    def roll(self) -> None:
        """Finish the open shard now (closed, fsynced, renamed to ``*.h5``); the next append opens a new one. At a
        checkpoint this makes every sample trained so far durable: a crash later tears at most a newer shard."""
        if self._file is not None and not self._torn:
            self._finish_shard()

    def flush(self) -> None:
        """Push buffered data to the OS (the shard stays ``.partial`` until it is rolled or closed)."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Finish the open shard (rename it to ``*.h5``). Idempotent. A torn shard is closed but left ``.partial``."""
        if self._closed:
            return
        self._closed = True
        if self._file is None:
            return
        if self._torn:
            self._file.close()
            self._file = None
        else:
            self._finish_shard()

    def abort(self) -> None:
        """Close without finishing: the open shard stays ``.partial`` (never read; the reconciler quarantines it).
        For a caller that failed half-way through something that must land whole or not at all."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # An exception in the caller's code leaves every completed append consistent, so keep it; only a
        # failure inside append (self._torn) keeps the shard .partial.
        self.close()

    # -- batch preparation (no file access: a bad batch leaves the shard untouched) ------------------------------

    def _flatten(self, samples: Sequence[Sample]) -> _Batch:
        for i, s in enumerate(samples):
            try:
                s.validate()
            except SampleError as e:
                raise SampleError(f"batch[{i}] (prompt_id={s.prompt_id}): {e}") from e
        lens = np.array([len(s.tokens) for s in samples], dtype=np.int64)

        def cat(field: str, dtype: np.dtype) -> np.ndarray:
            # Values were range-checked by validate(), so these casts cannot wrap.
            return np.concatenate([np.asarray(getattr(s, field), dtype=dtype) for s in samples])

        per_token = {name: cat(name, dtype) for name, dtype in PER_TOKEN.items()}
        per_sample: dict[str, np.ndarray] = {
            "reward": np.array([s.reward for s in samples], dtype=PER_SAMPLE["reward"]),
            "prompt_len": np.array([s.prompt_len for s in samples], dtype=PER_SAMPLE["prompt_len"]),
            "group_id": np.array([s.group_id for s in samples], dtype=PER_SAMPLE["group_id"]),
            "status": np.array([int(s.status) for s in samples], dtype=PER_SAMPLE["status"]),
            "train_step": np.array([s.train_step for s in samples], dtype=PER_SAMPLE["train_step"]),
            "prompt_id": np.array([s.prompt_id for s in samples], dtype=PER_SAMPLE["prompt_id"]),
            "token_hash": np.array([s.token_hash.encode("ascii") for s in samples], dtype=PER_SAMPLE["token_hash"]),
            "metadata": np.array([json.dumps(s.metadata, allow_nan=False) for s in samples], dtype=object),
        }
        routed = [s.routed_experts for s in samples]
        routing_lens = np.array([0 if r is None else r.shape[0] for r in routed], dtype=np.int64)
        present = [r for r in routed if r is not None]
        indexed = [s.indexer_topk for s in samples]
        indexer_lens = np.array([0 if r is None else r.shape[0] for r in indexed], dtype=np.int64)
        with_topk = [r for r in indexed if r is not None]
        # Both checked before either fixes the writer's shapes and dtypes: a refused batch changes nothing.
        routing = self._check_routing(present, samples) if present else None
        indexer = self._check_indexer(with_topk, samples) if with_topk else None
        experts = topk = None
        if routing is not None:
            self._routing_shape, self._expert_dtype = routing
            experts = np.concatenate(present).astype(self._expert_dtype)
        if indexer is not None:
            self._indexer_shape, self._position_dtype = indexer
            # Values were range-checked, so the cast cannot wrap; one copy, in the narrow dtype (these are big).
            topk = np.concatenate(with_topk, dtype=self._position_dtype, casting="unsafe")
        return _Batch(per_token, per_sample, lens, experts, routing_lens, topk, indexer_lens)

    def _check_routing(self, present: list[np.ndarray], samples: Sequence[Sample]) -> tuple[tuple[int, int], np.dtype]:
        """The writer's routing (layers, top_k) and expert dtype once this batch is stored; raises if it cannot be."""
        expected = _same_shape("routed_experts", "(layers, top_k)", present, self._routing_shape, samples)
        biggest = max(int(r.max()) for r in present)
        if self.num_experts is not None and biggest >= self.num_experts:
            raise ValueError(f"routed_experts holds expert id {biggest} but num_experts is {self.num_experts}")
        dtype = self._expert_dtype
        if dtype is None:  # first routed batch of a writer without num_experts
            dtype = np.dtype("<i4") if biggest > np.iinfo(np.int16).max else expert_dtype(None)
        if biggest > np.iinfo(dtype).max:
            raise ValueError(
                f"routed_experts holds expert id {biggest}, beyond {dtype} chosen from the first "
                f"routed batch; pass num_experts to TrajectoryWriter"
            )
        return expected, dtype

    def _check_indexer(self, present: list[np.ndarray], samples: Sequence[Sample]) -> tuple[tuple[int, int], np.dtype]:
        """The writer's indexer (layers, index_topk) and position dtype once this batch is stored; raises if not."""
        expected = _same_shape("indexer_topk", "(indexer_layers, index_topk)", present, self._indexer_shape, samples)
        biggest = max(int(r.max()) for r in present)
        if self.max_context is not None and biggest >= self.max_context:
            raise ValueError(f"indexer_topk holds key position {biggest} but max_context is {self.max_context}")
        dtype = self._position_dtype or position_dtype(biggest)  # None: the first batch with records decides
        if biggest > np.iinfo(dtype).max:
            raise ValueError(
                f"indexer_topk holds key position {biggest}, beyond {dtype} chosen from the first batch with "
                f"indexer records; pass max_context to TrajectoryWriter"
            )
        return expected, dtype

    # -- file side --------------------------------------------------------------------------------------------

    def _dataset(
        self,
        group: h5py.Group,
        name: str,
        dtype: Any,
        chunk: tuple[int, ...],
        shape0: tuple[int, ...] = (0,),
        shuffle: bool = False,
    ) -> h5py.Dataset:
        return group.create_dataset(
            name,
            shape=shape0,
            maxshape=(None, *shape0[1:]),
            dtype=dtype,
            chunks=chunk,
            compression=self.compression,
            # Byte-shuffle before compressing (only with compression): groups the high bytes of small ints.
            shuffle=shuffle and self.compression is not None,
            # A per-chunk checksum: bytes changed on disk fail the read instead of returning wrong values. HDF5
            # refuses it on variable-length strings (metadata: its chunks hold heap references, not the text).
            fletcher32=not _vlen(dtype),
        )

    def _open_next(self) -> None:
        name = f"{self.prefix}-{self._next_index:05d}"
        self._next_index += 1
        self._partial = self.directory / f"{name}{PARTIAL_SUFFIX}"
        try:
            f = h5py.File(self._partial, "w-")
        except OSError as e:
            raise TrajectoryFileError(self._partial, f"cannot create shard ({e})") from e
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["model"] = self.model
        f.attrs["run_id"] = self.run_id
        f.attrs["writer"] = f"miles_hpc {__version__} host={socket.gethostname()} pid={os.getpid()}"
        for key, value in self.attrs.items():
            f.attrs[key] = value
        samples = f.create_group("samples")
        for name_, dtype in PER_TOKEN.items():
            self._dataset(samples, name_, dtype, (_TOKEN_CHUNK,))
        for name_, dtype in PER_SAMPLE.items():
            self._dataset(samples, name_, dtype, (_SAMPLE_CHUNK,))
        # Offsets hold N+1 entries and start with the 0 that every later range is measured from.
        self._dataset(samples, "token_offsets", OFFSETS_DTYPE, (_SAMPLE_CHUNK,), (1,))
        routing = f.create_group("routing")
        routing.attrs["num_experts"] = -1 if self.num_experts is None else self.num_experts
        self._dataset(routing, "offsets", OFFSETS_DTYPE, (_SAMPLE_CHUNK,), (1,))
        self._file, self._payload = f, 0
        if self._routing_shape is not None:
            self._create_experts()

    def _create_experts(self) -> None:
        assert self._file is not None and self._routing_shape is not None and self._expert_dtype is not None
        layers, top_k = self._routing_shape
        rows = max(1, _ROUTING_CHUNK_BYTES // (layers * top_k * self._expert_dtype.itemsize))
        self._dataset(self._file["routing"], "experts", self._expert_dtype, (rows, layers, top_k), (0, layers, top_k))

    def _create_indexer(self, before: int) -> None:
        """The ``/indexer`` group of the open shard, at its first batch with records; the ``before`` samples
        already in the shard get empty ranges (no records)."""
        assert self._file is not None and self._indexer_shape is not None and self._position_dtype is not None
        group = self._file.create_group("indexer")
        group.attrs["max_context"] = -1 if self.max_context is None else self.max_context
        offsets = self._dataset(group, "offsets", OFFSETS_DTYPE, (_SAMPLE_CHUNK,), (before + 1,))
        offsets[...] = 0
        layers, k = self._indexer_shape
        rows = max(1, _ROUTING_CHUNK_BYTES // (layers * k * self._position_dtype.itemsize))
        # Sorted positions compress about twice as well byte-shuffled (measured: docs/formats.md).
        self._dataset(group, "topk", self._position_dtype, (rows, layers, k), (0, layers, k), shuffle=True)

    def _write(self, batch: _Batch) -> int:
        """Append ``batch`` to the open shard; return its payload (uncompressed bytes, the roll measure)."""
        assert self._file is not None
        samples, routing = self._file["samples"], self._file["routing"]
        if batch.topk is not None and "indexer" not in self._file:
            self._create_indexer(samples["token_offsets"].shape[0] - 1)
        for name, values in {**batch.per_token, **batch.per_sample}.items():
            _extend(samples[name], values)
        _extend(samples["token_offsets"], samples["token_offsets"][-1] + np.cumsum(batch.token_lens))
        if batch.experts is not None:
            if "experts" not in routing:
                self._create_experts()
            _extend(routing["experts"], batch.experts)
        _extend(routing["offsets"], routing["offsets"][-1] + np.cumsum(batch.routing_lens))
        if "indexer" in self._file:
            indexer = self._file["indexer"]
            if batch.topk is not None:
                _extend(indexer["topk"], batch.topk)
            _extend(indexer["offsets"], indexer["offsets"][-1] + np.cumsum(batch.indexer_lens))
            return batch.nbytes + batch.indexer_lens.nbytes
        return batch.nbytes

    def _finish_shard(self) -> None:
        assert self._file is not None and self._partial is not None
        if "experts" not in self._file["routing"]:
            # No routed sample in this shard: an empty dataset keeps the layout complete.
            dtype = self._expert_dtype or expert_dtype(self.num_experts)
            self._file["routing"].create_dataset(
                "experts", shape=(0, 0, 0), maxshape=(None, None, None), chunks=(1, 1, 1), dtype=dtype, fletcher32=True
            )
        self._file.close()
        self._file = None
        fsync_path(self._partial)
        final = self._partial.with_name(self._partial.name.removesuffix(PARTIAL_SUFFIX) + SHARD_SUFFIX)
        os.replace(self._partial, final)
        fsync_path(self.directory)  # make the rename itself durable
        self.paths.append(final)
        self._partial = None


def _same_shape(
    name: str, dims: str, present: list[np.ndarray], fixed: tuple[int, int] | None, samples: Sequence[Sample]
) -> tuple[int, int]:
    """The one ``shape[1:]`` of every array in ``present``, equal to ``fixed`` when the writer has one."""
    shapes = {(int(r.shape[1]), int(r.shape[2])) for r in present}
    expected = fixed or next(iter(shapes))
    if shapes != {expected}:
        raise ValueError(
            f"{name} {dims} must be the same for every sample a writer stores: "
            f"expected {expected}, got {sorted(shapes)} (prompt_ids {[s.prompt_id for s in samples][:8]}...)"
        )
    return expected


def _vlen(dtype: Any) -> bool:
    string = h5py.check_string_dtype(np.dtype(dtype))
    return string is not None and string.length is None


def _extend(ds: h5py.Dataset, values: np.ndarray) -> None:
    """Grow ``ds`` along axis 0 by ``len(values)`` (one resize per dataset per batch) and write them."""
    if len(values) == 0:
        return
    start = ds.shape[0]
    ds.resize(start + len(values), axis=0)
    ds[start:] = values


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so that a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
