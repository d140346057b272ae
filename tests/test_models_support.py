"""Shared helpers for the tests/test_models*.py files (no tests here): tiny transformers models with random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 97


def hf_config(model_type: str, **overrides: Any) -> Any:
    """A tiny transformers config of `model_type`, fp32."""
    from transformers import AutoConfig

    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3_moe":
        base.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)
    if model_type == "qwen3":
        base.update(head_dim=8)
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere, including norms and biases (HF init leaves those at 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(("mlp.gate.weight", "mixer.gate.weight")):
            p.copy_(0.5 * noise)  # decisive routing: no near-ties between our and HF's top-k
        else:
            p.copy_(0.15 * noise)
    return model


def hf_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        hf_config(model_type, **overrides), attn_implementation="eager", dtype=torch.float32
    )
    return randomize_(model, seed).eval()


def hf_load(path: Path) -> Any:
    """transformers' own loader; fails the test on any missing or unexpected key."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"transformers reported {bad} loading {path}"
    return model.eval()


def input_ids(batch: int = 2, seq: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def assert_grads_match(hf: Any, ours: torch.nn.Module, bound: float = 1e-5) -> None:
    """Cross-entropy on the same inputs through both models: every transformers parameter's gradient equals ours
    under the same name."""
    ids, targets = input_ids(seq=10), input_ids(seq=10, seed=7)
    for model, logits in ((hf, lambda m: m(ids).logits), (ours, lambda m: m(ids))):
        torch.nn.functional.cross_entropy(logits(model).flatten(0, 1), targets.flatten()).backward()
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert p.grad is not None and max_diff(mine[name].grad, p.grad) < bound, name
