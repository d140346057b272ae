"""The "delta" weight sync end to end (sync/strategies/delta.py -> files -> engine/delta_receiver.py), over real
`miles-hpc serve` processes (bfloat16, the tiny Qwen3-MoE: per-expert HF names) driven by the Publisher: a full first
version, small deltas after it, a restarted engine brought back with full tensors, a corrupt payload and a wrong
base refused by name, pruning; plus the version directory writer/reader and the engine side in-process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sync_support import bf16_fleet, engine_sums, perturbed_weights, router_of
from test_client_engine import HAVE_SERVER, EngineProcess, tiny_model

from miles_hpc.engine import delta_receiver
from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine, RequestError
from miles_hpc.engine.delta_receiver import apply_version
from miles_hpc.models import load_pretrained
from miles_hpc.rollout.client import EngineClient, EngineHTTPError
from miles_hpc.sync.codec.delta_codec import encode, encode_full
from miles_hpc.sync.codec.delta_manifest import ManifestError, VersionWriter, read_manifest, read_payload
from miles_hpc.sync.protocol import WeightSyncError
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies.delta import DeltaSpec, DeltaSync, Staged
from miles_hpc.sync.wire.checksum import tensor_checksum

needs_server = pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built")
Named = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------- trainer-side weights
def base_weights(seed: int = 1) -> Named:
    """The tiny model moved by a seeded perturbation, in bfloat16: a first trainer version."""
    return perturbed_weights(seed)


def step(named: Named, seed: int, frac: float = 0.02) -> Named:
    """A small optimizer step as bf16 sees it: `frac` of the (nonzero) values move by one ulp, up or down."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, t in named:
        bits = t.clone().view(torch.int16).flatten()
        nonzero = torch.nonzero((bits & 0x7FFF) != 0).flatten()
        k = max(1, int(frac * bits.numel()))
        idx = nonzero[torch.randperm(nonzero.numel(), generator=g)[:k]]
        bits[idx] += (torch.randint(0, 2, (idx.numel(),), generator=g) * 2 - 1).to(torch.int16)
        out.append((n, bits.view(torch.bfloat16).reshape(t.shape)))
    return out


def sums(named: Named) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in named}


# ---------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    with bf16_fleet(tmp_path_factory.mktemp("delta-engines")) as procs:
        yield procs


@needs_server
@pytest.mark.process
def test_full_then_deltas_then_a_restarted_engine_gets_full(engines: list[EngineProcess], tmp_path: Path) -> None:
    spec = DeltaSpec(run_dir=tmp_path, rollout_dtype=torch.bfloat16, keep_versions=2, timeout_s=60)
    weights_dir = tmp_path / "weights"

    async def main() -> None:
        sync = DeltaSync(spec)
        async with router_of(engines) as router:
            publisher = Publisher(sync, router, pause_mode="in_place")
            w = base_weights()
            report = await publisher.publish(lambda: iter(w), "1")
            assert (report.engines, report.dropped, report.tensors) == (2, (), len(w))
            m1 = read_manifest(weights_dir / "v1")
            assert m1.base_version is None and {e.kind for e in m1.tensors} == {"full"}

            for version in ("2", "3"):
                w = step(w, seed=int(version))
                await publisher.publish(lambda w=w: iter(w), version)
                m = read_manifest(weights_dir / f"v{version}")
                assert m.base_version == str(int(version) - 1) and "delta" in {e.kind for e in m.tensors}
                assert m.total_bytes < 0.1 * m.full_bytes, (m.total_bytes, m.full_bytes)
                for c in router.clients:  # the publisher verified this too; say it here in plain terms
                    assert {k: v for k, v in (await engine_sums(c)).items() if k in dict(w)} == sums(w)
            assert sorted(p.name for p in weights_dir.iterdir()) == ["v2", "v3"]  # keep_versions=2, nothing partial

            # Engine 1 restarts with the checkpoint (version "0"): it cannot apply a delta against "3".
            await asyncio.to_thread(lambda: (engines[1].stop(), engines[1].start().wait_ready(90)))
            w = step(w, seed=4)
            report = await publisher.publish(lambda: iter(w), "4")
            assert report.engines == 2 and report.dropped == ()
            full = read_manifest(weights_dir / "v4" / "full")
            assert full.base_version is None and len(full.tensors) == len(w)
            assert read_manifest(weights_dir / "v4").base_version == "3"
            infos = await asyncio.gather(*(c.model_info() for c in router.clients))
            assert [i["weight_version"] for i in infos] == ["4", "4"]
            for c in router.clients:
                assert {k: v for k, v in (await engine_sums(c)).items() if k in dict(w)} == sums(w)
            out = await router.generate([5, 6, 7], {"max_new_tokens": 2})
            assert out.weight_versions[0].version == "4"

    asyncio.run(asyncio.wait_for(main(), 120))


