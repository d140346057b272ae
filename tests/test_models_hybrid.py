"""miles_hpc.models, the Qwen hybrids (Gated DeltaNet and gated full attention, MoE with a gated shared expert):
Qwen3-Next and Qwen3.5-MoE's text model, parity with transformers 5.24 on several tiny configs each (logits, routed
experts, gradients), checkpoints both ways, packed sequences that never share recurrent state, routing replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_moe import _hf_routes
from test_models_support import hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import ModelConfig, load_pretrained, save_pretrained

BASE: dict[str, Any] = dict(
    head_dim=8,
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)
CASES: dict[str, dict[str, Any]] = {  # name: overrides (a "qwen35" name: Qwen3.5-MoE's text model)
    "moe-every-layer": {},
    "dense": dict(num_experts=0),
    "sparse-step-2-mlp-only-tied": dict(decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=True),
    "full-first-half-rotary": dict(
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        partial_rotary_factor=0.5,
        norm_topk_prob=False,
    ),
    "one-value-head-per-key-head": dict(linear_num_value_heads=2, linear_value_head_dim=8, linear_conv_kernel_dim=2),
    "odd-rotary-dims": dict(head_dim=12),  # 3 rotary dims at 0.25 (transformers rotates 4)
    "dense-gelu": dict(hidden_act="gelu", num_experts=0),  # also after the short convolution (it was SiLU)
    "qwen35": {},
    "qwen35-relu2": dict(hidden_act="relu2"),
    # Qwen's long-context edit of a Qwen3.5 config: yarn, the multimodal sections kept (plain RoPE for text).
    "qwen35-yarn-mrope": dict(
        max_position_embeddings=32,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e6,
            factor=4.0,
            original_max_position_embeddings=32,
            mrope_section=[1, 1, 0],
            mrope_interleaved=True,
            partial_rotary_factor=0.25,
        ),
    ),
    "qwen35-full-first-tied-top1": dict(
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        tie_word_embeddings=True,
        num_experts_per_tok=1,
    ),
    # Whole-head RoPE of 8 frequencies: the multimodal sections (mrope_section) are plain RoPE for text.
    "qwen35-three-value-heads-per-key-head-full-rotary": dict(
        linear_num_key_heads=1, linear_num_value_heads=3, head_dim=16, partial_rotary_factor=1.0
    ),
}


def _family(case: str) -> str:
    return "qwen3_5_moe_text" if case.startswith("qwen35") else "qwen3_next"


def _hf(case: str) -> Any:
    return hf_model(_family(case), **{**BASE, **CASES[case]})


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert cfg.is_hybrid and cfg.layer_types == tuple(hf.config.layer_types)
    assert [layer.is_linear for layer in ours.model.layers] == [t == "linear_attention" for t in cfg.layer_types]
    fused = any(n.endswith("linear_attn.in_proj_qkvz.weight") for n in ours.state_dict())
    assert cfg.model_type == _family(case) and fused == (cfg.model_type == "qwen3_next")
    ids = input_ids(seq=70)  # over one 64-token chunk of the delta rule
    with torch.no_grad():
        ref = hf(ids).logits
        logits, routed = ours(ids, return_routed_experts=True)
    # Each fp32 forward (ours and transformers') is 1e-4 to 4e-4 from its float64 forward on these cases (logits up
    # to ~7; the delta rule's triangular solve amplifies rounding): the two fp32 forwards agree within that noise.
    assert max_diff(logits, ref) < 4e-4
    if ours.num_moe_layers:
        assert torch.equal(routed.long(), _hf_routes(hf, ids))
    save_pretrained(ours, tmp_path / "ours")
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) < 1e-5
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("case", ["moe-every-layer", "dense", "qwen35"])
def test_hybrid_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    """Every parameter's gradient of a cross-entropy loss, relative to its largest entry (the gradients of these
    randomised tiny models reach ~10: fp32 noise through the delta rule's triangular solves is ~1e-5 of that)."""
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ids, targets = input_ids(seq=10), input_ids(seq=10, seed=7)
    for model, logits in ((hf, lambda m: m(ids).logits), (ours, lambda m: m(ids))):
        torch.nn.functional.cross_entropy(logits(model).flatten(0, 1), targets.flatten()).backward()
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert p.grad is not None and max_diff(mine[name].grad, p.grad) <= 2e-4 * p.grad.abs().max().item(), name


