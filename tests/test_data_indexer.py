"""Indexer replay records (DeepSeek Sparse Attention's top-k key positions per query): `Sample.indexer_topk`, the
optional `/indexer` group of HDF5 shards (round trip, older shards without it, dtype choice, refusals), and
`verify` / `inspect` on it."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_hpc.cli import main
from miles_hpc.data import (
    Sample,
    SampleError,
    TrajectoryFileError,
    TrajectoryReader,
    TrajectoryWriter,
    format_summary,
    reconcile_trajectories,
    summarize,
    verify_shards,
)
from miles_hpc.data import reconcile as reconcile_mod


def topk(rows: int, layers: int = 2, k: int = 4, seed: int = 0) -> np.ndarray:
    """What the engine records: row t holds k sorted key positions out of 0..t, padded with -1 while t < k - 1."""
    rng = np.random.default_rng(seed)
    out = np.full((rows, layers, k), -1, dtype=np.int64)
    for t in range(rows):
        for layer in range(layers):
            keys = np.sort(rng.permutation(t + 1)[:k])
            out[t, layer, : len(keys)] = keys
    return out


def stored(s: Sample) -> Sample:
    """What a sample reads back as: log-probs and reward go through float32 on disk."""
    return dataclasses.replace(
        s,
        rollout_logprobs=np.asarray(s.rollout_logprobs, dtype=np.float32).tolist(),
        reward=float(np.float32(s.reward)),
    )


def sample(i: int, response: int = 3, rows: int | None = -1, routed: bool = True, **over: Any) -> Sample:
    """2 prompt tokens + ``response``; ``rows`` indexer rows (-1: one per token, None: no records)."""
    n = 2 + response
    fields: dict[str, Any] = dict(
        prompt_id=i,
        group_id=i,
        tokens=[(i * 17 + t) % 500 for t in range(n)],
        prompt_len=2,
        loss_mask=[0, 0] + [1] * response,
        rollout_logprobs=[0.0, 0.0] + [-0.5] * response,
        policy_version=[-1, -1] + [1] * response,
        reward=0.5,
        routed_experts=(np.arange((n - 1) * 4) % 8).reshape(n - 1, 2, 2) if routed else None,
        indexer_topk=None if rows is None else topk(n if rows == -1 else rows, seed=i),
        metadata={"i": i},
        train_step=0,
    )
    fields.update(over)
    return Sample(**fields)


def writer(d: Path, **kw: Any) -> TrajectoryWriter:
    return TrajectoryWriter(d, **{"model": "dsa", "run_id": "r1", "max_shard_bytes": 1 << 20, **kw})


def long_sample(i: int, position: int, **over: Any) -> Sample:
    """A prompt long enough that its last query may attend to key ``position`` (1 layer, top-2)."""
    n = position + 1
    records = np.zeros((n, 1, 2), dtype=np.int64)
    records[-1, 0] = [0, position]
    return Sample(
        prompt_id=i,
        group_id=i,
        tokens=[7] * n,
        prompt_len=n,
        loss_mask=[0] * n,
        rollout_logprobs=[0.0] * n,
        policy_version=[-1] * n,
        indexer_topk=records,
        **{"train_step": 0, **over},
    )


# -- the record ----------------------------------------------------------------------------------------------------


def test_sample_field_equality_and_repr() -> None:
    s = sample(0)
    assert s.has_indexer and s.indexer_topk.shape == (5, 2, 4)
    assert "indexer_topk=(5, 2, 4)" in repr(s) and "indexer_topk=None" in repr(sample(0, rows=None))
    assert sample(0, indexer_topk=s.indexer_topk.astype(np.int16)) == s  # dtype is storage, values are identity
    assert sample(0, rows=None) != s and sample(0, rows=3) != s
    empty = sample(0, indexer_topk=np.zeros((0, 2, 4), dtype=np.int32))  # no rows: one representation, None
    assert empty.indexer_topk is None and not empty.has_indexer and empty == sample(0, rows=None)
    padded = np.array([[[0, -1, -1]], [[0, 1, -1]], [[0, 1, 2]]])  # a query at t sees only t + 1 keys
    assert sample(0, response=1, indexer_topk=padded).indexer_topk.tolist() == padded.tolist()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (np.zeros((4, 2)), "[rows, indexer_layers, index_topk]"),
        (np.zeros((4, 2, 2)), "integer key positions"),
        (np.zeros((6, 2, 2), dtype=int), "6 rows, expected 1..5"),
        (np.zeros((4, 0, 2), dtype=int), "indexer_layers and index_topk must be >= 1"),
        (np.zeros((4, 2, 0), dtype=int), "indexer_layers and index_topk must be >= 1"),
        (np.full((4, 2, 2), -2), "must be >= -1"),
        (np.array([[[0]], [[1]], [[3]]]), "row 2 holds key position 3, beyond the query's own position 2"),
    ],
)
def test_sample_validation_names_the_field(tmp_path: Path, value: np.ndarray, words: str) -> None:
    with pytest.raises(SampleError, match="^Sample.indexer_topk: ") as info:
        sample(0, indexer_topk=value)
    assert words in str(info.value)
    s = sample(0)
    s.indexer_topk = np.full((5, 2, 4), 9)  # mutated after construction: the writer re-validates
    with pytest.raises(SampleError, match=r"batch\[0\].*indexer_topk"), writer(tmp_path) as w:
        w.append([s])


# -- round trip and layout -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "gzip", "lzf"])
def test_round_trip_mixed_several_appends_and_a_roll(tmp_path: Path, compression: str | None) -> None:
    batches = [
        [sample(0, rows=None), sample(1, rows=None, routed=False)],  # the first shard's first batch has no records
        [sample(2), sample(3, rows=None), sample(4, rows=2, routed=False)],
        [sample(5, response=6)],
        [sample(6, rows=None)],
    ]
    # Payloads (uncompressed bytes): 348, then 650 + 24 of indexer offsets; without its 112 bytes of records the
    # second batch would leave the first shard under 900.
    with writer(tmp_path, max_shard_bytes=900, compression=compression) as w:
        for b in batches[:3]:
            w.append(b)
        w.roll()
        w.append(batches[3])
    written = [s for b in batches for s in b]
    got = list(TrajectoryReader(tmp_path))
    assert got == [stored(s) for s in written]
    assert [s.indexer_topk is None for s in got] == [True, True, False, True, False, False, True]
    assert all(s.indexer_topk.dtype == np.int16 for s in got if s.indexer_topk is not None)
    assert TrajectoryReader(tmp_path).read(4) == stored(written[4])
    with h5py.File(w.paths[0]) as f:  # the group appeared with batch 2: samples 0, 1 got empty ranges
        x = f["indexer"]
        assert set(x) == {"offsets", "topk"} and x.attrs["max_context"] == -1
        assert x["offsets"][()].tolist() == [0, 0, 0, 5, 5, 7]
        assert x["topk"].shape == (7, 2, 4) and x["topk"].dtype == np.int16
        assert x["topk"].fletcher32 and x["offsets"].fletcher32 and x["topk"].compression == compression
        assert x["topk"].shuffle == (compression is not None)
    assert len(w.paths) == 3  # the second batch filled the first shard; roll() closed the second
    with h5py.File(w.paths[-1]) as f:
        assert set(f) == {"samples", "routing"}  # no records in the shard: no group, as before indexer replay


def test_a_shard_without_records_is_what_it_was_before(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.append([sample(0, rows=None), sample(1, rows=None, routed=False)])
    with h5py.File(w.paths[0]) as f:
        assert set(f) == {"samples", "routing"}
    assert [s.indexer_topk for s in TrajectoryReader(tmp_path)] == [None, None]
    s = summarize(tmp_path)["indexer"]
    assert s == {
        "samples_with_indexer": 0,
        "coverage": 0.0,
        "rows": 0,
        "shapes": [],
        "dtypes": [],
        "max_context": None,
    }
    assert verify_shards(tmp_path) == []


def test_an_older_shard_without_the_group_reads(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.append([sample(0), sample(1)])
    with h5py.File(w.paths[0], "r+") as f:  # a shard as a writer before indexer replay left it
        del f["indexer"]
    got = list(TrajectoryReader(tmp_path))
    assert [s.indexer_topk for s in got] == [None, None]
    assert got[0] == stored(sample(0, rows=None)) and verify_shards(tmp_path) == []
    assert main(["inspect", str(tmp_path)]) == 0


def test_payload_counts_the_records(tmp_path: Path) -> None:
    # 5 rows x 2 layers x top-64 int16 = 1280 bytes of records per sample: they alone fill a 1 KB shard.
    big = [sample(i, indexer_topk=topk(5, k=64, seed=i)) for i in range(3)]
    with writer(tmp_path, prefix="rec", max_shard_bytes=1024) as w:
        for s in big:
            w.append([s])
    assert len(w.paths) == 3
    with writer(tmp_path, prefix="plain", max_shard_bytes=1024) as w:
        for i in range(3):
            w.append([sample(i, rows=None)])
    assert len(w.paths) == 1


# -- the position dtype, and what is refused ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_context", "dtype"), [(None, np.int16), (64, np.int16), (32768, np.int16), (32769, np.int32)]
)
def test_dtype_from_max_context(tmp_path: Path, max_context: int | None, dtype: type) -> None:
    with writer(tmp_path, max_context=max_context) as w:
        w.append([sample(0)])
    with h5py.File(w.paths[0]) as f:
        assert f["indexer/topk"].dtype == dtype and f["indexer"].attrs["max_context"] == (max_context or -1)
    (back,) = TrajectoryReader(tmp_path)
    assert back == stored(sample(0)) and back.indexer_topk.dtype == dtype


def test_dtype_from_the_first_batch_and_the_refusal(tmp_path: Path) -> None:
    with writer(tmp_path, prefix="wide") as w:  # no max_context: the first batch with records decides
        w.append([long_sample(0, 40000)])
        w.append([long_sample(1, 5)])
    with h5py.File(w.paths[0]) as f:
        assert f["indexer/topk"].dtype == np.int32
    assert [s.indexer_topk.max() for s in TrajectoryReader(w.paths[0])] == [40000, 5]
    w = writer(tmp_path, prefix="narrow")
    w.append([long_sample(0, 5)])  # int16 from here on
    with pytest.raises(ValueError, match="indexer_topk holds key position 40000, beyond int16.*pass max_context"):
        w.append([long_sample(1, 40000)])
    w.append([long_sample(2, 7)])  # the refused batch left the shard untouched
    w.close()
    assert [s.prompt_id for s in TrajectoryReader(w.paths[0])] == [0, 2]
    with writer(tmp_path, prefix="bounded", max_context=100) as w2:
        with pytest.raises(ValueError, match="indexer_topk holds key position 100 but max_context is 100"):
            w2.append([long_sample(0, 100)])
        w2.append([long_sample(1, 99)])
    with pytest.raises(ValueError, match="max_context"):
        writer(tmp_path, max_context=0)


def test_shape_must_stay_the_same(tmp_path: Path) -> None:
    w = writer(tmp_path)
    with pytest.raises(ValueError, match=r"indexer_topk \(indexer_layers, index_topk\) must be the same"):
        w.append([sample(0), sample(1, indexer_topk=topk(5, layers=3))])  # within one batch
    with pytest.raises(ValueError, match="routed_experts"):
        w.append([sample(0), sample(1, routed_experts=np.zeros((4, 3, 2), dtype=int))])  # routing refused too
    w.append([sample(2, indexer_topk=topk(5, k=8))])  # nothing refused fixed the shape: this batch does
    with pytest.raises(ValueError, match=r"expected \(2, 8\), got \[\(2, 4\)\]"):
        w.append([sample(3)])  # across batches
    w.roll()
    with pytest.raises(ValueError, match=r"expected \(2, 8\)"):
        w.append([sample(4)])  # and across shards
    w.close()
    assert [s.prompt_id for s in TrajectoryReader(tmp_path)] == [2]


# -- verify and inspect ----------------------------------------------------------------------------------------------


def shard(d: Path) -> Path:
    with writer(d, max_context=64) as w:
        w.append([sample(0), sample(1, rows=None), sample(2), sample(3)])
    return w.paths[0]


def edit(path: Path, name: str, index: Any, value: Any) -> Path:
    with h5py.File(path, "r+") as f:
        f[name][index] = value
    return path


# name, index, value, sample at fault, words
DAMAGE: dict[str, tuple[str, Any, Any, int | None, str]] = {
    "after_query": ("indexer/topk", (7, 1, 3), 4, 2, "indexer key position after its query's own position"),
    "below_padding": ("indexer/topk", (0, 0, 3), -2, 0, "indexer key position below -1"),
    "max_context": ("indexer/topk", (14, 0, 0), 64, 3, "at or beyond max_context 64"),
    "rows": ("indexer/offsets", slice(1, 3), [6, 6], 0, "indexer has more rows than the sample has tokens"),
    "decreasing": ("indexer/offsets", 2, 4, None, "indexer/offsets decreases at index 1"),
    "start": ("indexer/offsets", 0, 1, None, "indexer/offsets must start at 0"),
    "end": ("indexer/offsets", 4, 14, None, "indexer/topk has 15 rows, indexer/offsets ends at 14"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_verify_names_the_damage(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(tmp_path)
    assert verify_shards(path) == []
    name, index, value, at, words = DAMAGE[case]
    edit(path, name, index, value)
    problems = verify_shards(tmp_path)
    assert problems and all(p.path == path for p in problems), problems
    assert any(p.sample == at and words in p.what for p in problems), problems
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    assert words in capsys.readouterr().out
    with pytest.raises(TrajectoryFileError, match=path.name):  # the reader refuses it as well
        list(TrajectoryReader(tmp_path))


def test_a_damaged_chunk_of_records_fails_its_checksum(tmp_path: Path) -> None:
    with writer(tmp_path) as w:  # 60 rows x 2 layers x top-256 int16 = 60 KB in one chunk, uncompressed
        w.append([sample(0, response=58, indexer_topk=topk(60, k=256))])
    with h5py.File(w.paths[0]) as f:
        info = f["indexer/topk"].id.get_chunk_info(0)
    with open(w.paths[0], "r+b") as f:
        f.seek(info.byte_offset + info.size // 2)
        f.write(b"\x7f" * 64)
    problems = verify_shards(tmp_path)
    assert problems and "cannot read indexer/topk" in problems[0].what, problems
    for fails in (lambda: list(TrajectoryReader(tmp_path)), lambda: summarize(tmp_path)):
        with pytest.raises(TrajectoryFileError, match=w.paths[0].name):
            fails()


def test_verify_and_inspect_refuse_a_foreign_dtype(tmp_path: Path) -> None:
    path = shard(tmp_path)
    with h5py.File(path, "r+") as f:
        data = f["indexer/topk"][()]
        del f["indexer/topk"]
        f["indexer"].create_dataset("topk", data=data.astype(np.int64))
    (p,) = verify_shards(path)
    assert "indexer/topk has dtype int64" in p.what
    with pytest.raises(TrajectoryFileError, match="indexer/topk has dtype int64"):
        summarize(path)


def test_inspect_prints_the_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard(tmp_path)
    with writer(tmp_path, prefix="plain") as w:
        w.append([sample(9, rows=None)])
    s = summarize(tmp_path)
    assert s["indexer"] == {
        "samples_with_indexer": 3,
        "coverage": 0.6,
        "rows": 15,
        "shapes": [[2, 4]],
        "dtypes": ["int16"],
        "max_context": 64,
    }
    line = "  indexer          3/5 samples (60.0%), 15 rows, 2 layers x top-4, dtype int16, max context 64"
    assert line in format_summary(s).splitlines()
    assert main(["inspect", str(tmp_path)]) == 0 and line in capsys.readouterr().out.splitlines()
    assert "indexer          none" in format_summary(summarize(w.paths[0]))


def test_reconcile_rewrite_keeps_records_and_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconcile_mod, "_BLOCK", 1)  # the rewrite's first block holds only short positions
    kept = [long_sample(0, 3), long_sample(1, 40000)]
    with writer(tmp_path) as w:  # int32, chosen by 33000; steps 3 are not covered by next_step 1: rewritten
        w.append([long_sample(5, 33000, train_step=3), *kept, long_sample(2, 9, train_step=3)])
    reconcile_trajectories(tmp_path, 1, log=lambda _: None)
    (new,) = (p for p in tmp_path.glob("*.h5"))
    with h5py.File(new) as f:
        assert f["indexer/topk"].dtype == np.int32
    assert list(TrajectoryReader(new)) == [stored(s) for s in kept]


# -- property: anything valid round-trips exactly --------------------------------------------------------------------


@st.composite
def records(draw: st.DrawFn, n: int, layers: int, k: int) -> np.ndarray | None:
    if not n or not draw(st.booleans()):
        return None
    rows = draw(st.integers(1, n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = rng.integers(-1, 1 << 15, size=(rows, layers, k))
    return np.minimum(out, np.arange(rows)[:, None, None])  # -1 .. t in row t


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.lists(st.lists(st.integers(0, 6), max_size=4), min_size=1, max_size=4),
    st.integers(1, 800),
    st.sampled_from([None, "gzip"]),
    st.data(),
)
def test_round_trip_is_exact(
    layers: int, k: int, shape: list[list[int]], max_bytes: int, compression: str | None, data: st.DataObject
) -> None:
    batches = [
        [
            sample(10 * b + j, response=r, rows=None, indexer_topk=data.draw(records(2 + r, layers, k)))
            for j, r in enumerate(sizes)
        ]
        for b, sizes in enumerate(shape)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        with writer(Path(tmp), max_shard_bytes=max_bytes, compression=compression) as w:
            for batch in batches:
                w.append(batch)
        for p in w.paths:
            with h5py.File(p) as f:  # the group exactly where a sample of the shard has records
                held = f["samples/prompt_id"][()].tolist()
                want = any(s.indexer_topk is not None for b in batches for s in b if s.prompt_id in held)
                assert ("indexer" in f) == want
        assert list(TrajectoryReader(tmp)) == [stored(s) for b in batches for s in b]
        assert verify_shards(tmp) == []
