"""SGLang's ``flattened_bucket`` load format in the colocated sync: the trainer sends one tensor per bucket plus
metadata (sync/strategies/colocated.py), the engine opens it with a restricted unpickler (sync/wire/tensor_handles.py). On CPU the
flat tensor is one of our shared-memory slices; on a GPU a CUDA IPC handle (gpu tier)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from sync_support import bf16_fleet, engine_sums, gpu_engine, perturbed_weights, router_of
from test_client_engine import HAVE_SERVER
from test_sync_colocated import no_gpu, weights
from torch.multiprocessing import reductions

from miles_hpc.rollout import requests as rq
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies import colocated
from miles_hpc.sync.strategies.colocated import ColocatedSpec, ColocatedSync, ShmSlice, serialize_object
from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.tensor_handles import FLAT_FIELDS, TensorHandleError, load_flattened_bucket

REPO = Path(__file__).resolve().parents[1]


def meta(name: str, shape: tuple[int, ...], start: int, dtype: Any = torch.float32) -> types.SimpleNamespace:
    n = int(torch.Size(shape).numel())
    return types.SimpleNamespace(
        name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start, end_idx=start + n, numel=n
    )


def flat_payload(tensors: list[tuple[str, torch.Tensor]]) -> tuple[bytes, colocated._Bucket]:
    """Our CPU stand-in of a flattened bucket: the tensors packed into one shared-memory segment, the flat tensor
    named by its persistent id (a CUDA bucket names it by IPC handle instead)."""
    flat = torch.cat([t.reshape(-1) for _, t in tensors])
    bucket = colocated.stage_bucket([("flat", flat)], None)
    entries, o = [], 0
    for name, t in tensors:
        entries.append(meta(name, tuple(t.shape), o, t.dtype))
        o += t.numel()
    ((_, slice_),) = bucket.items
    raw = base64.b64decode(serialize_object({"flattened_tensor": slice_, "metadata": entries}, no_gpu))
    return raw, bucket


def test_reads_back_every_tensor_of_the_bucket() -> None:
    tensors = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("empty", torch.zeros(0, 2)), ("c", torch.randn(2, 2))]
    raw, bucket = flat_payload(tensors)
    try:
        out = load_flattened_bucket(raw, "cpu")
        assert [n for n, _ in out] == [n for n, _ in tensors]
        for (_, want), (_, got) in zip(tensors, out):
            assert got.shape == want.shape and torch.equal(got, want)
    finally:
        del out
        bucket.release()


def test_refuses_what_the_format_does_not_need() -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return (os.system, ("true",))

    with pytest.raises(TensorHandleError, match="refused global posix.system"):
        load_flattened_bucket(pickle.dumps({"flattened_tensor": Evil(), "metadata": []}), "cpu")

    class Namespace:  # BUILD with a field SGLang's metadata does not have
        def __reduce__(self) -> tuple[Any, ...]:
            return (types.SimpleNamespace, (), {"name": "a", "evil": "x"})

    with pytest.raises(TensorHandleError, match="BUILD may only set"):
        load_flattened_bucket(pickle.dumps([Namespace()]), "cpu")

    class BuildOnSize:  # BUILD on anything but a metadata entry (here torch.Size) is refused
        def __reduce__(self) -> tuple[Any, ...]:
            return (torch.Size, ((1, 2),), {"name": "a"})

    with pytest.raises(TensorHandleError, match="BUILD may only set.*got Size"):
        load_flattened_bucket(pickle.dumps([BuildOnSize()]), "cpu")
    with pytest.raises(TensorHandleError, match="refused pickle opcode"):
        load_flattened_bucket(pickle.dumps({1, 2}), "cpu")  # sets are not part of it
    with pytest.raises(TensorHandleError, match=r"must unpickle to \{'flattened_tensor'"):
        load_flattened_bucket(pickle.dumps({"metadata": []}), "cpu")

    tensors = [("a", torch.randn(4))]
    raw, bucket = flat_payload(tensors)
    try:
        assert bucket.segment is not None
        slice_ = ShmSlice(bucket.segment.name, 0, "float32", (4,))
        wrong_numel = meta("a", (4,), 0)
        wrong_numel.numel = 3
        no_dtype = meta("a", (4,), 0)
        del no_dtype.dtype
        for bad, match in [
            (meta("a", (5,), 0), "does not hold shape"),
            (meta("a", (2, 2), 1), "does not hold shape"),
            (wrong_numel, "does not hold shape"),
            (no_dtype, "must have exactly"),
            (meta("a", (4,), 0, torch.complex64), "refused global torch.complex64"),
            (meta("a", (4,), 0, "bfloat16"), "a weight dtype"),
        ]:
            payload = base64.b64decode(serialize_object({"flattened_tensor": slice_, "metadata": [bad]}, no_gpu))
            with pytest.raises(TensorHandleError, match=match):
                load_flattened_bucket(payload, "cpu")
    finally:
        bucket.release()
    assert set(FLAT_FIELDS) == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}


@pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built")
@pytest.mark.process
def test_a_real_engine_applies_a_flattened_bucket(tmp_path: Path) -> None:
    with bf16_fleet(tmp_path, n=1) as procs:
        named = perturbed_weights(11)  # bf16, the fleet's dtype
        raw, bucket = flat_payload(named)
        try:

            async def main() -> None:
                async with router_of(procs) as router:
                    client = router.clients[0]
                    await client.update_weights_from_tensor(
                        [base64.b64encode(raw).decode()], weight_version="11", load_format="flattened_bucket"
                    )
                    got = await engine_sums(client)
                    assert {n: got[n] for n, _ in named} == {n: tensor_checksum(t) for n, t in named}
                    assert (await client.model_info())["weight_version"] == "11"

            asyncio.run(asyncio.wait_for(main(), 120))
        finally:
            bucket.release()


def test_request_body_names_the_load_format() -> None:
    body = rq.update_weights_from_tensor_body(["QUJD"], load_format="flattened_bucket", weight_version=1)
    assert body == {"serialized_named_tensors": ["QUJD"], "load_format": "flattened_bucket", "weight_version": "1"}


# ---------------------------------------------------------------- SGLang's own code (sglang tier)
SGLANG_FLAT_CHECK = r"""
import base64, io, json, sys, torch
from torch.multiprocessing import reductions
from sglang.srt.utils.common import SafeUnpickler
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

