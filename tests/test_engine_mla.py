"""The engine serves the MLA families (DeepSeek-V3, and the DSA families GLM-5 `glm_moe_dsa`, DeepSeek-V3.2
`deepseek_v32`) from a latent cache (engine/latent_cache.py, engine/latent_attention.py): greedy tokens equal a
full-recompute loop over `load_pretrained` and log-probs agree to 1e-4 (fp32) with batched, chunked and staggered
requests, prefix-cache hits, retraction, pause modes and weight updates by HF name; the cache holds the latent (and
the DSA indexer keys), which is what its bytes per token say, checked on the real tensors."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from test_engine_mla_support import (
    ARCHS,
    DSA_ARCHS,
    check_greedy,
    drain,
    greedy_req,
    make_mla_ckpt,
    prompts,
    submit,
    teacher_forced,
)

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.latent_cache import LatentCache
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import CausalLM, iter_hf_tensors, load_pretrained
from miles_hpc.sync.wire.checksum import tensor_checksum


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mla_ckpt(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> CausalLM:
    return load_pretrained(ckpt)


def _capture_latents(model: CausalLM, tokens: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Per layer, the plain model's normed latent [T, kv_lora_rank] and (DSA) its indexer keys [T, D]."""
    latents: dict[int, torch.Tensor] = {}
    index: dict[int, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
            att = layer.self_attn
            hook = att.kv_a_layernorm.register_forward_hook(lambda _m, _a, out, i=i: latents.__setitem__(i, out[0]))
            stack.callback(hook.remove)
            if hasattr(att, "indexer"):  # project() is no forward: spy on it
                real = att.indexer.project

                def spy(*args: torch.Tensor, i: int = i, real: Any = real) -> Any:
                    out = real(*args)
                    index[i] = out[1][0]
                    return out

                stack.enter_context(mock.patch.object(att.indexer, "project", spy))
        with torch.no_grad():
            model(torch.tensor([tokens]))
    return latents, index


def test_cache_holds_the_latent_and_its_bytes_per_token(ckpt: Path, plain: CausalLM) -> None:
    mc = plain.config
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=64))
    cache = engine.cache
    assert isinstance(cache, LatentCache)
    layers, heads, elem = mc.num_hidden_layers, mc.num_attention_heads, 4  # fp32
    full = [i for i in range(layers) if mc.indexer_full(i)]
    assert cache.latent.shape[::3] == (layers, mc.kv_lora_rank) and cache.k_rot.shape[-1] == mc.head_dim
    assert cache.index_k.shape[0] == len(full) and (not full or cache.index_k.shape[-1] == mc.index_head_dim)
    routing = 4 * plain.num_moe_layers * plain.top_k
    latent = layers * (mc.kv_lora_rank + mc.head_dim) * elem + len(full) * mc.index_head_dim * elem
    expanded = layers * heads * (mc.qk_head_dim + mc.v_head_dim) * elem
    assert cache.bytes_per_token() == latent + routing  # from the tensors the cache allocated
    info = engine.server_info()
    assert info["kv_cache_form"] == "latent" and info["kv_cache_bytes_per_token"] == latent + routing
    assert info["kv_cache_expanded_bytes_per_token"] == expanded + routing
    assert expanded > latent  # the real models': 52-69x (docs/engine.md, test_engine_dsa.py)
    # The cache holds exactly what the model hands kv_b_proj (and its indexer keys), slot by slot.
    (p,) = prompts([21], seed=9)
    submit(engine, {}, greedy_req("a", p, 4))
    engine.step()  # the whole prompt in one chunk
    r = engine.scheduler.running[0]
    pos = torch.arange(len(p))
    slots = torch.tensor(r.blocks)[pos // 4] * 4 + pos % 4
    ref_latent, ref_index = _capture_latents(plain, p)
    for i in range(layers):
        lat, kr = cache.flat(i)
        torch.testing.assert_close(lat[slots], ref_latent[i], rtol=0, atol=1e-6)
        if i in full:
            torch.testing.assert_close(cache.index_flat(i)[slots], ref_index[i], rtol=0, atol=1e-6)
    assert set(ref_index) == set(full) and bool(full) == (mc.model_type in DSA_ARCHS)
    bf16 = Engine.from_pretrained(str(ckpt), EngineConfig(dtype="bfloat16", num_blocks=8))
    assert bf16.cache.bytes_per_token() == latent // 2 + routing


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_batched_chunked_greedy_equals_full_recompute(ckpt: Path, plain: CausalLM, prefix_cache: bool) -> None:
    # Small blocks and prefill budget: prompts are chunked across steps and mixed with decode rows.
    cfg = EngineConfig(block_size=4, max_prefill_tokens=24, enable_prefix_cache=prefix_cache)
    engine = Engine.from_pretrained(str(ckpt), cfg)
    ps = prompts([3, 19, 41, 57], seed=1)
    ps.append(ps[3][:44] + [5, 6, 7])  # shares 44 tokens with request 3
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 16) for i, p in enumerate(ps)))
    drain(engine)
    check_greedy(plain, {str(i): p for i, p in enumerate(ps)}, results, 16)
    assert (results["4"].cached_tokens > 0) == prefix_cache  # admitted once request 3's first blocks were indexed
    assert engine.stats()["kv_blocks_used"] == 0


