"""miles_hpc.models, Qwen3-MoE: parity with transformers 5.24 in both of its checkpoint layouts, routed expert ids
equal to transformers' router choices, routing replay (R3): exact on own routes, differentiable on foreign ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_models_support import hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import (
    ModelConfig,
    build_model,
    expected_hf_shapes,
    hf_target,
    iter_hf_tensors,
    load_pretrained,
    save_pretrained,
)

MOE_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (config overrides, transformers save_pretrained kwargs)
    "norm-topk": (dict(norm_topk_prob=True), {}),
    "no-norm-topk-tied": (dict(norm_topk_prob=False, tie_word_embeddings=True), {}),
    "mlp-only-layers": (dict(num_hidden_layers=4, mlp_only_layers=[0, 2], norm_topk_prob=True), {}),
    "sparse-step-2-sharded": (dict(num_hidden_layers=4, decoder_sparse_step=2), dict(max_shard_size=20_000)),
    "fused-format": (
        dict(norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]),
        dict(save_original_format=False),
    ),
}


def _hf_routes(hf: Any, ids: torch.Tensor, suffix: str = "mlp.gate", kind: str | None = None) -> torch.Tensor:
    """transformers' own top-k ids per MoE layer, [B, T, L, k], captured from each router's forward (the modules
    named `*suffix`, or of class `kind`)."""
    captured: list[torch.Tensor] = []
    routers = [m for name, m in hf.named_modules() if (type(m).__name__ == kind if kind else name.endswith(suffix))]
    hooks = [r.register_forward_hook(lambda _m, _i, out: captured.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for h in hooks:
            h.remove()
    b, t = ids.shape
    return torch.stack(captured, dim=1).view(b, t, len(routers), -1)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    overrides, save_kwargs = MOE_CASES[case]
    hf = hf_model("qwen3_moe", **overrides)
    hf.save_pretrained(tmp_path / "hf", **save_kwargs)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == ("max_shard_size" in save_kwargs)
    with safe_open(str(next((tmp_path / "hf").glob("model*.safetensors"))), "pt") as f:
        names = list(f.keys())
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert fused == (save_kwargs.get("save_original_format") is False)  # the layout we claim transformers writes

    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    dense_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    assert ours.num_moe_layers == cfg.num_hidden_layers - len(dense_layers) and ours.top_k == 2
    assert [type(hf.model.layers[i].mlp).__name__ for i in dense_layers] == ["Qwen3MoeMLP"] * len(dense_layers)

    ids = input_ids(seq=12)
    with torch.no_grad():
        ref = hf(ids).logits
        logits, routed = ours(ids, return_routed_experts=True)
    assert max_diff(logits, ref) < 1e-4
    assert routed.dtype == torch.int32 and routed.shape == (2, 12, ours.num_moe_layers, 2)
    assert torch.equal(routed.long(), _hf_routes(hf, ids))
    assert len(routed.unique()) > 2  # the routes are not degenerate

    # Ours -> transformers: written in the Hub per-expert layout, loads with no missing keys, same logits.
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=save_kwargs.get("max_shard_size"))
    index = tmp_path / "ours" / "model.safetensors.index.json"
    if index.exists():
        written = set(json.loads(index.read_text())["weight_map"])
    else:
        with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
            written = set(f.keys())
    moe0 = cfg.moe_layer_ids()[0]
    assert f"model.layers.{moe0}.mlp.experts.5.down_proj.weight" in written
    assert f"model.layers.{moe0}.mlp.gate.weight" in written
    assert not any(n.endswith("gate_up_proj") for n in written)
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) < 1e-5


def test_moe_bf16_matches_transformers_default_experts_path(tmp_path: Path) -> None:
    """bf16 with top-8 routing: the (token, slot) sum order matters here, and ours is transformers' grouped_mm one.
    (Bitwise equal on the CPUs we tried; the bound leaves room for another CPU's kernels, yet is far below the
    ~0.3 that a wrong reduction order or gate dtype gives.)"""
    from transformers import AutoModelForCausalLM

    hf_model("qwen3_moe", num_experts=12, num_experts_per_tok=8, norm_topk_prob=True).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ours = load_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = input_ids(seq=24)
    with torch.no_grad():
        logits, routed = ours(ids, return_routed_experts=True)
        assert logits.dtype == torch.bfloat16
        assert max_diff(logits, hf(ids).logits) < 2e-2
    assert torch.equal(routed.long(), _hf_routes(hf, ids))


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_gradients_match_transformers(model_type: str, tmp_path: Path) -> None:
    """What the trainer relies on: the same gradients as transformers for every parameter, under the same names
    (our in-memory names are transformers 5's, fused experts included), and no lookup gradient for the pad row."""
    overrides = dict(pad_token_id=3, tie_word_embeddings=model_type == "llama")
    if model_type == "qwen3_moe":
        overrides.update(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    hf = hf_model(model_type, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).train()
    ids = input_ids(seq=10)
    ids[0, 4] = 3  # the pad token appears in the input
    targets = input_ids(seq=10, seed=7)
    for model, logits in ((hf, lambda m: m(ids).logits), (ours, lambda m: m(ids))):
        torch.nn.functional.cross_entropy(logits(model).flatten(0, 1), targets.flatten()).backward()
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == {n for n, _ in hf.named_parameters()}
    for name, p in hf.named_parameters():
        assert p.grad is not None and max_diff(ours_params[name].grad, p.grad) < 1e-5, name
    if model_type == "qwen3_moe":  # untied: the pad row of the embedding gets no gradient
        assert ours.model.embed_tokens.weight.grad[3].abs().sum() == 0


def _tiny_moe(**kw: Any) -> ModelConfig:
    return ModelConfig(
        **{
            **dict(
                model_type="qwen3_moe",
                vocab_size=97,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                mlp_only_layers=(1,),
                initializer_range=0.2,
            ),
            **kw,
        }
    )


def _random_routes(shape: tuple[int, ...], num_experts: int, seed: int) -> torch.Tensor:
    """Distinct expert ids per token, like a real top-k."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    perms = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(int(torch.tensor(lead).prod()))])
    return perms.view(shape).to(torch.int32)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_replay(norm_topk_prob: bool) -> None:
    torch.manual_seed(0)
    model = build_model(_tiny_moe(norm_topk_prob=norm_topk_prob))
    assert (model.num_moe_layers, model.top_k) == (2, 2)
    ids = input_ids(seq=9)
    logits, routed = model(ids, return_routed_experts=True)

    # Replaying the model's own routes reproduces its logits bit for bit.
    replayed, routed_again = model(ids, routing_replay=routed, return_routed_experts=True)
    assert torch.equal(replayed, logits) and torch.equal(routed_again, routed)

    # Foreign routes change the output and the gradient still reaches every router through the gate weights.
    foreign = _random_routes(tuple(routed.shape), 8, seed=5)
    assert not torch.equal(foreign, routed)
    model.zero_grad()
    out, used = model(ids, routing_replay=foreign, return_routed_experts=True)
    assert torch.equal(used, foreign) and max_diff(out, logits) > 1e-3
    out.logsumexp(-1).sum().backward()
    for i in model.moe_layer_ids:
        grad = model.model.layers[i].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0

    # The gate weights at replayed ids are the current router probabilities there (renormalised if configured).
    layer = model.model.layers[0]
    h = layer.post_attention_layernorm(torch.randn(5, 32))
    probs = torch.softmax(h @ layer.mlp.gate.weight.T, dim=-1)
    pick = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0]])
    weights, got_ids = layer.mlp.gate(h, pick)
    expect = probs.gather(-1, pick)
    expect = expect / expect.sum(-1, keepdim=True) if norm_topk_prob else expect
    assert torch.equal(got_ids, pick) and torch.allclose(weights, expect)


def test_replay_and_routes_validation() -> None:
    model = build_model(_tiny_moe())
    ids = input_ids(batch=1, seq=4)
    with pytest.raises(ValueError, match=r"routing_replay must have shape \(1, 4, 2, 2\)"):
        model(ids, routing_replay=torch.zeros(1, 4, 3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        model(ids, routing_replay=torch.full((1, 4, 2, 2), 8, dtype=torch.int32))
    dense = build_model(
        ModelConfig(
            model_type="llama",
            vocab_size=97,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    _, routed = dense(ids, return_routed_experts=True)
    assert (dense.num_moe_layers, dense.top_k, routed.shape) == (0, 0, (1, 4, 0, 0))


def test_moe_expert_compute_matches_per_token_reference() -> None:
    """The grouped expert path equals a naive per-token sum, including experts that receive no token."""
    torch.manual_seed(0)
    block = build_model(_tiny_moe(num_experts=16)).model.layers[0].mlp
    x = torch.randn(7, 32)
    weights, ids = block.gate(x)
    got = block.experts(x, ids, weights)
    ex = block.experts
    ref = torch.zeros_like(x)
    for n in range(7):
        for j in range(2):
            e = int(ids[n, j])
            gate, up = (ex.gate_up_proj[e] @ x[n]).chunk(2)
            ref[n] += weights[n, j] * (ex.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    assert len(ids.unique()) < 16 and max_diff(got, ref) < 1e-5


def test_hf_names_address_our_parameters() -> None:
    """`iter_hf_tensors` / `hf_target`: the Hub names the engine and weight sync use, mapped into fused experts."""
    torch.manual_seed(0)
    model = build_model(_tiny_moe(tie_word_embeddings=True))
    names = [n for n, _ in iter_hf_tensors(model)]
    assert "lm_head.weight" not in names and len(names) == len(set(names))
    assert set(names) == set(expected_hf_shapes(model))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.1.mlp.up_proj.weight" in names  # layer 1 is dense (mlp_only_layers)
    with torch.no_grad():
        hf_target(model, "model.layers.2.mlp.experts.3.up_proj.weight").fill_(0.5)
        hf_target(model, "model.layers.2.mlp.experts.3.down_proj.weight").fill_(0.25)
    fused = model.model.layers[2].mlp.experts
    assert (fused.gate_up_proj[3, 16:] == 0.5).all() and (fused.gate_up_proj[3, :16] != 0.5).all()
    assert (fused.down_proj[3] == 0.25).all() and (fused.down_proj[2] != 0.25).all()
    for name, t in iter_hf_tensors(model):
        assert torch.equal(hf_target(model, name), t)
    with pytest.raises(KeyError, match="experts.8"):
        hf_target(model, "model.layers.0.mlp.experts.8.gate_proj.weight")


def test_tied_checkpoint_with_lm_head_and_legacy_buffers_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(_tiny_moe(tie_word_embeddings=True))
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_pretrained(tmp_path)
    ids = input_ids(seq=5)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