def fake_rebuild(cls, size, stride, offset, storage_cls, dtype, *rest):  # no GPU here: a CPU tensor of that shape
    return torch.arange(int(torch.Size(size).numel())).to(dtype).view(size)

class Probe(SafeUnpickler):  # SGLang's allowlist decides every global; only the CUDA rebuild is stood in for
    def find_class(self, module, name):
        found = super().find_class(module, name)
        return fake_rebuild if found is reductions.rebuild_cuda_tensor else found

obj = Probe(io.BytesIO(base64.b64decode(sys.stdin.read()))).load()
# ModelRunner._update_weights_from_flattened_bucket: metadata read by attribute into its own class.
converted = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                     end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
out = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=converted).reconstruct_tensors()
print(json.dumps([[n, list(t.shape), str(t.dtype), t.float().sum().item()] for n, t in out]))
"""


class FakeFlat:
    """Pickles as torch's CUDA IPC reduction of a 1-D bf16 tensor of 32 elements (made-up handles)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            reductions.rebuild_cuda_tensor,
            (
                torch.Tensor,
                torch.Size([32]),
                (1,),
                0,
                torch.storage.TypedStorage,
                torch.bfloat16,
                0,
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


@pytest.mark.sglang
def test_our_flattened_payload_passes_sglangs_unpickler_and_bucket_code() -> None:
    venv = Path(os.environ.get("SGLANG_VENV", REPO / ".venv-sglang"))
    python = venv / "bin" / "python"
    require(python.exists(), f"SGLang venv at {venv} (make it with scripts/test_sglang.sh --install-only)")
    payload = serialize_object(
        {
            "flattened_tensor": FakeFlat(),
            "metadata": [meta("a", (2, 3), 0, torch.bfloat16), meta("b", (4,), 8, torch.bfloat16)],
        },
        no_gpu,
    )
    proc = subprocess.run(
        [str(python), "-c", SGLANG_FLAT_CHECK],
        input=payload,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [["a", [2, 3], "torch.bfloat16", 15.0], ["b", [4], "torch.bfloat16", 38.0]]


# ---------------------------------------------------------------- CUDA (gpu tier)
@pytest.mark.gpu
def test_flattened_cuda_publish_to_an_engine_on_this_gpu(tmp_path: Path) -> None:
    with gpu_engine(tmp_path) as rec:

        async def main() -> None:
            w = [(n, t.to("cuda")) for n, t in weights(9)]
            bucket = colocated.stage_bucket(w, torch.bfloat16)
            try:
                flat = bucket.flattened()
                assert flat is not None and flat["flattened_tensor"].dtype == torch.bfloat16
                assert [m.name for m in flat["metadata"]] == [n for n, _ in w]
            finally:
                bucket.release()
            sync = ColocatedSync(ColocatedSpec(bucket_bytes=1 << 18, rollout_dtype=torch.bfloat16, timeout_s=60))
            async with Router.from_urls([rec.url], RouterConfig(health_interval_s=60), connect_retries=0) as router:
                await Publisher(sync, router, pause_mode="in_place").publish(lambda: iter(w), "9")
                got = await engine_sums(router.clients[0])
                assert {n: got[n] for n, _ in w} == {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in w}

        asyncio.run(asyncio.wait_for(main(), 120))