class _Corrupting(DeltaSync):
    """Flips one byte in the middle of the first "delta" payload after writing it (a bad disk or a torn copy)."""

    corrupt = True

    async def stage(self, named, version, *, full):  # type: ignore[no-untyped-def]
        staged = await super().stage(named, version, full=full)
        assert staged.manifest is not None
        if self.corrupt and staged.base_version is not None:
            e = next(e for e in staged.manifest.tensors if e.kind == "delta")
            path = staged.directory / e.file
            data = bytearray(path.read_bytes())
            data[e.offset + e.length // 2] ^= 0x40
            path.write_bytes(bytes(data))
            self.corrupted = e.name
        return staged


@needs_server
@pytest.mark.process
def test_corrupt_payload_and_wrong_base_are_refused_by_name(engines: list[EngineProcess], tmp_path: Path) -> None:
    spec = DeltaSpec(run_dir=tmp_path, rollout_dtype=torch.bfloat16, timeout_s=60)

    async def main() -> None:
        sync = _Corrupting(spec)
        async with router_of(engines) as router:
            publisher = Publisher(sync, router, pause_mode="in_place")
            w1 = base_weights(seed=11)
            await publisher.publish(lambda: iter(w1), "11")  # full: whatever the engines held before
            w2 = step(w1, seed=12)
            with pytest.raises(WeightSyncError) as err:
                await publisher.publish(lambda: iter(w2), "12")
            msg = str(err.value)
            assert f"tensor {sync.corrupted!r}" in msg and "CRC-32 mismatch" in msg, msg
            assert any(c.url in msg for c in router.clients), msg
            # Refused before anything was written: the engines still hold 11, whole; the base did not move.
            assert sync.base_version == "11" and publisher.version == "11"
            for c in router.clients:
                info = await c.model_info()
                assert (info["weight_version"], info["weights_half_updated"]) == ("11", False)
                assert {k: v for k, v in (await engine_sums(c)).items() if k in dict(w1)} == sums(w1)

            sync.corrupt = False
            await publisher.publish(lambda: iter(w2), "12")  # the same delta, intact, against 11
            v12 = tmp_path / "weights" / "v12"
            assert read_manifest(v12).base_version == "11"

            c = router.clients[0]
            with pytest.raises(
                EngineHTTPError,
                match=r"engine holds weight version '12', the delta in .* is against "
                r"'11'",
            ):
                await c.update_weights_from_delta(v12, base_version="11")
            with pytest.raises(EngineHTTPError, match=r"base_version '5' in the request, '11' in"):
                await c.update_weights_from_delta(v12, base_version="5")
            with pytest.raises(EngineHTTPError, match=r"is not a directory"):
                await c.update_weights_from_delta(tmp_path / "nowhere", base_version=None)
            plain = EngineClient(c.url, connect_retries=0)  # no key: the route is admin-level
            try:
                with pytest.raises(EngineHTTPError, match="401"):
                    await plain.update_weights_from_delta(v12, base_version="11")
            finally:
                await plain.close()
            assert (await c.model_info())["weight_version"] == "12"

    asyncio.run(asyncio.wait_for(main(), 90))


# ---------------------------------------------------------------- the version directory, no engines
def test_writer_renames_atomically_and_reads_back(tmp_path: Path) -> None:
    old, new = torch.randn(64, 8).to(torch.bfloat16), torch.randn(64, 8).to(torch.bfloat16)
    final = tmp_path / "v2"
    with VersionWriter(final, version="2", base_version="1", shard_bytes=64) as w:
        w.add("a", encode(old, new))
        w.add("b", encode_full(new))
        w.add("c", encode(new, new))
        assert w.partial.is_dir() and not final.exists()  # nothing visible before commit
        m = w.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]
    assert m == read_manifest(final)
    assert [e.kind for e in m.tensors] == ["full", "full", "same"]  # random bf16 values: no delta is smaller
    assert len({e.file for e in m.tensors}) == 3  # shard_bytes=64: a file per frame
    assert m.full_bytes == 3 * new.numel() * 2 and m.total_bytes == sum(e.length for e in m.tensors)
    assert all(read_payload(final, e).checksum == tensor_checksum(new) for e in m.tensors)
    raw = json.loads((final / "manifest.json").read_text())
    assert raw["format"] == "miles-hpc-weights/2" and raw["tensors"][0]["shape"] == [64, 8]

    # A group: one frame for three tensors (their concatenation); each entry keeps its own shape and checksum.
    parts = [torch.randn(shape).to(torch.bfloat16) for shape in ((4, 3), (5,), (2, 2))]
    flat = torch.cat([p.reshape(-1) for p in parts])
    group_dir = tmp_path / "g3"
    with VersionWriter(group_dir, version="3", base_version=None, shard_bytes=64) as w:
        w.add("solo", encode_full(new))
        w.add_group([(f"p{i}", tuple(p.shape), tensor_checksum(p)) for i, p in enumerate(parts)], encode_full(flat))
        g = w.commit()
    members = [e for e in g.tensors if e.name.startswith("p")]
    assert [e.elem_offset for e in members] == [0, 12, 17] and len({(e.file, e.offset) for e in members}) == 1
    assert g.total_bytes == g.tensors[0].length + members[0].length and g.full_bytes == (64 * 8 + 21) * 2
    assert g == read_manifest(group_dir) and all(read_payload(group_dir, e).shape == (21,) for e in members)
    raw = json.loads((group_dir / "manifest.json").read_text())
    raw["tensors"][2]["length"] += 1  # a member disagreeing with its frame
    (group_dir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="share the frame"):
        read_manifest(group_dir)
    shutil.rmtree(group_dir)

    with VersionWriter(final, version="2", base_version=None) as w:  # a retried publish replaces the version
        w.add("a", encode_full(old))
        w.commit()
    assert read_manifest(final).base_version is None and sorted(p.name for p in tmp_path.iterdir()) == ["v2"]


