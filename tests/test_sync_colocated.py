"""The "colocated" weight sync (sync/strategies/colocated.py -> handles over HTTP -> sync/wire/tensor_handles.py): two versions
published to two real `miles-hpc serve` processes on this host through shared memory and verified, no segment left
in /dev/shm, hostile pickles refused with 400 naming the global or opcode (and nothing run), a remote engine refused
by URL; in-process, the restricted unpickler reads back exactly what the trainer side writes. The CUDA IPC path runs
in the `gpu` tier; the SGLang-format body is checked against SGLang's own request type and unpickler allowlist in
the `sglang` tier.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pickle
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from safetensors.torch import save
from sync_support import ADMIN, bf16_fleet, engine_sums, gpu_engine, router_of
from test_client_engine import HAVE_SERVER, EngineProcess, tiny_model
from torch.multiprocessing import reductions

from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.rollout import requests as rq
from miles_hpc.rollout.client import EngineClient, EngineHTTPError
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.sync.protocol import WeightSyncError
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies import colocated
from miles_hpc.sync.strategies.colocated import ColocatedSpec, ColocatedSync, ShmSlice, is_local_url, serialize_named
from miles_hpc.sync.wire import tensor_handles
from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.tensor_handles import TensorHandleError, load_named_tensors

needs_server = pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built")
REPO = Path(__file__).resolve().parents[1]
Named = list[tuple[str, torch.Tensor]]


def weights(seed: int) -> Named:
    """The tiny model moved by a seeded perturbation (float32): one trainer version per seed."""
    model = load_pretrained(tiny_model())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return [(n, t.detach().clone()) for n, t in iter_hf_tensors(model)]


def our_segments() -> list[str]:
    return sorted(p for p in os.listdir(colocated.SHM_DIR) if p.startswith(f"miles_hpc_{os.getpid()}_"))


def no_gpu(index: int) -> str:
    raise AssertionError("no CUDA tensor in this payload")


class FakeCudaTensor:
    """Pickles exactly as torch's CUDA IPC reduction does (same globals and argument types, made-up handles), so
    the CUDA format can be checked without a GPU."""

    def __init__(self, device: int | str = "GPU-00000000-1111-2222-3333-444444444444") -> None:
        self.device = device

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            reductions.rebuild_cuda_tensor,
            (
                torch.Tensor,
                torch.Size([4, 8]),
                (8, 1),
                0,
                torch.storage.TypedStorage,
                torch.bfloat16,
                self.device,
                b"\x01" * 64,
                1 << 21,
                4096,
                False,
                b"/torch_ipc_refcounter",
                3,
                b"\x02" * 64,
                True,
            ),
        )


def cuda_format_payload() -> str:
    """An SGLang-format entry with a (fake) CUDA tensor, through our own serializer."""
    return serialize_named([("model.embed_tokens.weight", FakeCudaTensor())], no_gpu)  # type: ignore[list-item]


# ---------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    with bf16_fleet(tmp_path_factory.mktemp("colocated-engines")) as procs:
        yield procs


@needs_server
@pytest.mark.process
def test_publish_two_versions_to_two_engines_without_leaking_segments(
    engines: list[EngineProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    stage = colocated.stage_bucket

    def recording(pending: Named, dtype: torch.dtype | None) -> Any:
        bucket = stage(pending, dtype)
        if bucket.segment is not None:
            made.append(bucket.segment.name)
            assert os.path.exists(os.path.join(colocated.SHM_DIR, bucket.segment.name))
        return bucket

    monkeypatch.setattr(colocated, "stage_bucket", recording)

    async def main() -> None:
        # Small buckets: many update parts per version, the version and cache flush on the last one only.
        sync = ColocatedSync(ColocatedSpec(bucket_bytes=1 << 16, rollout_dtype=torch.bfloat16, timeout_s=30))
        async with router_of(engines) as router:
            publisher = Publisher(sync, router, pause_mode="in_place")
            for version, seed in (("1", 1), ("2", 2)):
                made.clear()
                w = weights(seed)
                report = await publisher.publish(lambda w=w: iter(w), version)
                assert (report.engines, report.dropped, report.tensors) == (2, (), len(w))
                assert len(made) > 2 and our_segments() == []  # one segment per bucket, every one unlinked
                want = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in w}
                for c in router.clients:  # the publisher verified this; say it here in plain terms
                    got = await engine_sums(c)
                    assert {n: got[n] for n in want} == want
                    info = await c.model_info()
                    assert (info["weight_version"], info["weights_half_updated"]) == (version, False)
            out = await router.generate([5, 6, 7], {"max_new_tokens": 2})
            assert out.weight_versions[0].version == "2"

    asyncio.run(asyncio.wait_for(main(), 60))


@needs_server
@pytest.mark.process
def test_hostile_payloads_are_refused_and_nothing_runs(engines: list[EngineProcess], tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return (os.system, (f"touch {marker}",))

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    cases = [
        (b64(pickle.dumps([("model.norm.weight", RunsCode())])), f"refused global {os.system.__module__}.system"),
        (b64(pickle.dumps(eval)), "refused global builtins.eval"),
        (b64(pickle.dumps(argparse.Namespace(a=1), protocol=4)), "refused pickle opcode NEWOBJ"),
        (
            serialize_named([("model.norm.weight", ShmSlice("../../etc/passwd", 0, "float32", (4,)))], no_gpu),
            "is not one of ours",
        ),
        (
            serialize_named([("model.norm.weight", ShmSlice("miles_hpc_gone_0", 0, "float32", (4,)))], no_gpu),
            "cannot open shared-memory segment /dev/shm/miles_hpc_gone_0",
        ),
        (cuda_format_payload(), "CUDA IPC handles, but this engine runs on cpu"),
    ]

    async def main() -> None:
        client = EngineClient(f"http://127.0.0.1:{engines[0].port}", admin_api_key=ADMIN, connect_retries=0)
        plain = EngineClient(client.url, connect_retries=0)
        try:
            before = await engine_sums(client)
            for payload, needle in cases:
                with pytest.raises(EngineHTTPError) as err:
                    await client.update_weights_from_tensor([payload], weight_version="evil")
                assert err.value.status == 400 and needle in err.value.server_message, err.value
            with pytest.raises(EngineHTTPError, match="401"):  # the route is admin-level
                await plain.update_weights_from_tensor([cases[0][0]])
            assert not marker.exists()
            assert await engine_sums(client) == before and (await client.model_info())["weight_version"] != "evil"
            # A safetensors file whose header length makes its first byte 0x80 (a pickle's first byte) is still one.
            name = "model.norm.weight"
            t = torch.full(dict(weights(1))[name].shape, 0.5)
            blob = next(b for k in range(256) if (b := save({name: t}, metadata={"pad": "x" * k}))[0] == 0x80)
            await client.update_weights_from_tensor([b64(blob)])
            assert (await engine_sums(client))[name] == tensor_checksum(t.to(torch.bfloat16))
            await client.health_generate()
        finally:
            await client.close()
            await plain.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_remote_engine_is_refused_by_url() -> None:
    assert is_local_url("http://127.0.0.1:30000") and is_local_url("http://localhost:1")
    assert is_local_url("http://[::1]:8000")
    assert not is_local_url("http://192.0.2.7:30000")  # TEST-NET-1: never an address of this host
    assert not is_local_url("http://no-such-host.invalid:1")

    async def main() -> None:
        sync = ColocatedSync(ColocatedSpec())
        clients = [EngineClient("http://127.0.0.1:1"), EngineClient("http://192.0.2.7:30000")]
        with pytest.raises(WeightSyncError, match=r"engine http://192\.0\.2\.7:30000 is not on this host"):
            await sync.connect(clients)
        assert sync.clients == ()
        with pytest.raises(WeightSyncError, match="push before connect"):
            await sync.push(iter([]), "1")

    asyncio.run(main())


# ---------------------------------------------------------------- the format, in-process
def test_unpickler_reads_back_exactly_what_the_trainer_writes() -> None:
    pending = [
        ("a", torch.randn(3, 5)),
        ("b", torch.arange(10)),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.randn(6, 4).t()),
        ("half", torch.randn(7).to(torch.bfloat16)),
    ]
    for dtype in (None, torch.bfloat16):
        bucket = colocated.stage_bucket(pending, dtype)
        try:
            assert bucket.segment is not None and our_segments() == [bucket.segment.name]
            slices = [s for _, s in bucket.items]
            assert all(isinstance(s, ShmSlice) and s.offset % 64 == 0 for s in slices)
            raw = base64.b64decode(serialize_named(bucket.items, no_gpu))
            out = load_named_tensors(raw, "cpu")
            assert [n for n, _ in out] == [n for n, _ in pending]
            for (name, t), (_, got) in zip(pending, out):
                want = t.to(dtype or t.dtype)
                assert got.dtype == want.dtype and torch.equal(got, want), name
                assert bucket.checksums()[name] == tensor_checksum(want)
            got.add_(1)  # the engine's mapping is private: the trainer's segment does not change
            assert torch.equal(load_named_tensors(raw, "cpu")[-1][1], pending[-1][1].to(dtype or torch.bfloat16))
            del out, got
        finally:
            bucket.release()
        assert our_segments() == []
    bucket = colocated.stage_bucket([("e", torch.zeros(0, 3))], torch.bfloat16)  # empty tensors only
    try:
        raw = base64.b64decode(serialize_named(bucket.items, no_gpu))
        assert [(n, t.dtype, t.shape) for n, t in load_named_tensors(raw, "cpu")] == [("e", torch.bfloat16, (0, 3))]
    finally:
        bucket.release()
    assert our_segments() == []


def test_unpickler_refuses_what_the_format_does_not_need() -> None:
    assert tensor_handles.SHM_TAG == colocated.SHM_TAG
    with pytest.raises(TensorHandleError, match=r"refused global torch\.serialization\.load"):
        load_named_tensors(pickle.dumps(torch.load), "cpu")
    with pytest.raises(TensorHandleError, match="refused pickle opcode BUILD"):
        load_named_tensors(b"\x80\x04K\x00)b.", "cpu")  # BININT1 0, EMPTY_TUPLE, BUILD: setstate on an int
    with pytest.raises(TensorHandleError, match="refused pickle opcode EMPTY_DICT"):
        load_named_tensors(pickle.dumps({"a": 1}), "cpu")
    with pytest.raises(TensorHandleError, match="not a pickle"):
        load_named_tensors(b"\x80\x04garbage", "cpu")
    with pytest.raises(TensorHandleError, match=r"list of \(name, tensor\) pairs"):
        load_named_tensors(pickle.dumps([("a", 1)]), "cpu")
    # torch's own CPU reductions (file descriptors through the sender's resource sharer, torch_shm_manager files)
    for fn in (reductions.rebuild_tensor, reductions.rebuild_storage_fd, reductions.rebuild_storage_filename):
        with pytest.raises(
            TensorHandleError, match=rf"refused global torch\.multiprocessing\.reductions\.{fn.__name__}"
        ):
            load_named_tensors(pickle.dumps([("a", fn)]), "cpu")
    # A CUDA payload is checked field by field before any CUDA call; a token class is never callable.
    raw = base64.b64decode(cuda_format_payload())
    with pytest.raises(TensorHandleError, match="CUDA IPC handles, but this engine runs on cpu"):
        load_named_tensors(raw, "cpu")

    class BadClass(FakeCudaTensor):
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            fn, args = super().__reduce__()
            return fn, (torch.storage.TypedStorage, *args[1:])

    with pytest.raises(TensorHandleError, match="tensor class <torch.storage.TypedStorage>, expected torch.Tensor"):
        load_named_tensors(pickle.dumps([("a", BadClass())]), "cpu")

    class CallsToken:
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return (torch.Tensor, (10**9,))

    with pytest.raises(TensorHandleError, match="object is not callable"):
        load_named_tensors(pickle.dumps([("a", CallsToken())]), "cpu")
    with pytest.raises(TensorHandleError, match="not an aligned slice"):
        bucket = colocated.stage_bucket([("a", torch.ones(4))], None)
        try:
            assert bucket.segment is not None
            big = ShmSlice(bucket.segment.name, 0, "float32", (1 << 20,))
            load_named_tensors(base64.b64decode(serialize_named([("a", big)], no_gpu)), "cpu")
        finally:
            bucket.release()


def test_request_body_holds_sglang_fields_only() -> None:
    body = rq.update_weights_from_tensor_body(["QUJD"], weight_version=3, flush_cache=False)
    assert body == {"serialized_named_tensors": ["QUJD"], "flush_cache": False, "weight_version": "3"}
    with pytest.raises(ValueError, match="one per TP rank"):
        rq.update_weights_from_tensor_body([])
    assert rq.UPDATE_WEIGHTS_FROM_TENSOR.admin and not rq.UPDATE_WEIGHTS_FROM_TENSOR.idempotent


# ---------------------------------------------------------------- SGLang's own definitions (sglang tier)
SGLANG_CHECK = r"""
import io, json, sys
sys.path.insert(0, sys.argv[1])
from miles_hpc.rollout import requests as rq
from pydantic import TypeAdapter
from sglang.srt.managers import io_struct as io_
from sglang.srt.utils.common import SafeUnpickler, normalize_serialized_named_tensor_payloads

