"""DeepSeek sparse attention in the engine (engine/latent_attention.py): the engine's indexer scores each query
against its sequence's cached + new indexer keys and attends only the top-k, and that matters at these lengths
(dense attention gives other log-probs); GLM-5.2's shared layers reuse the selection of the full layer before
them; zero-KL mode is refused at start-up; LoRA adapters on MLA projections work, on kv_b_proj they are refused;
the bytes per token of the real models; one HTTP round through `miles-hpc serve`. The tiny presets' tie problem
(models/dsa.py, "Known gap") is pinned as a known gap."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from server_fixtures import call, generate, reference_logprobs, running_server
from test_engine_mla_support import (
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
from miles_hpc.engine.core import Engine, RequestError
from miles_hpc.engine.latent_attention import LatentAttention
from miles_hpc.engine.latent_cache import geometry
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import CausalLM, ModelConfig, build_model, load_pretrained
from miles_hpc.models.lora import LoraAdapter, LoraSpec, merge_into, save_adapter
from miles_hpc.models.presets import preset_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=DSA_ARCHS)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mla_ckpt(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> CausalLM:
    return load_pretrained(ckpt)


def test_the_engine_attends_only_the_selected_keys_and_that_matters(ckpt: Path, plain: CausalLM) -> None:
    topk = plain.config.index_topk
    dense = copy.deepcopy(plain)
    for m in dense.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = 10**6  # every query selects every earlier key: dense attention
    (p,) = prompts([52], seed=10)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=20))
    widths: list[tuple[int, int]] = []  # (keys scored, keys selected) per selection row group
    real = LatentAttention.dsa_select

    def spy(self: LatentAttention, *args: Any, **kw: Any) -> Any:
        out = real(self, *args, **kw)
        widths.extend((self.meta.context_lens.max().item(), s.shape[-1]) for s in out)
        return out

    results: dict[str, GenerateResult] = {}
    with mock.patch.object(LatentAttention, "dsa_select", spy):
        submit(engine, results, greedy_req("a", p, 16))
        drain(engine)
    check_greedy(plain, {"a": p}, results, 16)
    assert max(w for _, w in widths) == topk and max(c for c, _ in widths) == len(p) + 15
    tokens = p + results["a"].output_ids
    sparse_lps = teacher_forced(plain, tokens, len(p))
    dense_lps = teacher_forced(dense, tokens, len(p))
    assert max(abs(a - b) for a, b in zip(results["a"].output_logprobs, sparse_lps)) < 1e-4
    assert max(abs(a - b) for a, b in zip(sparse_lps, dense_lps)) > 1e-2  # the test could tell dense from sparse


def test_shared_layers_reuse_the_last_full_layers_selection(ckpt: Path, plain: CausalLM) -> None:
    mc = plain.config
    seen: list[tuple[int, Any]] = []  # (layer, the selection it attended with)
    real = LatentAttention.mla_attention

    def spy(self: LatentAttention, *args: Any, layer_idx: int, selection: Any, **kw: Any) -> Any:
        seen.append((layer_idx, selection))
        return real(self, *args, layer_idx=layer_idx, selection=selection, **kw)

    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    with mock.patch.object(LatentAttention, "mla_attention", spy):
        submit(engine, {}, greedy_req("a", prompts([30])[0], 2))
        engine.step()
    layers = [i for i, _ in seen]
    assert layers == list(range(mc.num_hidden_layers))  # MTP layers never run
    full = [mc.indexer_full(i) for i in layers]
    for i, (_, sel) in enumerate(seen):
        assert isinstance(sel, list) and sel
        if full[i]:
            assert all(sel is not s for _, s in seen[:i])  # its own, new selection
        else:  # the selection of the last full layer before it
            last = max(j for j in range(i) if full[j])
            assert sel is seen[last][1]
    assert (not all(full)) == (mc.model_type == "glm_moe_dsa")


def test_zero_kl_mode_is_refused_at_start_up(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="batch_invariant .*zero-KL.* not available for"):
        Engine.from_pretrained(str(ckpt), EngineConfig(batch_invariant=True))
    with pytest.raises(ValueError, match="DeepSeek sparse attention"):
        Engine(load_pretrained(ckpt), EngineConfig(batch_invariant=True))


def test_lora_on_mla_projections_and_kv_b_proj_refused(ckpt: Path, plain: CausalLM, tmp_path: Path) -> None:
    spec = LoraSpec(rank=4, alpha=8, target_modules=("q_b_proj", "kv_a_proj_with_mqa", "o_proj"))
    adapter = LoraAdapter.for_model(plain, spec)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for prm in adapter.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
    merged = copy.deepcopy(plain)
    merge_into(merged, adapter)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=24))
    engine.load_lora_adapter("a", str(save_adapter(tmp_path / "a", adapter)))
    ps = prompts([41, 33], seed=12)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("lora", ps[0], 10, lora_path="a"), greedy_req("base", ps[1], 10))
    drain(engine)
    check_greedy(merged, {"lora": ps[0]}, results, 10)
    check_greedy(plain, {"base": ps[1]}, results, 10)
    bad = LoraAdapter.for_model(plain, LoraSpec(rank=4, alpha=8, target_modules=("kv_b_proj",)))
    with pytest.raises(RequestError, match="kv_b_proj on latents read from its cache"):
        engine.load_lora_adapter("b", str(save_adapter(tmp_path / "b", bad)))


def test_bytes_per_token_of_the_real_models() -> None:
    """GLM-5.2 (configs/models/glm52.json) in bf16: 78 layers x (512 + 64) latent values + 21 indexer layers x 128,
    against 78 x 64 heads x (256 + 256) expanded; plus 75 MoE layers x 8 int32 expert ids (docs/engine.md)."""
    mc = ModelConfig.from_hf_dict(json.loads((REPO / "configs/models/glm52.json").read_text()))
    g = geometry(mc, torch.bfloat16, len(mc.moe_layer_ids()) * mc.num_experts_per_tok)
    assert (g.latent_values, g.index_values, g.index_layers, g.routing_bytes) == (576, 128, 21, 2400)
    assert g.bytes_per_token == 78 * 576 * 2 + 21 * 128 * 2 + 2400 == 97_632
    assert g.expanded_bytes_per_token == 78 * 64 * 512 * 2 + 2400 == 5_114_208


def _teacher_forced_gap(index_n_heads: int) -> float:
    """Largest change of the plain model's log-probs of the same 10 tokens when 20 more tokens follow them."""
    hf = preset_config("glm_moe_dsa", "tiny")
    hf.update(initializer_range=0.2, tie_word_embeddings=False, index_n_heads=index_n_heads)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf_dict(hf)).eval()
    tokens = prompts([60], seed=0)[0]
    short = teacher_forced(model, tokens[:40], 30)
    long = teacher_forced(model, tokens, 30)[:10]
    return max(abs(a - b) for a, b in zip(short, long))