def test_staggered_requests_join_decoding_ones(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=8, max_prefill_tokens=16))
    ps = prompts([30, 5, 44, 12], seed=2)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("0", ps[0], 20))
    for _ in range(4):
        engine.step()
    submit(engine, results, greedy_req("1", ps[1], 20), greedy_req("2", ps[2], 20))
    engine.step()
    assert engine.stats()["num_running_reqs"] == 3
    for _ in range(6):
        engine.step()
    submit(engine, results, greedy_req("3", ps[3], 20))
    drain(engine)
    check_greedy(plain, {str(i): p for i, p in enumerate(ps)}, results, 20)


def test_prefix_cache_hit_serves_latents_and_input_logprobs(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=32))
    (p,) = prompts([47], seed=3)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("warm", p, 2))
    drain(engine)
    before = engine.stats()["cached_tokens_total"]
    q = p[:42] + [9, 8, 7, 6]
    submit(engine, results, greedy_req("hit", q, 14), greedy_req("lp", p, 3, return_logprob=True, logprob_start_len=30))
    drain(engine)
    assert results["hit"].cached_tokens == 40 and results["lp"].cached_tokens == 28  # whole blocks, <= owed rows
    assert engine.stats()["cached_tokens_total"] - before == 68
    check_greedy(plain, {"hit": q}, results, 14)
    got = results["lp"].input_logprobs  # of prompt tokens 30.. (30's is None, as SGLang's), after 28 cached tokens
    ref = teacher_forced(plain, p[:-1] + p[-1:], 30)
    assert got is not None and len(got) == len(p) - 30 and got[0] is None and None not in got[1:]
    assert max(abs(a - b) for a, b in zip(got[1:], ref[1:])) < 1e-4  # type: ignore[operator]


def test_retraction_recomputes_the_latents(ckpt: Path, plain: CausalLM) -> None:
    # 30 blocks of 4 tokens for 4 requests of up to 45 + 18 tokens: they cannot all grow, the newest yield.
    cfg = EngineConfig(block_size=4, num_blocks=30, max_prefill_tokens=64, enable_prefix_cache=False)
    engine = Engine.from_pretrained(str(ckpt), cfg)
    ps = prompts([20, 45, 33, 28], seed=4)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 18) for i, p in enumerate(ps)))
    drain(engine)
    assert sum(r.num_retractions for r in results.values()) > 0
    check_greedy(plain, {str(i): p for i, p in enumerate(ps)}, results, 18)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_resume(ckpt: Path, plain: CausalLM, mode: str) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    ps = prompts([38, 25], seed=5)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("0", ps[0], 16), greedy_req("1", ps[1], 16))
    for _ in range(6):
        engine.step()
    engine.pause(mode)  # type: ignore[arg-type]
    assert engine.step() is False
    if mode == "retract":
        assert engine.stats()["kv_blocks_used"] == 0
    else:
        assert engine.stats()["num_running_reqs"] == 2
    engine.resume()
    drain(engine)
    check_greedy(plain, {"0": ps[0], "1": ps[1]}, results, 16)
    assert all(results[r].num_retractions == (mode == "retract") for r in ("0", "1"))


def test_weight_update_by_hf_names_gives_the_new_models_outputs(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    ps = prompts([43, 26], seed=6)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 6) for i, p in enumerate(ps)))
    drain(engine)
    assert engine.stats()["kv_blocks_cached"] > 0
    new = load_pretrained(ckpt)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for prm in new.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=g))
    named = list(iter_hf_tensors(new))
    names = [n for n, _ in named]
    mc = plain.config
    mtp = f"model.layers.{mc.num_hidden_layers}."
    # MTP layers (the DSA presets have one): held, updated, never run.
    assert any(n.startswith(mtp) for n in names) == (mc.num_nextn_predict_layers > 0)
    assert mc.num_nextn_predict_layers > 0 or mc.model_type not in DSA_ARCHS
    assert any(".self_attn.indexer." in n for n in names) == (mc.model_type in DSA_ARCHS)
    assert engine.update_weights(iter(named), version="v1") == names
    assert engine.stats()["kv_blocks_cached"] == 0
    assert engine.checksums() == {n: tensor_checksum(t) for n, t in named}
    results.clear()
    submit(engine, results, *(greedy_req(str(i), p, 12) for i, p in enumerate(ps)))
    drain(engine)
    check_greedy(new, {str(i): p for i, p in enumerate(ps)}, results, 12)
    assert results["0"].cached_tokens == 0 and results["0"].weight_version == "v1"
    engine.update_weights_from_disk(str(ckpt), version="v0")  # the whole checkpoint back, MTP layers included
    assert engine.checksums() == {n: tensor_checksum(t) for n, t in iter_hf_tensors(plain)}
