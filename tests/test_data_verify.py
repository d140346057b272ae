"""Content checks of trajectory shards (issue 23 item 6): `verify_shards` catches each kind of damage and names the
file and sample; `miles-hpc inspect [--verify]` exit codes; shards without the optional datasets; the per-chunk
checksum of new shards, and old shards without it still reading."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from miles_hpc.cli import main
from miles_hpc.data import Sample, TrajectoryFileError, TrajectoryReader, TrajectoryWriter, summarize, verify_shards
from miles_hpc.data.verify import SHOWN, check_shard


def sample(i: int, response: int = 3, **over: Any) -> Sample:
    n = 2 + response
    fields: dict[str, Any] = dict(
        prompt_id=i,
        group_id=i // 2,
        tokens=[(i * 13 + k) % 300 for k in range(n)],
        prompt_len=2,
        loss_mask=[0, 0] + [1] * response,
        rollout_logprobs=[0.0, 0.0] + [-0.5] * response,
        policy_version=[-1, -1] + [0] * response,
        reward=1.0,
        routed_experts=(np.arange((n - 1) * 4) % 8).reshape(n - 1, 2, 2),
        metadata={"i": i},
        train_step=0,
    )
    fields.update(over)
    return Sample(**fields)


def shard(d: Path, samples: list[Sample] | None = None, prefix: str = "traj") -> Path:
    with TrajectoryWriter(d, prefix=prefix, model="m", run_id="r", num_experts=8) as w:
        w.append(samples if samples is not None else [sample(i) for i in range(4)])
    (path,) = w.paths
    return path


def edit(path: Path, name: str, index: Any, value: Any) -> Path:
    with h5py.File(path, "r+") as f:
        f[name][index] = value
    return path


def test_a_clean_shard_has_no_problems(tmp_path: Path) -> None:
    path = shard(tmp_path)
    assert verify_shards(tmp_path) == [] and check_shard(path).ok and check_shard(path).samples == 4
    with h5py.File(path) as f:  # new shards carry a checksum per chunk
        assert all(f[n].fletcher32 for n in ("samples/tokens", "samples/reward", "routing/experts"))


# name, index, value, (sample index or None, words of the problem)
DAMAGE: dict[str, tuple[str, Any, Any, int | None, str]] = {
    "nan_reward": ("samples/reward", 2, np.nan, 2, "reward is not finite"),
    "inf_reward": ("samples/reward", 1, np.inf, 1, "reward is not finite"),
    "status": ("samples/status", 3, 7, 3, "status not one of 0..3"),
    "token": ("samples/tokens", 6, 299, 1, "token_hash does not match the tokens"),  # token 6 is sample 1's 2nd
    "negative_token": ("samples/tokens", 0, -5, 0, "negative token id"),
    "loss_mask_2": ("samples/loss_mask", 4, 2, 0, "loss_mask not in {0, 1}"),
    "loss_on_prompt": ("samples/loss_mask", 5, 1, 1, "loss_mask is not 0 on a prompt token"),
    "nan_logprob": ("samples/rollout_logprobs", 12, np.nan, 2, "rollout_logprobs holds NaN or +inf"),
    "logprob_on_prompt": ("samples/rollout_logprobs", 10, -1.0, 2, "rollout_logprobs is not 0.0 on a prompt token"),
    "version": ("samples/policy_version", 19, -3, 3, "policy_version below -1"),
    "version_on_prompt": ("samples/policy_version", 15, 0, 3, "policy_version is not -1 on a prompt token"),
    "prompt_len": ("samples/prompt_len", 1, 9, 1, "prompt_len outside 0..number of tokens"),
    "train_step": ("samples/train_step", 0, -4, 0, "train_step below -1"),
    "metadata": ("samples/metadata", 2, "{not json", 2, "metadata is not JSON"),
    "expert": ("routing/experts", (9, 0, 1), 8, 2, "expert id outside 0..7"),  # rows 8..11 are sample 2's
    "routing_rows": ("routing/offsets", 1, 6, 0, "routing has more rows than the sample has tokens"),
    "token_offsets": ("samples/token_offsets", 2, 1, None, "samples/token_offsets decreases at index 1"),
    "routing_start": ("routing/offsets", 0, 1, None, "routing/offsets must start at 0"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_each_kind_of_damage_is_named(tmp_path: Path, case: str) -> None:
    name, index, value, at, words = DAMAGE[case]
    path = edit(shard(tmp_path), name, index, value)
    problems = verify_shards(tmp_path)
    assert problems, case
    p = problems[0]
    assert p.path == path and p.sample == at and words in p.what, problems
    expect = f"{path}: sample {at}: {words}" if at is not None else f"{path}: "
    assert str(p).startswith(expect) and (words in str(p))


def test_minus_infinity_log_probs_are_allowed(tmp_path: Path) -> None:
    """log 0 = -inf is a valid log-prob (Sample allows it, the writer stores it): not damage; NaN and +inf are."""
    path = shard(tmp_path, [sample(0, rollout_logprobs=[0.0, 0.0, -np.inf, -0.5, -0.5])])
    assert verify_shards(path) == []


def test_many_bad_samples_are_listed_up_to_a_count(tmp_path: Path) -> None:
    path = shard(tmp_path, [sample(i) for i in range(SHOWN + 3)])
    edit(path, "samples/reward", slice(None), np.nan)
    problems = verify_shards(path)
    assert [p.sample for p in problems] == [*range(SHOWN), None]
    assert problems[-1].what == f"reward is not finite: {SHOWN + 3} samples in all"


def test_duplicate_groups_across_shards(tmp_path: Path) -> None:
    a = shard(tmp_path, [sample(i) for i in range(4)], prefix="a")  # groups 0, 1
    b = shard(tmp_path, [sample(i) for i in range(2, 8)], prefix="b")  # groups 1, 2, 3: group 1 twice
    (p,) = verify_shards(tmp_path)
    assert p.path == b and p.sample == 0 and a.name in p.what
    assert p.what == "1 group(s) (2 samples) also stored in a-00000.h5: stored twice (group_id 1)"
    assert verify_shards(a) == [] and verify_shards(b) == []  # each alone is fine


def _garbage_in_a_chunk(path: Path, dataset: str) -> None:
    """4 KB of random bytes in the middle of the dataset's first raw data chunk (read from HDF5's chunk index)."""
    with h5py.File(path) as f:
        info = f[dataset].id.get_chunk_info(0)
    assert info.size > 8192, info  # a chunk big enough that the garbage lands inside it
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + (info.size - 4096) // 2)
        f.write(os.urandom(4096))


def _without_checksums(path: Path) -> Path:
    """The same shard as a writer before the checksum filter wrote it (same chunks, no fletcher32)."""
    old = path.with_name("old-00000.h5")
    with h5py.File(path) as src, h5py.File(old, "w") as dst:
        dst.attrs.update(src.attrs)

        def copy(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Group):
                dst.require_group(name).attrs.update(obj.attrs)
            else:
                dst.create_dataset(name, data=obj[()], chunks=obj.chunks, maxshape=obj.maxshape, dtype=obj.dtype)

        src.visititems(copy)
    path.unlink()
    return old


def big_shard(d: Path) -> Path:
    # ~20k tokens: the first tokens chunk is a full 64 KiB one.
    return shard(d, [sample(i, response=2000) for i in range(10)])


def test_garbage_in_the_middle_of_a_shard_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = big_shard(tmp_path)
    _garbage_in_a_chunk(path, "samples/tokens")
    problems = verify_shards(tmp_path)
    assert problems and problems[0].path == path
    assert "cannot read samples/tokens" in problems[0].what, problems
    with pytest.raises(TrajectoryFileError, match=re.escape(str(path))):
        list(TrajectoryReader(path))  # the reader fails too, instead of returning changed ids
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith(f"{path}: cannot read samples/tokens") and "1 problem" in out.err
    assert main(["inspect", str(tmp_path)]) == 1  # the summary reads every chunk: the checksum trips it too


def test_old_shards_without_checksums_still_read_and_verify(tmp_path: Path) -> None:
    old = _without_checksums(big_shard(tmp_path))
    with h5py.File(old) as f:
        assert not f["samples/tokens"].fletcher32
    assert len(TrajectoryReader(old)) == 10 and verify_shards(old) == []
    _garbage_in_a_chunk(old, "samples/tokens")  # no checksum: the token hashes catch it
    problems = verify_shards(old)
    assert any(p.path == old and "token_hash does not match" in p.what for p in problems), problems


@pytest.mark.parametrize("dataset", ["prompt_id", "token_hash", "metadata"])
def test_optional_datasets_may_be_absent(tmp_path: Path, dataset: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["samples"][dataset]
    samples = list(TrajectoryReader(path))
    assert [s.group_id for s in samples] == [0, 0, 1, 1]
    assert [s.prompt_id for s in samples] == ([-1] * 4 if dataset == "prompt_id" else [0, 1, 2, 3])
    assert [s.metadata for s in samples] == ([{}] * 4 if dataset == "metadata" else [{"i": i} for i in range(4)])
    assert [s.token_hash for s in samples] == [sample(i).token_hash for i in range(4)]
    assert summarize(path)["samples"] == 4 and verify_shards(path) == []
    assert main(["inspect", str(path)]) == 0 and main(["inspect", "--verify", str(path)]) == 0
    assert "no problems" in capsys.readouterr().out


def test_a_required_dataset_may_not(tmp_path: Path) -> None:
    path = shard(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["samples/group_id"]
    (p,) = verify_shards(path)
    assert p.what == "missing dataset samples/group_id" and p.sample is None


def test_inspect_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(tmp_path)
    assert main(["inspect", "--verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"verified 1 shard(s) under {tmp_path}: no problems\n"
    edit(path, "samples/reward", 1, np.nan)
    assert main(["inspect", str(tmp_path)]) == 1  # plain inspect: the summary, and an error for the NaN
    out = capsys.readouterr()
    assert re.search(r"samples\s+4\n", out.out) and "mean 1.0000" in out.out  # over the finite rewards
    assert "1 not finite" in out.out and "1 sample(s) with a non-finite reward" in out.err
    assert "--verify" in out.err
    assert main(["inspect", "--verify", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert out.out == f"{path}: sample 1: reward is not finite\n"
    assert out.err == f"verified 1 shard(s) under {tmp_path}: 1 problem(s) in 1 of 1 shard(s)\n"
    assert main(["inspect", "--verify", str(tmp_path / "missing")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
