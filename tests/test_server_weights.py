"""Weight updates over real HTTP: from disk, from tensor (base64 safetensors) and from a separate trainer-side
process group over gloo (update_weights_from_distributed), each checked by /weights_checker checksums against the
sender's `tensor_checksum`s and by greedy outputs against the plain `load_pretrained` model of the new weights."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import save
from server_fixtures import Server, acall, call, generate, greedy_reference, make_model, running_server

from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.pg import CustomGroup, GroupSpec

pytestmark = pytest.mark.process

PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 17]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(root / name, "qwen3", seed) for name, seed in (("a", 0), ("b", 1), ("c", 2))}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(models["a"], tmp_path_factory.mktemp("srv")) as s:
        yield s


def hf_tensors(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """What a trainer would send: HF names, Hub layout, contiguous copies."""
    return [(n, t.detach().contiguous().clone()) for n, t in iter_hf_tensors(load_pretrained(model_dir))]


def engine_checksums(url: str) -> dict[str, str]:
    r = call("POST", url + "/weights_checker", {"action": "checksum"})
    assert r.status == 200 and r.body["success"], r.text
    rank = r.body["ranks"][0]  # SGLang's shape: one entry per TP rank
    assert rank["checksums"] == r.body["checksums"] and rank["parallelism_info"][0]["tp_size"] == 1
    assert isinstance(rank["per_gpu_checksum"], str) and isinstance(r.body["per_engine_checksum"], str)
    return r.body["checksums"]


def assert_serves(url: str, model_dir: Path, version: str) -> list[list[int]]:
    """Checksums, greedy outputs and weight_version all say the engine now serves `model_dir`'s weights."""
    assert engine_checksums(url) == {n: tensor_checksum(t) for n, t in hf_tensors(model_dir)}
    outs = []
    for p in PROMPTS:
        out = generate(url, p, 10, sampling={"ignore_eos": True})
        assert out["meta_info"]["weight_version"] == version
        assert greedy_reference(model_dir, p, out["output_ids"]) <= 1e-5
        outs.append(out["output_ids"])
    return outs


def free_port() -> int:
    from miles_hpc.launch.local import free_port as pick

    return pick()  # below the ephemeral range: no other process's connection takes it first


def test_weights_checker_shape_and_get(server: Server, models: dict[str, Path]) -> None:
    sums = engine_checksums(server.url)
    assert sums == {n: tensor_checksum(t) for n, t in hf_tensors(models["a"])}
    r = call("GET", server.url + "/weights_checker")  # GET without a body: action defaults to checksum
    assert r.status == 200 and r.body["checksums"] == sums
    r = call("POST", server.url + "/weights_checker", {"skip_tensor_list": ["mlp"]})
    assert r.body["checksums"] and not any("mlp" in n for n in r.body["checksums"])


def test_update_weights_from_disk(server: Server, models: dict[str, Path]) -> None:
    body = {"model_path": str(models["b"]), "weight_version": "disk-1"}
    r = call("POST", server.url + "/update_weights_from_disk", body)
    assert r.status == 200 and r.body == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    assert_serves(server.url, models["b"], "disk-1")
    assert call("GET", server.url + "/get_model_info").body["model_path"] == str(models["b"])
    bad = call("POST", server.url + "/update_weights_from_disk", {"model_path": "/no/such/checkpoint"})
    assert bad.status == 400 and bad.body["success"] is False and "/no/such/checkpoint" in bad.body["message"]
    assert_serves(server.url, models["b"], "disk-1")  # a failed update changed nothing


