"""The embedded engine on the hybrid families (issue 29): each running sequence's Gated DeltaNet or Mamba-2 state in a
slot per block-table row (engine/recurrent_state.py). Against the plain model recomputed per token: continuous batching
that mixes prefill chunks and decodes, a prompt longer than the delta rule's chunk, retraction and re-prefill,
input log-probs, a weight update, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import make_ckpt
from test_engine_core import check_greedy, drain, greedy_req, plain_input_logprobs, prompts, submit

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import CausalLM, iter_hf_tensors, load_pretrained

# fp32 log-probs, chunked and step-by-step forms of the delta rule summing in different orders (issue 29: < 1e-4).
TOL = 1e-4


# The tiny presets' recurrent state per sequence (docs/engine.md): Qwen's 3 DeltaNet layers, Nemotron-H's 2 Mamba-2.
STATE_BYTES = {"qwen3_next": 16_896, "qwen3_5_moe_text": 16_896, "nemotron_h": 11_264}


@pytest.fixture(scope="module", params=list(STATE_BYTES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # std 0.1: at the shared helper's 0.2 these 4-layer hybrids are chaotic enough that fp32 rounding alone moves
    # a log-prob by 1e-4 (measured against a float64 forward: the plain fp32 forward is off by 5e-5 too).
    return make_ckpt(tmp_path_factory.mktemp(request.param), request.param, 0, std=0.1)


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> CausalLM:
    return load_pretrained(ckpt)


def test_batched_chunked_greedy_matches_plain_model(ckpt: Path, plain: CausalLM) -> None:
    """Prompts chunked over steps (prefill budget 24) beside decodes, one of 80 tokens (over a 64-token chunk of the
    rule or scan); the prefix cache is off for hybrids, so a repeated prompt is recomputed (no state for cached KV)."""
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=24))
    ps = prompts([1, 7, 16, 33, 80])
    ps.append(list(ps[3]))
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 10) for i, p in enumerate(ps)))
    drain(engine, results)
    check_greedy(plain, ps, results, 10, TOL)
    assert results["5"].cached_tokens == 0 and results["5"].output_ids == results["3"].output_ids
    assert len({t for r in results.values() for t in r.output_ids}) > 10  # the greedy text depends on its context
    assert engine.stats()["kv_blocks_used"] == 0
    states = engine.runner.executor.states
    assert states is not None and states.bytes_per_sequence == STATE_BYTES[plain.config.model_type]
    # KV only where there is attention (the tiny presets: 1 layer of 4 or 6); the recurrent layers keep state.
    attention = [i for i, t in enumerate(plain.config.layer_types) if t == "full_attention"]
    assert list(engine.cache.row) == attention and engine.cache.k.shape[0] == len(attention) == 1


def test_retraction_recomputes_the_state(ckpt: Path, plain: CausalLM) -> None:
    cfg = EngineConfig(block_size=4, num_blocks=10, max_prefill_tokens=64)
    engine = Engine.from_pretrained(str(ckpt), cfg)
    ps = prompts([6, 12, 9, 11], seed=2)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 16) for i, p in enumerate(ps)))
    drain(engine, results)
    check_greedy(plain, ps, results, 16, TOL)
    assert sum(r.num_retractions for r in results.values()) > 0


def test_input_logprobs_and_a_weight_update(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=8))
    (p,) = prompts([30], seed=3)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("a", p, 4, return_logprob=True, logprob_start_len=0))
    drain(engine, results)
    got = results["a"].input_logprobs
    assert got is not None and got[0] is None
    want = plain_input_logprobs(plain, p)
    assert max(abs(a - b) for a, b in zip(got[1:], want, strict=True)) < TOL
    # New weights (every recurrent layer's parameters among them): the engine then answers what the updated model does.
    other = load_pretrained(ckpt)
    with torch.no_grad():
        for prm in other.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    engine.update_weights(list(iter_hf_tensors(other)), version="2")
    results = {}
    submit(engine, results, greedy_req("0", p, 6))
    drain(engine, results)
    check_greedy(other, [p], results, 6, TOL)


def test_what_a_hybrid_engine_refuses(ckpt: Path) -> None:
    for cfg in (EngineConfig(tp_size=2), EngineConfig(batch_invariant=True)):
        with pytest.raises(ValueError, match="hybrid model is served at tp_size 1 without batch_invariant"):
            Engine.from_pretrained(str(ckpt), cfg)


@pytest.mark.gpu
def test_a_gpu_engine_runs_the_scan_kernels(ckpt: Path, plain: CausalLM) -> None:
    """On a GPU the engine's prefill and decode run the recurrent layers in Triton (models/scan_kernels.py): its
    greedy tokens and log-probs, and a prompt's input log-probs, equal the plain float32 model's on the CPU (the
    torch forms) within the same 1e-4, with chunked prefill beside decodes, and every kernel ran."""
    from conftest import require
    from test_scan_kernels import counting_kernels

    require(torch.cuda.is_available(), "a CUDA device")
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(device="cuda", block_size=4, max_prefill_tokens=24))
    ps = prompts([1, 7, 16, 33, 80])
    results: dict[str, GenerateResult] = {}
    with counting_kernels() as ran:
        submit(engine, results, *(greedy_req(str(i), p, 16) for i, p in enumerate(ps)))
        submit(engine, results, greedy_req("lp", ps[4], 1, return_logprob=True, logprob_start_len=0))
        drain(engine, results)
    check_greedy(plain, ps, results, 16, TOL)
    got = results["lp"].input_logprobs
    assert got is not None and max(abs(a - b) for a, b in zip(got[1:], plain_input_logprobs(plain, ps[4]))) < TOL
    family = "ssd" if "nemotron" in str(ckpt) else "gated_delta"
    assert ran[f"{family}_recurrent_triton"] > 0 and ran[f"{family}_chunked_triton"] > 0, dict(ran)