def test_writer_leaves_nothing_when_interrupted(tmp_path: Path) -> None:
    writer = VersionWriter(tmp_path / "v3", version="3", base_version=None)
    with pytest.raises(RuntimeError, match="trainer died"), writer as w:
        w.add("a", encode_full(torch.ones(4)))
        raise RuntimeError("trainer died")
    assert list(tmp_path.iterdir()) == []
    w = VersionWriter(tmp_path / "v3", version="3", base_version=None)
    with pytest.raises(ValueError, match="a 'same' payload in a version without a base"):
        w.add("a", encode(torch.ones(4), torch.ones(4)))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_reader_errors_name_the_file_and_tensor(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="is not a directory"):
        read_manifest(tmp_path / "missing")
    with VersionWriter(tmp_path / "v1", version="1", base_version=None) as w:
        w.add("model.norm.weight", encode_full(torch.ones(16)))
        m = w.commit()
    d = tmp_path / "v1"
    manifest = d / "manifest.json"
    raw = json.loads(manifest.read_text())
    for patch, match in (
        ({"file": "../etc/passwd"}, "not a plain file name"),
        ({"kind": "delta"}, "'full' only"),
        ({"offset": -1}, "non-negative integers"),
    ):
        manifest.write_text(json.dumps({**raw, "tensors": [{**raw["tensors"][0], **patch}]}))
        with pytest.raises(ManifestError, match=rf"{manifest}: tensor 'model.norm.weight' .*{match}"):
            read_manifest(d)
    manifest.write_text("{not json")
    with pytest.raises(ManifestError, match="cannot read the manifest"):
        read_manifest(d)
    e = m.tensors[0]
    (d / e.file).write_bytes((d / e.file).read_bytes()[:-3])
    with pytest.raises(ManifestError, match=r"tensor 'model.norm.weight' in .*payload-00000.bin: .* bytes at offset"):
        read_payload(d, e)


def test_prune_keeps_the_newest_versions_and_drops_leftovers(tmp_path: Path) -> None:
    sync = DeltaSync(DeltaSpec(run_dir=tmp_path, keep_versions=2))
    root = tmp_path / "weights"
    for i, name in enumerate(["v1", "v2", "v3", "v4.partial", "v2.stale-0a1b2c3d"]):
        (root / name).mkdir(parents=True)
        os.utime(root / name, ns=(i * 10**9, i * 10**9))
    (root / "notes.txt").write_text("not a version")
    sync.prune(keep=root / "v1")  # the version just published counts as newest, whatever its mtime
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "v1", "v3"]


# ---------------------------------------------------------------- the engine side, in-process
def engine_of(dtype: str, device: str = "cpu") -> Engine:
    return Engine(load_pretrained(tiny_model()), EngineConfig(dtype=dtype, max_total_tokens=256, device=device))


async def _stage(sync: DeltaSync, named: Named, version: str, *, full: bool = False) -> Staged:
    return await sync.stage(iter(named), version, full=full)