def test_update_weights_from_tensor(server: Server, models: dict[str, Path]) -> None:
    named = hf_tensors(models["a"])
    blob = base64.b64encode(save(dict(named))).decode()
    r = call(
        "POST",
        server.url + "/update_weights_from_tensor",
        {"serialized_named_tensors": [blob], "weight_version": "tensor-1", "flush_cache": True},
    )
    assert r.status == 200 and r.body == {"success": True, "message": "Succeeded to update model weights."}
    assert_serves(server.url, models["a"], "tensor-1")
    # one tensor only: exactly its checksum changes
    name, t = named[3]
    before = engine_checksums(server.url)
    one = base64.b64encode(save({name: t + 1})).decode()
    assert call("POST", server.url + "/update_weights_from_tensor", {"serialized_named_tensors": [one]}).status == 200
    after = engine_checksums(server.url)
    assert {n for n in after if after[n] != before[n]} == {name} and after[name] == tensor_checksum(t + 1)
    for body, needle in [
        ({"serialized_named_tensors": ["@@not base64@@"]}, "base64"),
        ({"serialized_named_tensors": [base64.b64encode(save({"model.nope.weight": t})).decode()]}, "model.nope"),
        ({"serialized_named_tensors": [base64.b64encode(save({name: t[:1]})).decode()]}, name),
    ]:
        r = call("POST", server.url + "/update_weights_from_tensor", body)
        assert r.status == 400 and r.body["success"] is False and needle in r.body["message"], r.text
    r = call("POST", server.url + "/update_weights_from_tensor", {"serialized_named_tensors": [one, one]})
    assert r.status == 400 and "tp_size 1" in r.body["error"]["message"]
    assert call("GET", server.url + "/health_generate").status == 200


def test_update_weights_from_distributed_over_gloo(server: Server, models: dict[str, Path]) -> None:
    """This process plays trainer rank 0: it creates the group while posting /init_weights_update_group, then
    broadcasts model c's tensors in two buckets while posting /update_weights_from_distributed for each."""
    url, port = server.url, free_port()
    named = hf_tensors(models["c"])
    before = engine_checksums(url)  # not greedy text: two tiny random models may both echo the prompt

    def bucket_body(bucket: list[tuple[str, torch.Tensor]], version: str | None) -> dict[str, object]:
        body: dict[str, object] = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": "wug",
            "flush_cache": True,
        }
        return body if version is None else {**body, "weight_version": version}

    async def send(
        s: aiohttp.ClientSession, group: CustomGroup, bucket: list[tuple[str, torch.Tensor]], body: dict[str, object]
    ) -> object:
        post = asyncio.create_task(acall(s, "POST", url + "/update_weights_from_distributed", body))
        await asyncio.to_thread(lambda: [group.broadcast(t, src=0) for _, t in bucket])
        return await post

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            spec = GroupSpec(
                backend="gloo",
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=2,
                group_name="wug",
                timeout_s=60,
            )
            join = asyncio.create_task(asyncio.to_thread(CustomGroup, spec))
            r = await acall(
                s,
                "POST",
                url + "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "wug",
                    "backend": "gloo",
                },
            )
            group = await join
            assert r.status == 200 and r.body == {
                "success": True,
                "message": "Succeeded to initialize custom process group.",
            }
            try:
                # a wrong shape fails the update, but the bucket is still received: the group stays aligned
                name, t = named[0]
                wrong = [(name, t.t().contiguous()), *named[1:2]]
                r = await send(s, group, wrong, bucket_body(wrong, None))
                assert r.status == 400 and r.body["success"] is False and name in r.body["message"], r.text
                half = len(named) // 2
                for bucket, version in ((named[:half], None), (named[half:], "dist-1")):
                    r = await send(s, group, bucket, bucket_body(bucket, version))
                    assert r.status == 200 and r.body["success"], r.text
            finally:
                group.destroy()
            r = await acall(s, "POST", url + "/destroy_weights_update_group", {"group_name": "wug"})
            assert r.status == 200 and r.body["success"]

    asyncio.run(scenario())
    assert_serves(url, models["c"], "dist-1")
    assert engine_checksums(url) != before
    r = call("POST", url + "/destroy_weights_update_group", {"group_name": "wug"})
    assert r.status == 400 and r.body == {"success": False, "message": "The group to be destroyed does not exist."}


def test_distributed_errors_answer_and_keep_serving(server: Server) -> None:
    r = call(
        "POST",
        server.url + "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2},
    )
    assert r.status == 400 and r.body["success"] is False and "gloo" in r.body["message"]  # default nccl, CPU engine
    r = call(
        "POST",
        server.url + "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
    )
    assert r.status == 400 and r.body["success"] is False and "nope" in r.body["message"]
    assert call("GET", server.url + "/health_generate").status == 200
