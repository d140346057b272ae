"""LoRA adapters in the embedded engine (engine/lora.py): a request that names an adapter generates what the merged
model generates, in the same batch as base-model requests; the base weights never change; the prefix cache keeps
adapters apart; loading, unloading and errors through the engine and through HTTP (SGLang's endpoints)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch
from engine_support import make_ckpt
from server_fixtures import running_server
from test_engine_core import LP_TOL, drain, greedy_req, plain_greedy, submit

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine, RequestError
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import CausalLM, load_pretrained
from miles_hpc.models.lora import LoraAdapter, LoraSpec, load_adapter, merge_into, save_adapter
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.errors import EngineHTTPError
from miles_hpc.sync.wire.checksum import tensor_checksums

SPEC = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("lora_ckpt"), "qwen3", seed=3)


def make_adapter(ckpt: Path, out: Path, seed: int, spec: LoraSpec = SPEC) -> tuple[Path, CausalLM]:
    """A random adapter written as PEFT files, and the base model with it merged (the reference)."""
    base = load_pretrained(ckpt)
    adapter = LoraAdapter.for_model(base, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    merged = copy.deepcopy(base)
    merge_into(merged, adapter)
    return save_adapter(out, adapter), merged


def prompts(n: int, length: int = 21) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 300, (length + i,), generator=g).tolist() for i in range(n)]


def test_adapter_requests_equal_the_merged_model_beside_base_requests(ckpt: Path, tmp_path: Path) -> None:
    path_a, merged_a = make_adapter(ckpt, tmp_path / "a", seed=1)
    path_b, merged_b = make_adapter(ckpt, tmp_path / "b", seed=2)
    base = load_pretrained(ckpt)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=40))
    before = engine.checksums()
    engine.load_lora_adapter("a", str(path_a))
    engine.load_lora_adapter("b", str(path_b))
    ps = prompts(6)
    which = [None, "a", "b", "a", None, "b"]
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 8, lora_path=w) for i, (p, w) in enumerate(zip(ps, which))))
    drain(engine, results)
    refs = {None: base, "a": merged_a, "b": merged_b}
    outputs = set()
    for i, (p, w) in enumerate(zip(ps, which)):
        ids, lps = plain_greedy(refs[w], p, 8)
        assert results[str(i)].output_ids == ids, (i, w)
        assert max(abs(x - y) for x, y in zip(results[str(i)].output_logprobs, lps)) < LP_TOL
        outputs.add((w, tuple(ids)))
    assert len({ids for w, ids in outputs if w == "a"} & {ids for w, ids in outputs if w is None}) == 0
    assert engine.checksums() == before  # the base weights never move
    _, files = load_adapter(path_a)  # what the engine holds is what the files hold (fp32 engine here)
    assert engine.lora_checksums("a") == tensor_checksums(files.items()) and len(files) == 2 * 5 * 2  # A, B x 5 x 2
    assert engine.stats()["kv_blocks_used"] == 0


def test_prefix_cache_keeps_adapters_apart(ckpt: Path, tmp_path: Path) -> None:
    path_a, merged_a = make_adapter(ckpt, tmp_path / "a", seed=1)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    engine.load_lora_adapter("a", str(path_a))
    p = prompts(1, length=30)[0]
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("base", p, 4))
    drain(engine, results)
    submit(engine, results, greedy_req("lora", p, 4, lora_path="a"), greedy_req("base2", p, 4))
    drain(engine, results)
    assert results["lora"].cached_tokens == 0  # the base request's blocks are not the adapter's
    assert results["base2"].cached_tokens == 28
    assert results["lora"].output_ids == plain_greedy(merged_a, p, 4)[0]
    submit(engine, results, greedy_req("lora2", p, 4, lora_path="a"))
    drain(engine, results)
    assert results["lora2"].cached_tokens == 28 and results["lora2"].output_ids == results["lora"].output_ids


def test_unknown_replaced_and_unloaded_adapters(ckpt: Path, tmp_path: Path) -> None:
    path_a, _ = make_adapter(ckpt, tmp_path / "a", seed=1)
    path_b, merged_b = make_adapter(ckpt, tmp_path / "b", seed=2)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    with pytest.raises(RequestError, match="LoRA adapter 'a' is not loaded"):
        engine.submit(greedy_req("x", [5, 6, 7], 2, lora_path="a"), lambda r: None)
    with pytest.raises(RequestError, match="cannot load LoRA adapter 'z'.*adapter_config.json"):
        engine.load_lora_adapter("z", str(tmp_path))
    engine.load_lora_adapter("a", str(path_a))
    results: dict[str, GenerateResult] = {}
    p = prompts(1)[0]
    submit(engine, results, greedy_req("r", p, 50, lora_path="a"))
    engine.step()
    with pytest.raises(RequestError, match="in use"):
        engine.unload_lora_adapter("a")
    # An adapter update as the lora sync makes it: pause, replace under the same name, continue.
    engine.pause("retract")
    engine.unload_lora_adapter("a")
    engine.load_lora_adapter("a", str(path_b))
    engine.resume()
    drain(engine, results)
    assert results["r"].finish_reason.type == "length"
    submit(engine, results, greedy_req("r2", p, 6, lora_path="a"))
    drain(engine, results)
    assert results["r2"].output_ids == plain_greedy(merged_b, p, 6)[0]  # the new adapter, no stale KV
    # Unloaded for good while a request waits: it is aborted when generation continues.
    submit(engine, results, greedy_req("r3", p, 6, lora_path="a"))
    engine.pause("in_place")
    engine.unload_lora_adapter("a")
    engine.resume()
    assert results["r3"].finish_reason.type == "abort" and "unloaded" in (results["r3"].finish_reason.message or "")


@pytest.mark.process
def test_http_endpoints(ckpt: Path, tmp_path: Path) -> None:
    path_a, merged_a = make_adapter(ckpt, tmp_path / "a", seed=1)
    p = prompts(1)[0]

    async def go(url: str) -> None:
        async with EngineClient(url) as c:
            assert await c.load_lora_adapter("a", path_a) == {"a": str(path_a)}
            sums = await c.lora_adapter_checksums("a")
            assert len(sums) == 20 and all(k.startswith("base_model.model.model.layers.") for k in sums)
            out = await c.generate(p, {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}, lora_path="a")
            assert list(out.output_ids) == plain_greedy(merged_a, p, 5)[0]
            with pytest.raises(EngineHTTPError, match="not loaded"):
                await c.generate(p, {"max_new_tokens": 2}, lora_path="nope")
            assert await c.unload_lora_adapter("a") == {}
            with pytest.raises(EngineHTTPError, match="no LoRA adapter named 'a'"):
                await c.unload_lora_adapter("a")

    with running_server(ckpt, tmp_path / "srv") as server:
        asyncio.run(go(server.url))


@pytest.mark.gpu
def test_adapter_requests_on_gpu(ckpt: Path, tmp_path: Path) -> None:
    """On a GPU with the Triton kernels and CUDA graphs on: base-model steps take the fused decode path, steps with
    an adapter the model's own forward; both give what their reference model gives (fp32)."""
    path_a, merged_a = make_adapter(ckpt, tmp_path / "a", seed=1)
    base = load_pretrained(ckpt)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(device="cuda", dtype="float32", block_size=4))
    engine.load_lora_adapter("a", str(path_a))
    ps = prompts(4)
    which = [None, "a", None, "a"]
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 8, lora_path=w) for i, (p, w) in enumerate(zip(ps, which))))
    drain(engine, results)
    for i, (p, w) in enumerate(zip(ps, which)):
        ids, lps = plain_greedy(merged_a if w else base, p, 8)
        assert results[str(i)].output_ids == ids, (i, w)
        assert max(abs(x - y) for x, y in zip(results[str(i)].output_logprobs, lps)) < 1e-3


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_adapters_on_recurrent_layers_equal_the_merged_model(arch: str, tmp_path: Path) -> None:
    """A hybrid's recurrent mixers run each group of equal-length sequences as one call (models/linear_attn.py
    `run_sequences`): an adapter on their projections must still reach its own rows. Sequences of several lengths,
    with and without the adapter, in one batch, each equal the merged model's greedy text."""
    from miles_hpc.models.lora import RECURRENT_TARGETS

    ckpt = make_ckpt(tmp_path / "ckpt", arch, seed=3)
    base = load_pretrained(ckpt)
    spec = LoraSpec(rank=4, alpha=8, target_modules=(*RECURRENT_TARGETS[arch], "o_proj"))
    path, merged = make_adapter(ckpt, tmp_path / "a", seed=1, spec=spec)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=64))
    engine.load_lora_adapter("a", str(path))
    ps = [p for p in prompts(2) for _ in range(2)]  # lengths 21, 21, 22, 22: groups of equal length
    which = ["a", None, "a", "a"]
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 4, lora_path=w) for i, (p, w) in enumerate(zip(ps, which))))
    drain(engine, results)
    for i, (p, w) in enumerate(zip(ps, which)):
        assert results[str(i)].error is None, results[str(i)].error
        ids, lps = plain_greedy(merged if w else base, p, 4)
        assert results[str(i)].output_ids == ids, (i, w)
        assert max(abs(x - y) for x, y in zip(results[str(i)].output_logprobs, lps)) < 1e-4  # the scans' order