@pytest.mark.process
def test_engine_refuses_a_delta_in_another_dtype_and_a_wrong_base(tmp_path: Path) -> None:
    sync = DeltaSync(DeltaSpec(run_dir=tmp_path, rollout_dtype=torch.bfloat16))
    w1 = base_weights()
    s1 = asyncio.run(_stage(sync, w1, "1"))
    sync.commit(s1)
    s2 = asyncio.run(_stage(sync, step(w1, seed=2), "2", full=True))
    assert s2.full_directory == s2.directory / "full"

    fp32 = engine_of("float32")  # full tensors are cast like every update; a delta of bf16 bits is refused
    apply_version(fp32, s1.directory, base_version=None, weight_version=None, flush_cache=True)
    assert fp32.weight_version == "1"
    name = next(e.name for e in s2.manifest.tensors if e.kind == "delta")  # type: ignore[union-attr]
    with pytest.raises(RequestError, match=rf"tensor '{name}' of .*: a bfloat16 delta, but this engine holds float32"):
        apply_version(fp32, s2.directory, base_version="1", weight_version=None, flush_cache=True)

    bf16 = engine_of("bfloat16")
    with pytest.raises(RequestError, match=r"engine holds weight version '0', the delta in .* is against '1'"):
        apply_version(bf16, s2.directory, base_version="1", weight_version=None, flush_cache=True)
    report = apply_version(bf16, s2.full_directory, base_version=None, weight_version="2", flush_cache=True)
    assert (report.version, report.tensors, bf16.weight_version) == ("2", len(w1), "2")
    assert {k: v for k, v in bf16.checksums().items() if k in s2.checksums} == s2.checksums


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.process
def test_engine_whose_weights_are_not_the_base_ends_half_updated(
    grouped: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version says "1" but one tensor differs (a mislabelled engine): its checksum catches it. Tensor by
    tensor, after the tensors before it were applied (one per part here), so the paused engine is half-updated and
    refuses to continue; in one group (the whole tiny model), before any tensor of the group was applied."""
    monkeypatch.setattr(delta_receiver, "BUCKET_BYTES", 1)  # every tensor its own update part
    sync = DeltaSync(DeltaSpec(run_dir=tmp_path, rollout_dtype=torch.bfloat16, group_bytes=1 << 30 if grouped else 1))
    w1 = base_weights()
    sync.commit(asyncio.run(_stage(sync, w1, "1")))
    s2 = asyncio.run(_stage(sync, step(w1, seed=2), "2"))
    assert s2.manifest is not None
    bad = [e.name for e in s2.manifest.tensors if e.kind == "delta"][-1]
    engine = engine_of("bfloat16")
    engine.update_weights(
        [(n, t) for n, t in step(w1, seed=99) if n == bad] + [(n, t) for n, t in w1 if n != bad], version="1"
    )
    engine.pause("in_place")
    with pytest.raises(RequestError, match=rf"tensor '{bad}' in .*payload-00000.bin: checksum mismatch"):
        apply_version(engine, s2.directory, base_version="1", weight_version=None, flush_cache=True)
    if grouped:
        assert engine.weight_version == "1" and not engine.half_updated
        return
    assert engine.weight_version == "1" and engine.half_updated
    with pytest.raises(RequestError, match="half-updated"):
        engine.resume()
    with pytest.raises(RequestError, match="half-updated, not version '1'"):  # the trainer must send full tensors
        apply_version(engine, s2.directory, base_version="1", weight_version=None, flush_cache=True)


@pytest.mark.gpu
def test_gpu_coding_on_the_trainer_device_and_decoding_on_the_engine_gpu(tmp_path: Path) -> None:
    # `sync.delta_device: trainer`: the kept copies live on the GPU the tensors come from and the codec runs there
    # (Triton class layout); the engine decodes each group against its own CUDA weights.
    sync = DeltaSync(DeltaSpec(run_dir=tmp_path, rollout_dtype=torch.bfloat16, device=None, group_bytes=1 << 16))
    w1 = [(n, t.cuda()) for n, t in base_weights()]
    engine = engine_of("bfloat16", "cuda")
    s1 = asyncio.run(_stage(sync, w1, "1"))
    engine.pause("in_place")
    apply_version(engine, s1.directory, base_version=None, weight_version=None, flush_cache=True)
    sync.commit(s1)
    assert all(t.is_cuda for t in sync._kept.values())
    w2 = [(n, t.cuda()) for n, t in step([(n, t.cpu()) for n, t in w1], seed=3)]
    s2 = asyncio.run(_stage(sync, w2, "2"))
    assert s2.manifest is not None and any(e.elem_offset for e in s2.manifest.tensors)  # several groups of several
    assert {e.kind for e in s2.manifest.tensors} >= {"delta"}
    report = apply_version(engine, s2.directory, base_version="1", weight_version=None, flush_cache=True)
    assert report.version == "2" and engine.weight_version == "2"
    from miles_hpc.models import hf_target

    held = dict(engine.model.named_parameters())
    for name, t in w2:
        target = hf_target(engine.model, name, held)
        assert target.is_cuda and torch.equal(target.view(torch.int16), t.view(torch.int16)), name