payload = json.loads(sys.stdin.read())
body = rq.update_weights_from_tensor_body([payload], weight_version="3", flush_cache=True, abort_all_requests=False)
io_.UpdateWeightsFromTensorReqInput(**body)
TypeAdapter(io_.UpdateWeightsFromTensorReqInput).validate_python(dict(body))
raw = normalize_serialized_named_tensor_payloads(body["serialized_named_tensors"])[0]
seen = []

class Probe(SafeUnpickler):  # SGLang's allowlist decides; the handles themselves are not opened
    def find_class(self, module, name):
        super().find_class(module, name)
        seen.append(f"{module}.{name}")
        return lambda *a, **k: None

Probe(io.BytesIO(raw)).load()
print(json.dumps(sorted(set(seen))))
"""


@pytest.mark.sglang
def test_cuda_format_body_passes_sglang_request_type_and_unpickler() -> None:
    venv = Path(os.environ.get("SGLANG_VENV", REPO / ".venv-sglang"))
    python = venv / "bin" / "python"
    require(python.exists(), f"SGLang venv at {venv} (make it with scripts/test_sglang.sh --install-only)")
    proc = subprocess.run(
        [str(python), "-c", SGLANG_CHECK, str(REPO)],
        check=False,
        input=json.dumps(cuda_format_payload()),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "torch.multiprocessing.reductions.rebuild_cuda_tensor" in seen, seen


# ---------------------------------------------------------------- CUDA IPC (gpu tier)
@pytest.mark.gpu
def test_cuda_ipc_publish_to_an_engine_on_this_gpu(tmp_path: Path) -> None:
    with gpu_engine(tmp_path) as rec:

        async def main() -> None:
            w = [(n, t.to("cuda")) for n, t in weights(7)]
            # Buckets (the path real SGLang gets; our engines take direct writes, test_sync_direct.py).
            sync = ColocatedSync(
                ColocatedSpec(bucket_bytes=1 << 18, rollout_dtype=torch.bfloat16, timeout_s=60, direct=False)
            )
            async with Router.from_urls([rec.url], RouterConfig(health_interval_s=60), connect_retries=0) as router:
                report = await Publisher(sync, router, pause_mode="in_place").publish(lambda: iter(w), "7")
                assert report.engines == 1 and report.tensors == len(w) and our_segments() == []
                got = await engine_sums(router.clients[0])
                assert {n: got[n] for n, _ in w} == {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in w}
                # Already in the rollout dtype (copied into the bucket's flat buffer all the same).
                w16 = [(n, t.to(torch.bfloat16)) for n, t in weights(8)]
                await Publisher(sync, router, pause_mode="in_place").publish(lambda: iter(w16), "8")
                got = await engine_sums(router.clients[0])
                assert {n: got[n] for n, _ in w16} == {n: tensor_checksum(t) for n, t in w16}

        asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.gpu
def test_cuda_bucket_is_one_allocation_of_views() -> None:
    pending = [(n, t.to("cuda")) for n, t in weights(3)] + [("empty", torch.zeros(0, 4, device="cuda"))]
    bucket = colocated.stage_bucket(pending, torch.bfloat16)
    try:
        bases = {t.untyped_storage().data_ptr() for _, t in bucket.items if isinstance(t, torch.Tensor)}
        assert len(bases) == 1 and bucket.cuda  # one IPC handle for the whole bucket
        for (name, t), (_, sent) in zip(pending, bucket.sent):
            assert sent.dtype == torch.bfloat16 and torch.equal(sent, t.to(torch.bfloat16)), name
            assert sent.data_ptr() % 64 == 0
    finally:
        bucket.release()
