"""Helpers of the latent-cache engine tests (test_engine_mla.py, test_engine_dsa.py); no tests here.

Checkpoints: the tiny presets of the MLA families with a sharper init (engine_support.make_ckpt's), and for the DSA
families 32 indexer heads (GLM-5's count) with index_topk 8. With the presets' 2 (GLM) or 4 (DeepSeek-V3.2) heads,
and still with 8, exact score ties (relu zeros in every head: 0.4% of the scores with 8 heads) fall on the top-k
boundary, and under ties the plain model is not prefix-consistent (models/dsa.py, "Known gap"): a token-by-token
recompute is then no reference any cache could equal. With 32 heads no score was exactly zero in 4 x 80 tokens
(16 heads: 1 in 40,000), and index_topk 8 against contexts of 40-75 tokens makes the sparsity matter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams
from miles_hpc.models import CausalLM, ModelConfig, build_model, save_pretrained
from miles_hpc.models.presets import init_model, preset_config

ARCHS = ("deepseek_v3", "glm_moe_dsa", "deepseek_v32")
DSA_ARCHS = ("glm_moe_dsa", "deepseek_v32")
DSA_TEST: dict[str, Any] = dict(index_n_heads=32, index_topk=8)
LP_TOL = 1e-4


def make_mla_ckpt(out: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random checkpoint of `arch` (std 0.2, untied head; DSA: DSA_TEST unless overridden)."""
    init_model(arch, "tiny", out, seed=seed)  # tokenizer + generation_config.json
    hf = preset_config(arch, "tiny")
    hf.update(initializer_range=0.2, tie_word_embeddings=False, **(DSA_TEST if arch in DSA_ARCHS else {}))
    hf.update(overrides)
    torch.manual_seed(seed)
    save_pretrained(build_model(ModelConfig.from_hf_dict(hf)), out)
    return out


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def greedy_req(rid: str, prompt: list[int], n: int, **kw: Any) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid=rid, input_ids=tuple(prompt), sampling=sp, **kw)


def submit(engine: Engine, results: dict[str, GenerateResult], *reqs: GenerateRequest) -> None:
    for r in reqs:
        engine.submit(r, lambda res: results.__setitem__(res.rid, res))


def drain(engine: Engine, max_steps: int = 5000) -> int:
    steps = 0
    while engine.step():
        steps += 1
        assert steps < max_steps
    return steps


@torch.no_grad()
def recompute_greedy(model: CausalLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The reference: a full forward over prompt + output so far for every token (no cache)."""
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1].float()
        t = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        ids.append(t)
    return ids[len(prompt) :], lps


@torch.no_grad()
def teacher_forced(model: CausalLM, tokens: list[int], start: int) -> list[float]:
    """log-probs of tokens[start:] from one forward over `tokens` (the trainer's view)."""
    lp = torch.log_softmax(model(torch.tensor([tokens[:-1]]))[0].float(), -1)
    return [float(lp[i - 1, tokens[i]]) for i in range(start, len(tokens))]


def check_greedy(model: CausalLM, ps: dict[str, list[int]], results: dict[str, GenerateResult], n: int) -> None:
    for rid, p in ps.items():
        ref, ref_lps = recompute_greedy(model, p, n)
        got = results[rid]
        assert got.output_ids == ref, f"request {rid} (prompt {len(p)} tokens)"
        worst = max(abs(a - b) for a, b in zip(got.output_logprobs, ref_lps))
        assert worst < LP_TOL, f"request {rid}: log-probs differ by {worst}"