def test_packed_sequences_start_from_zero_state(tmp_path: Path) -> None:
    """Sequences packed into one row (cu_seqlens) give each sequence's own logits: no DeltaNet state or
    convolution input crosses a boundary; R3 replaying a forward's own routes reproduces it."""
    hf = hf_model("qwen3_next", **BASE)
    hf.save_pretrained(tmp_path / "hf")
    check_packed_sequences(load_pretrained(tmp_path / "hf"), tol=1e-4)


def check_packed_sequences(ours: Any, tol: float) -> None:
    """Three sequences (9, 1 and 30 tokens) packed into one row: each gives its own logits (within ``tol``), other
    tokens in the first leave the others' alone, and R3 replaying the packed forward's routes reproduces it."""
    seqs = [input_ids(batch=1, seq=n, seed=s) for n, s in ((9, 1), (1, 2), (30, 3))]
    row = torch.cat(seqs, dim=1)
    cu = torch.tensor([0, 9, 10, 40])
    with torch.no_grad():
        packed, routed = ours(row, cu_seqlens=cu, return_routed_experts=True)
        for seq, start in zip(seqs, (0, 9, 10), strict=True):
            assert max_diff(packed[:, start : start + seq.shape[1]], ours(seq)) < tol
        # Other tokens in the first sequence: the last sequence's logits do not move (a leak would move them).
        changed = ours(torch.cat([(seqs[0] + 5) % 97, *seqs[1:]], dim=1), cu_seqlens=cu)
        assert max_diff(changed[:, 10:], packed[:, 10:]) < tol < 1e-2 < max_diff(changed[:, :9], packed[:, :9])
        replayed = ours(row, cu_seqlens=cu, routing_replay=routed)
    assert max_diff(replayed, packed) == 0.0
    stats = ours.replay_stats()
    assert stats[0] == stats[1] == stats[2] == 40 * ours.num_moe_layers


def test_hybrid_fields_are_checked() -> None:
    hf_cfg = hf_model("qwen3_next", **BASE).config.to_dict()
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        ModelConfig.from_hf_dict({**hf_cfg, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ValueError, match="unknown entries"):
        ModelConfig.from_hf_dict({**hf_cfg, "layer_types": ["linear_attention", "sliding", "x", "full_attention"]})
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        ModelConfig.from_hf_dict({**hf_cfg, "linear_num_value_heads": 3})
    dense = ModelConfig.from_hf_dict(hf_model("qwen3", head_dim=8).config.to_dict())
    with pytest.raises(ValueError, match="hybrid fields"):
        dense.replace(layer_types=("full_attention", "full_attention"))


def test_megatron_says_it_maps_no_hybrid() -> None:
    """megatron-core's GatedDeltaNet and Mamba layers need CUDA-only kernels (docs/models.md): no mapping for the
    family, refused by name (the engine's refusals: test_engine_hybrid.py; the planner counts hybrids:
    test_plan_estimate.py)."""
    from miles_hpc.planner.mcore_layout import mcore_rules

    mc = ModelConfig.from_hf_dict(hf_model("qwen3_next", **BASE).config.to_dict())
    with pytest.raises(NotImplementedError, match="'qwen3_next' is not mapped yet"):
        mcore_rules(mc)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_tiny_presets_have_every_layer_kind_and_load_in_transformers(arch: str, tmp_path: Path) -> None:
    """`init-model --arch qwen3_next|qwen3_5_moe_text --size tiny`: DeltaNet and full-attention layers, MoE with a
    shared expert (and Qwen3-Next's dense first layer); zero-centred norms start at 0; transformers loads the
    checkpoint with no missing key and computes our logits."""
    from miles_hpc.models.presets import init_model

    path = init_model(arch, "tiny", tmp_path / arch, seed=3)
    ours = load_pretrained(path)
    cfg = ours.config
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    kinds = {type(layer.mlp).__name__ for layer in ours.model.layers}
    assert kinds == ({"SwiGLUMLP", "SharedExpertMoeBlock"} if arch == "qwen3_next" else {"SharedExpertMoeBlock"})
    norms = [p.detach() for n, p in ours.named_parameters() if n.endswith("layernorm.weight")]
    assert norms and all(not p.any() for p in norms)
    ids = input_ids(seq=20) % cfg.vocab_size
    with torch.no_grad():
        logits = ours(ids)
        assert torch.isfinite(logits).all()
        assert max_diff(hf_load(path)(ids).logits, logits) < 1e-4
