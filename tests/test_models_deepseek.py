"""miles_hpc.models, DeepSeek-V3 family (MLA attention, sigmoid group-limited router with correction bias, shared
experts, first-k dense layers; Kimi-K2 is this architecture): parity with transformers 5.24 on tiny random configs,
routed ids equal to transformers' router choices, checkpoints both ways, gradients, routing replay (R3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_moe import _hf_routes
from test_models_support import assert_grads_match, hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import ModelConfig, build_model, load_pretrained, save_pretrained

REPO = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    moe_intermediate_size=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
CASES: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 / Kimi-K2 layout: compressed queries, interleaved RoPE, yarn with mscale on the softmax scale.
    "q-lora-interleaved-yarn": dict(
        q_lora_rank=12,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=50000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "plain-q-halves-rope-one-group": dict(
        q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False, tie_word_embeddings=True
    ),
    "two-dense-layers-three-groups": dict(
        q_lora_rank=12,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        n_routed_experts=12,
        num_experts_per_tok=3,
        n_group=3,
        topk_group=2,
    ),
}


def deepseek(case: str, seed: int = 0) -> Any:
    hf = hf_model("deepseek_v3", seed, **{**BASE, **CASES[case]})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a non-zero correction bias, so choice and gate scores differ (HF inits it to zeros)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return hf


def hf_routes(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    """transformers' router choices per MoE layer, sorted (its top-k here is unsorted, ours need not match order)."""
    return _hf_routes(hf, ids).sort(dim=-1).values


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    hf = deepseek(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert cfg.model_type == "deepseek_v3" and cfg.is_mla and cfg.head_dim == BASE["qk_rope_head_dim"]
    assert ours.moe_layer_ids == tuple(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    ids = input_ids(seq=13)
    with torch.no_grad():
        ref = hf(ids).logits
        logits, routed = ours(ids, return_routed_experts=True)
    assert max_diff(logits, ref) < 1e-4
    assert torch.equal(routed.long().sort(dim=-1).values, hf_routes(hf, ids))  # transformers does not sort top-k
    assert len(routed.unique()) > 2

    save_pretrained(ours, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "deepseek_v3"
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) < 1e-5
        assert max_diff(load_pretrained(tmp_path / "ours")(ids), logits) == 0.0


def test_gradients_match_transformers(tmp_path: Path) -> None:
    hf = deepseek("q-lora-interleaved-yarn")
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).train()
    assert_grads_match(hf, ours)
    mine = dict(ours.named_parameters())
    # The correction bias is a frozen parameter here (a buffer in transformers): loaded and synced, never trained.
    assert set(mine) - {n for n, _ in hf.named_parameters()} == {n for n in mine if n.endswith("correction_bias")}
    assert all(not p.requires_grad for n, p in mine.items() if n.endswith("correction_bias"))


def test_routing_replay_is_exact_on_own_routes_and_trains_the_router(tmp_path: Path) -> None:
    deepseek("two-dense-layers-three-groups").save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = input_ids(seq=9)
    with torch.no_grad():
        logits, routed = ours(ids, return_routed_experts=True)
        assert torch.equal(ours(ids, routing_replay=routed), logits)
    foreign = (routed + 1) % ours.config.num_experts  # other experts than the router would pick
    out = ours(ids, routing_replay=foreign)
    assert max_diff(out, logits) > 1e-3
    out.sum().backward()
    gate = ours.model.layers[2].mlp.gate
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="expert ids outside"):
        ours(ids, routing_replay=foreign + ours.config.num_experts)


def test_kimi_k2_config_parses_with_its_real_shapes() -> None:
    cfg = ModelConfig.from_hf_dict(json.loads((REPO / "configs/models/kimi_k2.json").read_text()))
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok) == ("deepseek_v3", 384, 8)
    assert cfg.n_shared_experts == 1
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (1536, 512, 192, 128)
    assert cfg.moe_layer_ids()[0] == cfg.first_k_dense_replace == 1 and cfg.num_hidden_layers == 61
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="only the sigmoid router"):
        ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "scoring_func": "softmax"})


def test_multi_token_prediction_layers_of_a_release_load(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf = deepseek("plain-q-halves-rope-one-group")
    hf.save_pretrained(tmp_path)  # transformers writes num_nextn_predict_layers=1 but no MTP tensors
    assert load_pretrained(tmp_path).config.num_nextn_predict_layers == 0
    n = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
    mtp = load_pretrained(tmp_path).config.replace(num_nextn_predict_layers=1)
    release = tmp_path / "release"
    save_pretrained(build_model(mtp), release)
    f = release / "model.safetensors"
    tensors = load_file(str(f))
    assert f"model.layers.{n}.eh_proj.weight" in tensors and f"model.layers.{n}.shared_head.norm.weight" in tensors
    # A DeepSeek-V3 release also stores copies of the embedding and head in its MTP layer: accepted, not kept.
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})
    assert load_pretrained(release).config.num_nextn_predict_layers == 1
    del tensors[f"model.layers.{n}.hnorm.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing tensor 'model.layers.{n}.hnorm.weight'"):
        load_pretrained(release)
    tensors[f"model.layers.{n}.hnorm.weight"] = torch.ones(mtp.hidden_size)
    tensors["model.layers.0.unknown.weight"] = torch.zeros(2)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.unknown.weight'"):
        load_pretrained(release)
