"""miles_hpc.models, Nemotron-H (Mamba-2, attention without RoPE, relu2 MLP and latent MoE blocks): parity with
transformers 5.24 on several tiny configs (logits, routed experts, gradients), checkpoints in the Hub's
`backbone.*` per-expert layout and in transformers' in-memory one, packed sequences that never share state, the
config's legacy spellings and its refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_models_hybrid import check_packed_sequences
from test_models_moe import _hf_routes
from test_models_support import hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import ModelConfig, load_pretrained, save_pretrained

BASE: dict[str, Any] = dict(
    num_hidden_layers=None,  # NemotronHConfig derives it from the pattern
    head_dim=8,
    mamba_num_heads=4,
    mamba_head_dim=6,
    ssm_state_size=5,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
    layer_norm_epsilon=1e-5,
)
CASES: dict[str, dict[str, Any]] = {
    "every-kind-grouped-router": dict(hybrid_override_pattern="M*EM-E", n_group=2, topk_group=1),
    "latent-moe-biases": dict(
        hybrid_override_pattern="ME*E",
        moe_latent_size=12,
        mlp_bias=True,
        use_bias=True,
        use_conv_bias=False,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
    ),
    "attention-first-one-group-top1": dict(
        hybrid_override_pattern="*MEM", n_groups=1, mamba_num_heads=3, num_experts_per_tok=1, time_step_min=0.05
    ),
    "mamba-and-mlp-only": dict(hybrid_override_pattern="MM-M*", conv_kernel=2, ssm_state_size=8),
    "tie-flag-ignored": dict(hybrid_override_pattern="M*-", tie_word_embeddings=True),  # as transformers does
    "layer-list-legacy-names": dict(
        layers_block_type=["mamba", "moe", "attention", "mlp"], num_attention_heads=2, num_key_value_heads=1
    ),
}


def _hf(case: str) -> Any:
    return hf_model("nemotron_h", **{**BASE, **CASES[case]})


@pytest.mark.parametrize("case", list(CASES))
def test_nemotron_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert all(n.startswith(("backbone.", "lm_head.")) for n in f.keys())  # the Hub layout we claim
    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert list(cfg.layer_types) == list(hf.config.layers_block_type)
    assert [b.kind for b in ours.model.layers] == list(cfg.layer_types)
    ids = input_ids(seq=40)  # over two 16-token chunks of the scan
    with torch.no_grad():
        ref = hf(ids).logits
        logits, routed = ours(ids, return_routed_experts=True)
    assert max_diff(logits, ref) < 1e-4
    if ours.num_moe_layers:
        assert torch.equal(routed.long(), _hf_routes(hf, ids, suffix="mixer.gate"))
    save_pretrained(ours, tmp_path / "ours")
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) == 0.0
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("case", ["every-kind-grouped-router", "latent-moe-biases"])
def test_nemotron_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ids, targets = input_ids(seq=20), input_ids(seq=20, seed=7)
    for model, logits in ((hf, lambda m: m(ids).logits), (ours, lambda m: m(ids))):
        torch.nn.functional.cross_entropy(logits(model).flatten(0, 1), targets.flatten()).backward()
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        if p.grad is None:  # the router's correction bias is a buffer in transformers, frozen in ours
            continue
        assert max_diff(mine[name].grad, p.grad) <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_in_memory_layout_with_model_prefix_loads(tmp_path: Path) -> None:
    """transformers' `save_original_format=False` layout: `model.*` names, fused experts without `.weight`."""
    hf = _hf("every-kind-grouped-router")
    out = tmp_path / "mem"
    out.mkdir()
    save_file({n: t.contiguous() for n, t in hf.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf.config.to_dict()))
    ours = load_pretrained(out)
    ids = input_ids(seq=12)
    with torch.no_grad():
        assert max_diff(ours(ids), hf(ids).logits) < 1e-4


def test_packed_sequences_start_from_zero_state(tmp_path: Path) -> None:
    hf = _hf("every-kind-grouped-router")
    hf.save_pretrained(tmp_path / "hf")
    check_packed_sequences(load_pretrained(tmp_path / "hf"), tol=1e-5)


def test_nemotron_fields_are_checked() -> None:
    raw = _hf("every-kind-grouped-router").config.to_dict()
    with pytest.raises(ValueError, match="unknown characters"):
        ModelConfig.from_hf_dict({**raw, "layers_block_type": None, "hybrid_override_pattern": "M*X"})
    with pytest.raises(ValueError, match="unknown entries"):
        ModelConfig.from_hf_dict({**raw, "layers_block_type": ["mamba", "sliding"]})
    with pytest.raises(ValueError, match="multiple of n_groups"):
        ModelConfig.from_hf_dict({**raw, "n_groups": 3})
    # transformers ignores tie_word_embeddings for Nemotron-H (its head is stored and untied): so do we
    assert not ModelConfig.from_hf_dict({**raw, "tie_word_embeddings": True}).tie_word_embeddings
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        ModelConfig.from_hf_dict({**raw, "n_group": 3})
    with pytest.raises(ValueError, match="relu2"):
        ModelConfig.from_hf_dict({**raw, "mlp_hidden_act": "silu"})
    dense = ModelConfig.from_hf_dict(hf_model("qwen3", head_dim=8).config.to_dict())
    with pytest.raises(ValueError, match="Nemotron-H fields"):
        dense.replace(mamba_num_heads=4)


def test_tiny_preset_has_every_block_kind_and_loads_in_transformers(tmp_path: Path) -> None:
    from miles_hpc.models.presets import init_model

    path = init_model("nemotron_h", "tiny", tmp_path / "n", seed=3)
    ours = load_pretrained(path)
    assert set(ours.config.layer_types) == {"linear_attention", "full_attention", "moe", "mlp"}
    assert ours.config.moe_latent_size > 0 and ours.num_moe_layers == 2
    ids = input_ids(seq=20) % ours.config.vocab_size
    with torch.no_grad():
        logits = ours(ids)
        assert torch.isfinite(logits).all()
        assert max_diff(hf_load(path)(ids).logits, logits) < 1e-5
