"""HDF5 trajectory shards (docs/design.md section 7): exact round trip, on-disk layout, crash safety, routing dtypes."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_hpc.data import (
    Sample,
    SampleError,
    SampleStatus,
    TrajectoryFileError,
    TrajectoryReader,
    TrajectoryWriter,
    summarize,
)


def stored(s: Sample) -> Sample:
    """What a sample reads back as: log-probs and reward go through float32 on disk."""
    return dataclasses.replace(
        s,
        rollout_logprobs=np.asarray(s.rollout_logprobs, dtype=np.float32).tolist(),
        reward=float(np.float32(s.reward)),
    )


def sample(
    i: int, prompt: int = 3, response: int = 2, routing: tuple[int, int] | None = (2, 2), experts: int = 8, **over: Any
) -> Sample:
    n = prompt + response
    fields: dict[str, Any] = dict(
        prompt_id=i,
        group_id=i // 2,
        tokens=[(i * 31 + k) % 1000 for k in range(n)],
        prompt_len=prompt,
        loss_mask=[0] * prompt + [1] * response,
        rollout_logprobs=[0.0] * prompt + [-0.25 * (k + 1) for k in range(response)],
        policy_version=[-1] * prompt + [i] * response,
        reward=float(i),
        routed_experts=None
        if routing is None
        else (np.arange((n - 1) * routing[0] * routing[1]) % experts).reshape(n - 1, *routing),
        metadata={"i": i},
    )
    fields.update(over)
    return Sample(**fields)


def writer(d: Path, **kw: Any) -> TrajectoryWriter:
    return TrajectoryWriter(d, **{"model": "tiny", "run_id": "r1", "max_shard_bytes": 1 << 20, **kw})


# -- property: anything valid round-trips exactly, across batches and rolled shards -----------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def random_sample(draw: st.DrawFn, routing: tuple[int, int, int] | None) -> Sample:
    prompt, response = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    n = prompt + response
    generated = draw(st.lists(st.booleans(), min_size=response, max_size=response))
    routed = None
    if routing is not None and n and draw(st.booleans()):
        layers, top_k, max_id = routing
        rows = draw(st.integers(0, n))
        seed = draw(st.integers(0, 2**32 - 1))
        routed = np.random.default_rng(seed).integers(0, max_id + 1, size=(rows, layers, top_k))
    return Sample(
        prompt_id=draw(st.integers(-(2**63), 2**63 - 1)),
        group_id=draw(st.integers(-(2**63), 2**63 - 1)),
        tokens=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        prompt_len=prompt,
        loss_mask=[0] * prompt + [int(g) for g in generated],
        rollout_logprobs=[0.0] * prompt + draw(st.lists(st.floats(-1e4, 0.0), min_size=response, max_size=response)),
        policy_version=[-1] * prompt + draw(st.lists(st.integers(-1, 2**31 - 1), min_size=response, max_size=response)),
        reward=draw(st.floats(-1e30, 1e30)),
        status=draw(st.sampled_from(SampleStatus)),
        routed_experts=routed,
        metadata=draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
        train_step=draw(st.integers(-1, 2**31 - 1)),
    )


@st.composite
def scenario(draw: st.DrawFn) -> tuple[list[list[Sample]], dict[str, Any]]:
    # (layers, top_k, num_experts); num_experts None lets the writer pick the dtype from the data.
    num_experts = draw(st.sampled_from([None, 8, 256, 300, 40000]))
    routing = None
    if draw(st.booleans()):
        max_id = (num_experts or draw(st.sampled_from([8, 32767]))) - 1
        routing = (draw(st.integers(1, 3)), draw(st.integers(1, 2)), max_id)
    batches = draw(st.lists(st.lists(random_sample(routing), max_size=4), min_size=1, max_size=4))
    kw = dict(
        max_shard_bytes=draw(st.integers(1, 600)),
        num_experts=num_experts,
        compression=draw(st.sampled_from([None, "none", "gzip", "lzf"])),
    )
    return batches, kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_round_trip_is_exact(case: tuple[list[list[Sample]], dict[str, Any]]) -> None:
    batches, kw = case
    with tempfile.TemporaryDirectory() as tmp:
        with writer(Path(tmp), **kw) as w:
            for batch in batches:
                w.append(batch)
        written = [s for b in batches for s in b]
        # A batch never straddles shards and an empty writer creates no file.
        assert len(w.paths) <= sum(1 for b in batches if b) and (len(w.paths) > 0) == bool(written)
        assert sorted(os.listdir(tmp)) == [p.name for p in w.paths]
        reader = TrajectoryReader(tmp)
        got = list(reader)
        assert len(reader) == len(written) == len(got)
        for i, (want, have) in enumerate(zip(written, got, strict=True)):
            assert have == stored(want), f"sample {i}: {have} != {want}"
        if written:
            assert reader.read(len(written) - 1) == got[-1] and reader.read(0) == got[0]


# -- the on-disk layout is the contract ----------------------------------------------------------------------------


def test_layout_matches_design(tmp_path: Path) -> None:
    batch = [sample(0), sample(1, routing=None), sample(2, prompt=2, response=0)]
    with writer(tmp_path, prefix="rank0", num_experts=8, compression="gzip") as w:
        w.append(batch)
    assert [p.name for p in w.paths] == ["rank0-00000.h5"]
    with h5py.File(w.paths[0], "r") as f:
        assert set(f.attrs) == {"schema_version", "model", "run_id", "writer"}
        assert f.attrs["schema_version"] == 1 and f.attrs["model"] == "tiny" and f.attrs["run_id"] == "r1"
        assert f.attrs["writer"].startswith("miles_hpc ") and f"pid={os.getpid()}" in f.attrs["writer"]
        assert set(f) == {"samples", "routing"}
        s, r = f["samples"], f["routing"]
        T, N = 5 + 5 + 2, 3
        want = {
            "tokens": ("<i4", (T,)),
            "token_offsets": ("<i8", (N + 1,)),
            "loss_mask": ("|u1", (T,)),
            "rollout_logprobs": ("<f4", (T,)),
            "policy_version": ("<i4", (T,)),
            "reward": ("<f4", (N,)),
            "prompt_len": ("<i4", (N,)),
            "group_id": ("<i8", (N,)),
            "status": ("|u1", (N,)),
            "train_step": ("<i4", (N,)),
            "prompt_id": ("<i8", (N,)),
            "token_hash": ("|S32", (N,)),
            "metadata": ("|O", (N,)),
        }
        assert {k: (s[k].dtype.str, s[k].shape) for k in s} == want
        assert h5py.check_string_dtype(s["metadata"].dtype).encoding == "utf-8"
        for ds in [*s.values(), *r.values()]:
            assert ds.chunks is not None and ds.maxshape[0] is None and ds.compression == "gzip"
        assert s["token_offsets"][()].tolist() == [0, 5, 10, 12]
        assert s["tokens"][:5].tolist() == batch[0].tokens and s["prompt_len"][()].tolist() == [3, 3, 2]
        assert s["token_hash"][0].decode() == batch[0].token_hash and s["metadata"].asstr()[1] == '{"i": 1}'
        assert set(r) == {"experts", "offsets"} and r.attrs["num_experts"] == 8
        assert r["experts"].dtype == np.uint8 and r["experts"].shape == (4 + 1, 2, 2)
        assert r["offsets"][()].tolist() == [0, 4, 4, 5]  # a sample without routing has an empty range
        np.testing.assert_array_equal(r["experts"][:4], batch[0].routed_experts)


def test_layout_without_any_routing_is_still_complete(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.append([sample(0, routing=None)])
    with h5py.File(w.paths[0], "r") as f:
        assert f["routing/experts"].shape == (0, 0, 0) and f["routing/offsets"][()].tolist() == [0, 0]
        assert f["routing"].attrs["num_experts"] == -1  # unknown
    assert list(TrajectoryReader(w.paths[0])) == [stored(sample(0, routing=None))]


# -- shards roll, names sort, nothing is overwritten ---------------------------------------------------------------


def test_shards_roll_by_size_and_numbering_continues(tmp_path: Path) -> None:
    with writer(tmp_path, max_shard_bytes=1) as w:  # every batch fills a shard
        for i in range(3):
            w.append([sample(2 * i), sample(2 * i + 1)])
    assert [p.name for p in w.paths] == ["traj-00000.h5", "traj-00001.h5", "traj-00002.h5"]
    (tmp_path / "traj-00003.h5.partial").write_bytes(b"crashed attempt")
    with writer(tmp_path) as w2:  # a requeued job: continues after every existing index, partial ones too
        w2.append([sample(6)])
    assert [p.name for p in w2.paths] == ["traj-00004.h5"]
    assert [s.prompt_id for s in TrajectoryReader(tmp_path)] == list(range(7))


def test_writer_api_edges(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.append([])
    assert w.current_path is None
    w.close()
    w.close()  # idempotent
    assert list(tmp_path.iterdir()) == [] and w.paths == []
    with pytest.raises(ValueError, match="closed"):
        w.append([sample(0)])
    for bad in (
        dict(prefix=""),
        dict(prefix="a/b"),
        dict(max_shard_bytes=0),
        dict(compression="zstd"),
        dict(num_experts=0),
    ):
        with pytest.raises(ValueError):
            writer(tmp_path, **bad)


# -- crash safety ------------------------------------------------------------------------------------------------


def test_unclosed_writer_leaves_only_a_partial(tmp_path: Path) -> None:
    done = writer(tmp_path, prefix="a")
    done.append([sample(0)])
    done.close()
    crashed = writer(tmp_path, prefix="b")
    crashed.append([sample(1)])
    crashed.flush()
    # The process "dies" here: no close(), the shard keeps its .partial name.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-00000.h5", "b-00000.h5.partial"]
    reader = TrajectoryReader(tmp_path)
    assert [s.prompt_id for s in reader] == [0]
    assert [p.name for p in reader.partial_shards] == ["b-00000.h5.partial"]
    summary = summarize(tmp_path)
    assert summary["shards"] == 1 and summary["partial_shards"] == 1 and summary["samples"] == 1
    crashed.close()
    assert len(TrajectoryReader(tmp_path)) == 2


def test_a_bad_batch_leaves_the_shard_untouched(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.append([sample(0)])
    broken = sample(1)
    broken.tokens.append(5)  # mutated after construction: lengths and hash disagree
    with pytest.raises(SampleError, match=r"batch\[1\].*Sample\.loss_mask"):
        w.append([sample(2), broken])
    with pytest.raises(ValueError, match="layers, top_k"):
        w.append([sample(3, routing=(3, 2))])
    w.append([sample(4)])
    w.close()
    assert [s.prompt_id for s in TrajectoryReader(tmp_path)] == [0, 4]


# -- routing ids: the smallest dtype that holds them --------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_experts", "max_id", "dtype"),
    [
        (8, 7, np.uint8),
        (256, 255, np.uint8),
        (257, 256, np.int16),
        (32768, 32767, np.int16),
        (40000, 39999, np.int32),
        (None, 7, np.int16),
        (None, 40000, np.int32),
    ],
)
def test_routing_dtype_selection_and_round_trip(
    tmp_path: Path, num_experts: int | None, max_id: int, dtype: type
) -> None:
    routed = np.array([[[0, max_id]], [[max_id, 1]]], dtype=np.int64)  # 2 rows, 1 layer, top-2
    s = sample(0, prompt=2, response=1, routed_experts=routed)
    with writer(tmp_path, num_experts=num_experts) as w:
        w.append([s])
    with h5py.File(w.paths[0], "r") as f:
        assert f["routing/experts"].dtype == dtype
        assert f["routing"].attrs["num_experts"] == (num_experts or -1)
    (back,) = TrajectoryReader(tmp_path)
    assert back == stored(s) and back.routed_experts.dtype == dtype


def test_routing_ids_out_of_range_are_refused(tmp_path: Path) -> None:
    with writer(tmp_path, num_experts=4) as w, pytest.raises(ValueError, match="num_experts is 4"):
        w.append([sample(0, experts=8)])
    with writer(tmp_path, prefix="x") as w:
        w.append([sample(0)])  # no num_experts: the first routed batch picks int16
        big = sample(1, prompt=1, response=1, routed_experts=np.full((1, 2, 2), 40000))
        with pytest.raises(ValueError, match="pass num_experts"):
            w.append([big])


# -- bad files fail with the file's name, never with an h5py traceback ---------------------------------------------


def good_shard(d: Path) -> Path:
    with writer(d) as w:
        w.append([sample(0), sample(1)])
    return w.paths[0]


def edit(path: Path, change: Any) -> Path:
    with h5py.File(path, "r+") as f:
        change(f)
    return path


def retype_tokens(f: h5py.File) -> None:
    data = f["samples/tokens"][()]
    del f["samples/tokens"]
    f["samples"].create_dataset("tokens", data=data.astype(np.int64))


def flip_token(f: h5py.File) -> None:
    f["samples/tokens"][0] = 999  # a bit flip on disk: the stored hash no longer matches


BAD_FILES: dict[str, tuple[Any, str]] = {
    "truncated": (lambda d: _cut(good_shard(d), 0.5), "truncated or corrupt HDF5 file"),
    "truncated_tail": (lambda d: _cut(good_shard(d), 0.97), "truncated or corrupt HDF5 file"),
    "random_bytes": (lambda d: _write(d / "noise.h5", os.urandom(4096)), "not an HDF5 file"),
    "empty_file": (lambda d: _write(d / "empty.h5", b""), "not an HDF5 file"),
    "foreign_hdf5": (lambda d: _foreign(d / "other.h5"), "no /samples group"),
    "schema_version": (
        lambda d: edit(good_shard(d), lambda f: f.attrs.modify("schema_version", 2)),
        "schema_version is 2",
    ),
    "missing_attr": (lambda d: edit(good_shard(d), lambda f: f.attrs.__delitem__("run_id")), "run_id"),
    "missing_dataset": (
        lambda d: edit(good_shard(d), lambda f: f["samples"].__delitem__("reward")),
        "missing dataset samples/reward",
    ),
    "missing_routing": (lambda d: edit(good_shard(d), lambda f: f.__delitem__("routing")), "/routing"),
    "wrong_dtype": (lambda d: edit(good_shard(d), retype_tokens), "samples/tokens has dtype int64"),
    "offsets_decrease": (
        lambda d: edit(good_shard(d), lambda f: f["samples/token_offsets"].__setitem__(1, 11)),
        "token_offsets decreases",
    ),
    "offsets_overrun": (
        lambda d: edit(good_shard(d), lambda f: f["samples/token_offsets"].__setitem__(2, 11)),
        "token_offsets ends at 11",
    ),
    "routing_offsets": (
        lambda d: edit(good_shard(d), lambda f: f["routing/offsets"].__setitem__(0, 1)),
        "routing/offsets must start at 0",
    ),
    "per_sample_rows": (
        lambda d: edit(good_shard(d), lambda f: f["samples/status"].resize((1,))),
        "samples/status has 1 rows, expected 2",
    ),
    "tampered_token": (lambda d: edit(good_shard(d), flip_token), "sample 0 is invalid: Sample.token_hash"),
    "bad_status": (
        lambda d: edit(good_shard(d), lambda f: f["samples/status"].__setitem__(1, 9)),
        "sample 1 is invalid: Sample.status",
    ),
}


def _cut(path: Path, keep: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _foreign(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f["weights"] = np.zeros(3)
    return path


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_trajectory_file_error(tmp_path: Path, case: str) -> None:
    make_bad, words = BAD_FILES[case]
    path = make_bad(tmp_path)
    for target in (path, tmp_path):  # the file itself, and the directory holding it
        with pytest.raises(TrajectoryFileError) as info:
            list(TrajectoryReader(target))
        message = str(info.value)
        assert message.startswith(f"{path}: ") and words in message, message
        assert info.value.path == path and "Traceback" not in message
    if case != "tampered_token":  # summarize counts, it does not re-hash every sample
        with pytest.raises(TrajectoryFileError, match=path.name):
            summarize(path)


def test_missing_path_raises_trajectory_file_error(tmp_path: Path) -> None:
    with pytest.raises(TrajectoryFileError, match="nothing-here"):
        TrajectoryReader(tmp_path / "nothing-here")
    with pytest.raises(IndexError):
        TrajectoryReader(good_shard(tmp_path)).read(2)


def test_a_write_that_fails_half_way_keeps_the_shard_partial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_hpc.data import store

    w = writer(tmp_path)
    w.append([sample(0)])
    real, calls = store._extend, []

    def dies_on_third(ds: h5py.Dataset, values: np.ndarray) -> None:  # e.g. the disk filled up mid-batch
        calls.append(ds.name)
        if len(calls) == 3:
            raise OSError("No space left on device")
        real(ds, values)

    monkeypatch.setattr(store, "_extend", dies_on_third)
    with pytest.raises(OSError, match="No space"):
        w.append([sample(1)])
    with pytest.raises(ValueError, match="left as .partial"):
        w.append([sample(2)])
    w.close()  # closes the file but never renames a torn shard
    assert [p.name for p in tmp_path.iterdir()] == ["traj-00000.h5.partial"]
    assert len(TrajectoryReader(tmp_path)) == 0


def test_extra_attrs_abort_and_checksums(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run_id"):
        writer(tmp_path, attrs={"run_id": "x"})
    with writer(tmp_path, prefix="a", attrs={"reconciled_from": "t-00000.h5", "n": 3}) as w:
        w.append([sample(0)])
    with h5py.File(w.paths[0]) as f:
        assert (f.attrs["reconciled_from"], f.attrs["n"], f.attrs["run_id"]) == ("t-00000.h5", 3, "r1")
        checksummed = {n for n in f["samples"] if f["samples"][n].fletcher32}
        assert checksummed == {*f["samples"]} - {"metadata"}  # HDF5 refuses the filter on vlen strings
    aborted = writer(tmp_path, prefix="b")
    aborted.append([sample(1)])
    aborted.abort()
    with pytest.raises(ValueError, match="closed"):
        aborted.append([sample(2)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-00000.h5", "b-00000.h5.partial"]
    assert len(TrajectoryReader(tmp_path)) == 1
