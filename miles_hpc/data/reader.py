"""HDF5 trajectory store, reading side (stage: data; docs/design.md section 7): shards -> Samples, in write order.

Invariants:
- Only complete ``*.h5`` shards are read, sorted by name (= write order for one prefix); ``*.h5.partial`` files
  are listed in :attr:`TrajectoryReader.partial_shards` but never opened.
- Every shard's layout is validated when the reader is built (:func:`miles_hpc.data.schema.open_shard`), so a bad
  file fails early; each read Sample is re-validated (lengths, prompt conventions, token hash), so bytes that
  changed on disk after writing cannot reach the trainer silently.
- Any failure is a :class:`TrajectoryFileError` naming the file (and the sample index when it is one sample).
- A shard without an optional dataset (``prompt_id``, ``token_hash``, ``metadata``; docs/formats.md) reads with
  prompt_id -1, the token hash computed from the tokens, and empty metadata.
- Values come back exactly as stored: float32 log-probs and rewards as the Python floats equal to them,
  ``routed_experts`` and ``indexer_topk`` in the on-disk dtype (uint8/int16/int32; cast before using as torch
  indices). A shard without ``/indexer`` (written before indexer replay, or with no records) reads ``None`` there.
- A block of samples also stays under :data:`_BLOCK_INDEXER_BYTES` of indexer records (they run to kilobytes per
  token per layer), at least one sample.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from miles_hpc.data.sample import Sample, SampleError
from miles_hpc.data.schema import TrajectoryFileError, find_shards, open_shard

__all__ = ["TrajectoryReader"]

# Read a shard in blocks of at most this many samples / tokens: bounded memory, few HDF5 calls.
_BLOCK_SAMPLES = 1024
_BLOCK_TOKENS = 1 << 22
_BLOCK_INDEXER_BYTES = 1 << 28


class TrajectoryReader:
    """The samples of one shard, a directory of shards, or a run directory (its ``trajectories/``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.shards, self.partial_shards = find_shards(self.path)
        counts = []
        for shard in self.shards:
            f, n = open_shard(shard)
            f.close()
            counts.append(n)
        self.counts: list[int] = counts  # samples per shard, aligned with self.shards
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def __iter__(self) -> Iterator[Sample]:
        for shard, n in zip(self.shards, self.counts, strict=True):
            f, _ = open_shard(shard)
            with f:
                offsets = f["samples/token_offsets"][()]
                indexer = _indexer_rows(f)
                a = 0
                while a < n:
                    # Grow the block until it holds _BLOCK_SAMPLES samples, _BLOCK_TOKENS tokens or
                    # _BLOCK_INDEXER_BYTES of indexer records (at least one sample).
                    b = min(n, a + _BLOCK_SAMPLES)
                    b = min(b, int(np.searchsorted(offsets, offsets[a] + _BLOCK_TOKENS, "right")) - 1)
                    if indexer is not None:
                        i_off, rows = indexer
                        b = min(b, int(np.searchsorted(i_off, i_off[a] + rows, "right")) - 1)
                    b = max(a + 1, b)
                    yield from _read_range(f, shard, a, b)
                    a = b

    def read(self, i: int) -> Sample:
        """Sample ``i`` of the whole reader (negative indices count from the end)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples in {self.path}")
        i %= n
        k = bisect.bisect_right(self._starts, i) - 1
        f, _ = open_shard(self.shards[k])
        with f:
            local = i - self._starts[k]
            return _read_range(f, self.shards[k], local, local + 1)[0]


def _indexer_rows(f: h5py.File) -> tuple[np.ndarray, int] | None:
    """``(indexer/offsets, rows per block)`` of a shard with indexer records, else None."""
    if "indexer" not in f:
        return None
    topk = f["indexer/topk"]
    row_bytes = topk.dtype.itemsize * int(np.prod(topk.shape[1:], dtype=np.int64))
    return f["indexer/offsets"][()], max(1, _BLOCK_INDEXER_BYTES // max(1, row_bytes))


def _read_range(f: h5py.File, path: Path, a: int, b: int) -> list[Sample]:
    """Samples ``a .. b-1`` of an open, validated shard."""
    try:
        s, r = f["samples"], f["routing"]
        off = s["token_offsets"][a : b + 1]
        t0, t1 = int(off[0]), int(off[-1])
        tokens = s["tokens"][t0:t1]
        mask = s["loss_mask"][t0:t1]
        logprobs = s["rollout_logprobs"][t0:t1]
        versions = s["policy_version"][t0:t1]
        per_sample = {name: s[name][a:b] for name in ("reward", "prompt_len", "group_id", "status", "train_step")}
        # The optional datasets (schema.OPTIONAL): prompt_id -1 = unknown, "" = hash computed from the tokens.
        prompt_ids = s["prompt_id"][a:b] if "prompt_id" in s else np.full(b - a, -1, dtype=np.int64)
        hashes = s["token_hash"][a:b] if "token_hash" in s else np.full(b - a, b"", dtype="S32")
        metadata = s["metadata"].asstr()[a:b] if "metadata" in s else np.full(b - a, "{}", dtype=object)
        r_off = r["offsets"][a : b + 1]
        experts = r["experts"][int(r_off[0]) : int(r_off[-1])]
        # No /indexer group (an older shard, or none of its samples has records): every range is empty.
        i_off = f["indexer/offsets"][a : b + 1] if "indexer" in f else np.zeros(b - a + 1, dtype=np.int64)
        topk = f["indexer/topk"][int(i_off[0]) : int(i_off[-1])] if "indexer" in f else None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TrajectoryFileError(path, f"cannot read samples {a}..{b - 1} ({type(e).__name__}: {e})") from e
    off = off - t0
    r_off = r_off - r_off[0]
    i_off = i_off - i_off[0]
    out = []
    for j in range(b - a):
        x, y = int(off[j]), int(off[j + 1])
        rx, ry = int(r_off[j]), int(r_off[j + 1])
        ix, iy = int(i_off[j]), int(i_off[j + 1])
        try:
            out.append(
                Sample(
                    prompt_id=int(prompt_ids[j]),
                    group_id=int(per_sample["group_id"][j]),
                    tokens=tokens[x:y],
                    prompt_len=int(per_sample["prompt_len"][j]),
                    loss_mask=mask[x:y],
                    rollout_logprobs=logprobs[x:y],
                    policy_version=versions[x:y],
                    reward=float(per_sample["reward"][j]),
                    status=int(per_sample["status"][j]),
                    # A copy, so one kept Sample does not pin the whole block's routing array in memory.
                    routed_experts=experts[rx:ry].copy() if ry > rx else None,
                    indexer_topk=_own_rows(topk, ix, iy),
                    token_hash=hashes[j].decode("ascii"),
                    metadata=json.loads(metadata[j]),
                    train_step=int(per_sample["train_step"][j]),
                )
            )
        except (SampleError, ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            raise TrajectoryFileError(path, f"sample {a + j} is invalid: {e}") from e
    return out


def _own_rows(block: np.ndarray | None, x: int, y: int) -> np.ndarray | None:
    """Rows ``x:y`` of a block as an array of their own (a kept Sample must not pin the block), None if empty; a
    block that is those rows already is not copied again (indexer records are big)."""
    if block is None or y <= x:
        return None
    return block if (x, y) == (0, len(block)) else block[x:y].copy()
