"""A MoE engine (tiny qwen3_moe, float64 so router ties cannot flip) over real HTTP: routed experts as SGLang
returns them (base64 int32 [prompt + completion - 1 - start, moe_layers, top_k]) equal the reference model's
routing, and per-expert HF tensor names update the fused expert weights."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save
from server_fixtures import Server, call, generate, make_model, running_server

from miles_hpc.models import load_pretrained
from miles_hpc.sync.wire.checksum import tensor_checksum

pytestmark = pytest.mark.process

PROMPT = [10, 20, 30, 40, 50, 60, 70]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "moe", "qwen3_moe")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(model, tmp_path_factory.mktemp("srv"), "--dtype", "float64") as s:
        yield s


def reference_routing(model_dir: Path, tokens: list[int]) -> np.ndarray:
    ref = load_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        _, routed = ref(torch.tensor([tokens]), return_routed_experts=True)
    return routed[0].numpy().astype(np.int32)  # [T, moe_layers, top_k]


@pytest.mark.parametrize("start", [0, 3])
def test_routed_experts(server: Server, model: Path, start: int) -> None:
    info = call("GET", server.url + "/get_model_info").body
    layers, top_k = info["num_moe_layers"], info["top_k"]
    assert (layers, top_k) == (2, 2)
    out = generate(
        server.url, PROMPT, 6, return_routed_experts=True, routed_experts_start_len=start, sampling={"ignore_eos": True}
    )
    meta = out["meta_info"]
    total = meta["prompt_tokens"] + meta["completion_tokens"]
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    assert rows.size == (total - 1 - start) * layers * top_k
    rows = rows.reshape(total - 1 - start, layers, top_k)
    ref = reference_routing(model, PROMPT + out["output_ids"])[start : total - 1]
    assert np.array_equal(np.sort(rows, axis=-1), np.sort(ref, axis=-1))


def test_batched_routed_experts_and_none_when_not_asked(server: Server) -> None:
    outs = generate(server.url, [PROMPT, PROMPT[:2]], 3, return_routed_experts=True)
    for o, p in zip(outs, [PROMPT, PROMPT[:2]]):
        n = len(base64.b64decode(o["meta_info"]["routed_experts"])) // 4
        assert n == (len(p) + 3 - 1) * 2 * 2
    assert "routed_experts" not in generate(server.url, PROMPT, 2)["meta_info"]


def test_per_expert_names_update_the_fused_experts(server: Server) -> None:
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    before = call("POST", server.url + "/weights_checker", {}).body["checksums"]
    assert name in before and "model.layers.1.mlp.experts.gate_up_proj" not in before  # Hub names, as HF writes
    new = torch.full((48, 64), 0.01, dtype=torch.float64)
    blob = base64.b64encode(save({name: new})).decode()
    r = call("POST", server.url + "/update_weights_from_tensor", {"serialized_named_tensors": [blob]})
    assert r.status == 200, r.text
    after = call("POST", server.url + "/weights_checker", {}).body["checksums"]
    assert after[name] == tensor_checksum(new) and {n for n in after if after[n] != before[n]} == {name}
