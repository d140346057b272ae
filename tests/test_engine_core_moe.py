"""MoE routing capture: the engine's `routed_experts` rows equal the plain model's for the same tokens, including
rows served from the prefix cache (routing is stored per cached slot) and rows recomputed after retraction; for
Qwen3-MoE and the DeepSeek-V3 family (MLA attention, whose cache holds keys and values of different widths), whose
greedy text and log-probs are also the plain model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import make_ckpt, run

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.models import CausalLM, load_pretrained


# Routers: softmax (Qwen3-MoE); sigmoid group-limited with MLA attention (DeepSeek-V3) and with GQA (GLM-4.5).
@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "glm4_moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp(request.param), request.param, 0)


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> CausalLM:
    return load_pretrained(ckpt)


def req(rid: str, prompt: list[int], n: int, start: int = 0, temperature: float = 0.0) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True, sampling_seed=5)
    return GenerateRequest(
        rid=rid, input_ids=tuple(prompt), sampling=sp, return_routed_experts=True, routed_experts_start_len=start
    )


@torch.no_grad()
def plain_routing(model: CausalLM, tokens: list[int]) -> np.ndarray:
    _, routed = model(torch.tensor([tokens[:-1]]), return_routed_experts=True)
    return routed[0].numpy()


def test_routed_experts_match_plain_model(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=16))
    g = torch.Generator().manual_seed(0)
    p = torch.randint(0, 256, (22,), generator=g).tolist()
    q = p[:17] + [7, 8, 9]
    first = run(engine, req("a", p, 6), req("b", q, 5, temperature=1.0))
    # Second round: prefix-cached prompts (rows of cached tokens come from the cache's routing store).
    second = run(engine, req("c", p, 6), req("d", q, 5, start=9, temperature=1.0))
    assert second["c"].cached_tokens == 20 and second["d"].cached_tokens == 16
    for res, prompt, start in ((first["a"], p, 0), (first["b"], q, 0), (second["c"], p, 0), (second["d"], q, 9)):
        tokens = prompt + res.output_ids
        ref = plain_routing(plain, tokens)
        got = res.routed_experts
        assert got is not None and got.dtype == np.int32
        assert got.shape == (len(tokens) - 1 - start, plain.num_moe_layers, plain.top_k)
        np.testing.assert_array_equal(got, ref[start:])
    assert second["c"].output_ids == first["a"].output_ids


def test_routed_experts_after_retraction_and_abort(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, num_blocks=9, enable_prefix_cache=False))
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 10, 9)]
    results = run(engine, *(req(str(i), p, 14) for i, p in enumerate(ps)))
    assert sum(r.num_retractions for r in results.values()) > 0
    for i, p in enumerate(ps):
        res = results[str(i)]
        np.testing.assert_array_equal(res.routed_experts, plain_routing(plain, p + res.output_ids))
    # An aborted request returns the rows it has computed.
    engine.submit(req("x", ps[0], 10), lambda r: results.__setitem__(r.rid, r))
    for _ in range(3):
        engine.step()
    engine.abort("x")
    x = results["x"]
    assert x.finish_reason.type == "abort" and x.routed_experts is not None
    assert x.routed_experts.shape[0] == len(ps[0]) + len(x.output_ids) - 1


def test_greedy_text_and_logprobs_equal_the_plain_model(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=8))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 5, 21)]  # mixed lengths, one batch
    results = run(engine, *(req(str(i), p, 7) for i, p in enumerate(prompts)))
    for i, p in enumerate(prompts):
        tokens = list(p)
        with torch.no_grad():
            for _ in range(7):
                tokens.append(int(plain(torch.tensor([tokens]))[0, -1].argmax()))
            lp = torch.log_softmax(plain(torch.tensor([tokens[:-1]]))[0].float(), dim=-1)
        res = results[str(i)]
        assert res.output_ids == tokens[len(p) :]
        ref = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(res.output_ids)]
        assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref)) < 1e-5
