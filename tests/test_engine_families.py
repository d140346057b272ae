"""The embedded engine on the families that keep their own decode state (DeepSeek-V4, Inkling:
engine/family_states.py): tokens and log-probs are the model's own under continuous batching, chunked prefill and
preemption (a tiny cache), with LoRA adapters beside base-model requests, and also on the path that recomputes
each sequence every step (engine/runner.py `recomputes`, a family without `new_state`); what these engines refuse
(TP, batch-invariant mode) is refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_core import LP_TOL, drain, greedy_req, plain_greedy, submit
from test_engine_lora import make_adapter

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import load_pretrained
from miles_hpc.models.lora import DEFAULT_TARGETS, LoraSpec, family_targets
from miles_hpc.models.presets import init_model

ARCHS = ("deepseek_v4", "inkling_text")


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(request.param, "tiny", tmp_path_factory.mktemp(request.param), seed=5)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (9 + 4 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("path", ["cached", "recomputed"])
@pytest.mark.parametrize("blocks", [None, 12])  # 12 blocks of 4 tokens: sequences are preempted and resumed
def test_greedy_tokens_and_logprobs_are_the_models(ckpt: Path, blocks: int | None, path: str) -> None:
    model = load_pretrained(ckpt).eval()
    config = EngineConfig(block_size=4, max_prefill_tokens=24, num_blocks=blocks)
    engine = Engine.from_pretrained(str(ckpt), config)
    if path == "recomputed":  # the path of a family without `new_state`: every step from each sequence's start
        engine.runner.executor.family, engine.runner.executor.recompute = None, True
    results: dict[str, GenerateResult] = {}
    ps = _prompts(5)
    submit(engine, results, *(greedy_req(str(i), p, 10) for i, p in enumerate(ps)))
    drain(engine, results)
    for i, p in enumerate(ps):
        ids, lps = plain_greedy(model, p, 10)
        assert results[str(i)].output_ids == ids, i
        assert max(abs(x - y) for x, y in zip(results[str(i)].output_logprobs, lps, strict=True)) < LP_TOL
    assert engine.stats()["kv_blocks_used"] == 0
    assert (sum(results[str(i)].num_retractions for i in range(len(ps))) > 0) == (blocks is not None)


def test_adapter_requests_equal_the_merged_model(ckpt: Path, tmp_path: Path) -> None:
    """The recomputed forward applies a request's adapter on every row of its sequence, its history included."""
    base = load_pretrained(ckpt).eval()
    spec = LoraSpec(rank=4, alpha=8, target_modules=family_targets(DEFAULT_TARGETS, base.config.model_type))
    path, merged = make_adapter(ckpt, tmp_path / "a", seed=1, spec=spec)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=24))
    engine.load_lora_adapter("a", str(path))
    ps, which = _prompts(4), [None, "a", None, "a"]
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 6, lora_path=w) for i, (p, w) in enumerate(zip(ps, which))))
    drain(engine, results)
    for i, (p, w) in enumerate(zip(ps, which, strict=True)):
        ids, lps = plain_greedy(merged if w else base, p, 6)
        assert results[str(i)].output_ids == ids, (i, w)
        assert max(abs(x - y) for x, y in zip(results[str(i)].output_logprobs, lps, strict=True)) < LP_TOL


@pytest.mark.parametrize("config", [dict(tp_size=2), dict(batch_invariant=True)])
def test_what_these_engines_refuse(ckpt: Path, config: dict) -> None:
    with pytest.raises(ValueError, match="served at tp_size 1 without batch_invariant"):
        Engine.from_pretrained(str(ckpt), EngineConfig(**config))
