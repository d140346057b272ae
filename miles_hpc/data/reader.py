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
  ``routed_experts`` in the on-disk dtype (uint8/int16/int32; cast before using as torch indices).
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
                a = 0
                while a < n:
                    # Grow the block until it holds _BLOCK_SAMPLES samples or _BLOCK_TOKENS tokens (at least one).
                    b = min(n, a + _BLOCK_SAMPLES)
                    b = max(a + 1, min(b, int(np.searchsorted(offsets, offsets[a] + _BLOCK_TOKENS, "right")) - 1))
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
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TrajectoryFileError(path, f"cannot read samples {a}..{b - 1} ({type(e).__name__}: {e})") from e
    off = off - t0
    r_off = r_off - r_off[0]
    out = []
    for j in range(b - a):
        x, y = int(off[j]), int(off[j + 1])
        rx, ry = int(r_off[j]), int(r_off[j + 1])
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
                    token_hash=hashes[j].decode("ascii"),
                    metadata=json.loads(metadata[j]),
                    train_step=int(per_sample["train_step"][j]),
                )
            )
        except (SampleError, ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            raise TrajectoryFileError(path, f"sample {a + j} is invalid: {e}") from e
    return out