def test_tiny_preset_is_prefix_consistent() -> None:
    """The preset's 16 indexer heads leave no exact score ties here: a token's log-prob does not depend on what
    follows it (what the engine's token-by-token view needs to equal the trainer's forward)."""
    assert _teacher_forced_gap(16) < 1e-4


@pytest.mark.xfail(
    strict=True, reason="known gap (docs/models.md): torch.topk's tie-breaking depends on the row length"
)
def test_known_gap_few_indexer_heads_are_not_prefix_consistent_under_ties() -> None:
    """With 2 indexer heads, exact score ties make the plain model's log-probs of the same tokens depend on how many
    tokens follow them; a length-independent tie rule would make this pass."""
    assert _teacher_forced_gap(2) < 1e-4


@pytest.mark.process
def test_http_generate_and_server_info_through_miles_hpc_serve(tmp_path: Path) -> None:
    model_dir = make_mla_ckpt(tmp_path / "glm", "glm_moe_dsa")
    ps = prompts([44, 23, 31], seed=13)
    with running_server(model_dir, tmp_path / "srv") as server:
        out = generate(server.url, ps, 14, sampling={"ignore_eos": True}, return_logprob=True)
        info = call("GET", f"{server.url}/get_server_info").body
    assert info["kv_cache_form"] == "latent" and info["model_type"] == "glm_moe_dsa"
    assert info["kv_cache_bytes_per_token"] < info["kv_cache_expanded_bytes_per_token"]
    model = load_pretrained(model_dir)
    for p, o in zip(ps, out):
        ids = o["output_ids"]
        lps = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        assert len(ids) == 14
        assert max(abs(a - b) for a, b in zip(lps, reference_logprobs(model_dir, p, ids))) < 1e-4
        with torch.no_grad():
            logits = model(torch.tensor([p + ids]))[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == ids  # greedy under the model's own (teacher-forced) view
    refused = _serve_exit(model_dir, tmp_path, "--batch-invariant")
    assert refused[0] == 2 and "zero-KL" in refused[1], refused


def _serve_exit(model_dir: Path, tmp_path: Path, *args: str) -> tuple[int, str]:
    """Exit code and stderr tail of a `miles-hpc serve` that is expected to refuse to start."""
    done = subprocess.run(
        [sys.executable, "-m", "miles_hpc.cli", "serve", str(model_dir), "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    return done.returncode, done.stderr[-2000:]


def test_prefill_scores_in_query_chunks_with_the_same_result(
    ckpt: Path, plain: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine scores a prefill chunk's queries a few at a time (dsa.SCORE_ROWS: bounded float32 scores); with
    chunks of 3 rows, fresh and cached-prefix prefills give what the recompute loop gives."""
    from miles_hpc.models import dsa

    monkeypatch.setattr(dsa, "SCORE_ROWS", 3)
    ps = dict(zip("ab", prompts([41, 29], seed=21)))
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=16))
    results: dict[str, GenerateResult] = {}
    for rid, p in ps.items():
        submit(engine, results, greedy_req(rid, p, 6))
    drain(engine)
    check_greedy(plain, ps, results, 6)
