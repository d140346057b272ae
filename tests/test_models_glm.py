"""miles_hpc.models, GLM-4.5 MoE (`glm4_moe`): GQA attention with q/k/v bias, optional QK-norm and partial rotary
embedding, DeepSeek-V3's sigmoid group-limited router with shared experts, first-k dense layers. Parity with
transformers 5.24 on tiny random configs, router choices, checkpoints both ways, gradients, the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_deepseek import hf_routes
from test_models_support import assert_grads_match, hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import load_pretrained, save_pretrained

BASE: dict[str, Any] = dict(
    num_hidden_layers=3,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    moe_intermediate_size=16,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    attention_bias=True,
)
CASES: dict[str, dict[str, Any]] = {
    "glm-4.5-like": dict(use_qk_norm=True),  # partial rotary 0.5 (transformers' default), QK-norm
    "air-like-no-qk-norm-tied": dict(use_qk_norm=False, tie_word_embeddings=True, n_group=1),
    "full-rotary-two-dense": dict(
        partial_rotary_factor=1.0, num_hidden_layers=4, first_k_dense_replace=2, attention_bias=False
    ),
    "no-shared-expert": dict(n_shared_experts=0),  # transformers' zero-width shared expert: no output
    "odd-rotary-dims": dict(head_dim=6),  # 3 rotary dims at 0.5: frequencies over 3, 4 dims rotated
}


def glm(case: str, seed: int = 0) -> Any:
    hf = hf_model("glm4_moe", seed, **{**BASE, **CASES[case]})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    hf = glm(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    spec = BASE | CASES[case]
    assert cfg.model_type == "glm4_moe" and cfg.qkv_bias == spec["attention_bias"] and not cfg.o_bias
    assert cfg.rotary_dim == int(cfg.head_dim * spec.get("partial_rotary_factor", 0.5)) < cfg.head_dim + 1
    assert cfg.qk_norm == spec.get("use_qk_norm", False)
    assert ours.moe_layer_ids == tuple(range(spec["first_k_dense_replace"], spec["num_hidden_layers"]))
    ids = input_ids(seq=13)
    with torch.no_grad():
        ref = hf(ids).logits
        logits, routed = ours(ids, return_routed_experts=True)
    assert max_diff(logits, ref) < 1e-4
    assert torch.equal(routed.long().sort(dim=-1).values, hf_routes(hf, ids))
    save_pretrained(ours, tmp_path / "ours")
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) < 1e-5


def test_gradients_match_transformers(tmp_path: Path) -> None:
    hf = glm("glm-4.5-like")
    hf.save_pretrained(tmp_path)
    assert_grads_match(hf, load_pretrained(tmp_path).train())


def test_partial_rotary_factor_in_the_rope_dict_wins_over_the_top_level_key(tmp_path: Path) -> None:
    """A config.json with the factor both in rope_parameters and at the top level: transformers keeps the rope
    dict's value (the top-level key only fills it in when missing), and so do we."""
    import json

    from transformers import AutoConfig

    from miles_hpc.models import ModelConfig

    hf_model("glm4_moe", head_dim=16, partial_rotary_factor=0.5).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["partial_rotary_factor"] = 0.25
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters["partial_rotary_factor"] == 0.5
    assert ModelConfig.from_hf_dict(raw).partial_rotary_factor == 0.5
