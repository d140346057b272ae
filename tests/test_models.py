"""miles_hpc.models, dense families: parity with transformers 5.24 (logits, fp32), checkpoint I/O both ways,
RoPE scaling variants, packed sequences, the attention-backend seam, config parsing, and error messages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_models_support import hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import (
    CausalLM,
    ModelConfig,
    build_model,
    load_pretrained,
    read_config,
    save_pretrained,
    sdpa_attention,
)

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}

DENSE_CASES: dict[str, tuple[str, dict[str, Any], int | None]] = {
    # name: (model_type, config overrides, HF max_shard_size in bytes or None)
    "llama": ("llama", {}, None),
    "llama-tied-bias-mha": (
        "llama",
        dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, num_key_value_heads=4),
        None,
    ),
    "llama-rope-llama3": ("llama", dict(hidden_size=64, rope_parameters=LLAMA3), None),
    "llama-rope-linear": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
        None,
    ),
    "llama-rope-dynamic": (
        "llama",
        dict(max_position_embeddings=8, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
        None,
    ),
    "qwen2-tied-yarn": (
        "qwen2",
        dict(tie_word_embeddings=True, max_position_embeddings=64, rope_parameters=YARN),
        None,
    ),
    "qwen2-sharded": ("qwen2", {}, 12_000),
    "qwen3-headdim16": ("qwen3", dict(head_dim=16), None),
    "qwen3-tied-yarn-bias-sharded": (
        "qwen3",
        dict(
            tie_word_embeddings=True,
            attention_bias=True,
            max_position_embeddings=64,
            rope_parameters={**YARN, "beta_fast": 16.0, "beta_slow": 2.0},
        ),
        8_000,
    ),
    # transformers' other activations (ACT2FN), each in one dense family
    "llama-gelu_new": ("llama", dict(hidden_act="gelu_new"), None),
    "qwen2-quick_gelu": ("qwen2", dict(hidden_act="quick_gelu"), None),
    "qwen3-relu": ("qwen3", dict(hidden_act="relu"), None),
    "llama-tanh": ("llama", dict(hidden_act="tanh"), None),
    "qwen3-mish": ("qwen3", dict(hidden_act="mish"), None),
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dense_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    model_type, overrides, shard = DENSE_CASES[case]
    hf = hf_model(model_type, **overrides)
    hf.save_pretrained(tmp_path / "hf", max_shard_size=shard or "50GB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == (shard is not None)

    ours = load_pretrained(tmp_path / "hf")
    assert isinstance(ours, CausalLM) and ours.config.model_type == model_type
    assert next(ours.parameters()).dtype == torch.float32
    ids = input_ids(seq=13)  # longer than the dynamic case's max_position_embeddings=8
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.shape == (2, 13, hf.config.vocab_size)
    assert max_diff(got, ref) < 1e-4

    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    if ours.config.rope_scaling is not None:  # the scaling must matter, or the case proves nothing
        plain = CausalLM(ours.config.replace(rope_scaling=None))
        plain.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert max_diff(plain(ids), got) > 1e-3

    # Ours -> transformers: same logits, no missing/unexpected keys, tied head not written.
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=shard)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists() == (shard is not None)
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) < 1e-5
    names = _checkpoint_names(tmp_path / "ours")
    assert ("lm_head.weight" in names) == (not ours.config.tie_word_embeddings)


def _checkpoint_names(path: Path) -> set[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_dynamic_rope_is_default_rope_within_native_length(tmp_path: Path) -> None:
    hf = hf_model(
        "llama", max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    )
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    plain = CausalLM(ours.config.replace(rope_scaling=None))
    plain.load_state_dict(ours.state_dict())
    ids = input_ids(seq=20)
    with torch.no_grad():
        assert max_diff(ours(ids), hf(ids).logits) < 1e-4
        assert torch.equal(ours(ids), plain(ids))


def _tiny(model_type: str = "qwen3", **kw: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    if model_type == "qwen2":
        base["qkv_bias"] = True
    if model_type == "qwen3_moe":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_packed_sequences_equal_separate_forwards(model_type: str) -> None:
    torch.manual_seed(0)
    model = build_model(_tiny(model_type, initializer_range=0.2))
    lengths = [5, 1, 9, 3]
    seqs = [torch.randint(0, 97, (1, n)) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed, routed = model(torch.cat(seqs, dim=1), cu_seqlens=cu, return_routed_experts=True)
        for i, s in enumerate(seqs):
            alone, routed_alone = model(s, return_routed_experts=True)
            assert max_diff(packed[:, cu[i] : cu[i + 1]], alone) < 1e-5
            assert torch.equal(routed[:, cu[i] : cu[i + 1]], routed_alone)
        # The default positions restart at 0 in each packed sequence.
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        assert torch.equal(model(torch.cat(seqs, 1), position_ids=pos, cu_seqlens=cu), packed)


def test_cu_seqlens_validation() -> None:
    model = build_model(_tiny())
    with pytest.raises(ValueError, match="batch size 1"):
        model(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="rise from 0 to T=4"):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 2, 5]))


def test_attention_backend_is_replaceable() -> None:
    torch.manual_seed(0)
    model = build_model(_tiny("llama", head_dim=8))
    calls: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append((kw["layer_idx"], tuple(q.shape), tuple(k.shape)))
        return sdpa_attention(q, k, v, **kw)

    ids = input_ids(seq=7)
    with torch.no_grad():
        assert torch.equal(model(ids, attn_backend=recording), model(ids))
    assert calls == [(0, (2, 4, 7, 8), (2, 2, 7, 8)), (1, (2, 4, 7, 8), (2, 2, 7, 8))]


def test_build_model_is_seedable_and_loadable(tmp_path: Path) -> None:
    config = _tiny("qwen3", tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(3)
    a = build_model(config)
    torch.manual_seed(3)
    b = build_model(config)
    torch.manual_seed(4)
    c = build_model(config)
    assert next(a.parameters()).dtype == torch.bfloat16  # the config's dtype is the default
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert build_model(config, dtype=torch.float32).lm_head.weight.dtype == torch.float32

    save_pretrained(a, tmp_path)
    assert read_config(tmp_path) == config
    loaded = load_pretrained(tmp_path)  # bf16 from the config
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    ids = input_ids(seq=6)
    with torch.no_grad():
        assert torch.equal(loaded(ids), a(ids))
        f32 = load_pretrained(tmp_path, dtype=torch.float32)
        assert f32.model.norm.weight.dtype == torch.float32
        assert max_diff(hf_load(tmp_path)(ids).logits, f32(ids)) < 1e-4


# ---------------------------------------------------------------- config
QWEN3_30B_A3B = {  # the Hub config.json of Qwen/Qwen3-30B-A3B (old key style)
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_config_parses_hub_and_transformers5_styles() -> None:
    hub = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    assert (hub.num_experts, hub.num_experts_per_tok, hub.head_dim, hub.dtype) == (128, 8, 128, "bfloat16")
    assert hub.norm_topk_prob and hub.qk_norm and hub.rope_theta == 1e6 and hub.rope_scaling is None
    assert len(hub.moe_layer_ids()) == 48
    # transformers 5.24 writes num_local_experts, rope_parameters and dtype instead.
    v5 = dict(
        QWEN3_30B_A3B,
        num_local_experts=128,
        dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    for k in ("num_experts", "torch_dtype", "rope_theta", "rope_scaling"):
        del v5[k]
    assert ModelConfig.from_hf_dict(v5) == hub
    assert ModelConfig.from_hf_dict(hub.to_hf_dict()) == hub
    with pytest.raises(dataclasses.FrozenInstanceError):
        hub.hidden_size = 1  # type: ignore[misc]


def test_config_family_defaults_and_round_trip() -> None:
    from transformers import AutoConfig

    # Absent keys take transformers' per-class defaults.
    q3 = ModelConfig.from_hf_dict({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 64})
    assert (q3.head_dim, q3.num_key_value_heads, q3.vocab_size) == (128, 32, 151936)
    ll = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8})
    assert (ll.model_type, ll.num_key_value_heads, ll.head_dim) == ("llama", 8, 512)
    assert ModelConfig.from_hf_dict({"model_type": "qwen2"}).qkv_bias
    for config in [
        _tiny("llama", qkv_bias=True, o_bias=True, mlp_bias=True, eos_token_id=(1, 2)),
        _tiny("qwen2", tie_word_embeddings=True),
        _tiny("qwen3_moe", norm_topk_prob=True, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,)),
        ModelConfig.from_hf_dict({"model_type": "llama", "max_position_embeddings": 64, "rope_scaling": LLAMA3}),
        ModelConfig.from_hf_dict({"model_type": "qwen3", "rope_scaling": {**YARN, "attention_factor": 1.5}}),
    ]:
        d = config.to_hf_dict()
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(d))) == config
        hf = AutoConfig.for_model(**d)  # transformers reads our keys as the same architecture
        assert ModelConfig.from_hf_dict(hf.to_dict()) == config


def test_config_rejects_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf_dict({"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict({"model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(ValueError, match="multiple"):
        _tiny(num_key_value_heads=3)
    with pytest.raises(ValueError, match="x.json.*gpt2.*qwen3_moe"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"}, source="x.json")


# ---------------------------------------------------------------- errors
def test_unknown_model_type_names_file_and_supported_types(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoX"]}))
    with pytest.raises(ValueError) as e:
        load_pretrained(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg and "gpt_neox" in msg
    assert all(t in msg for t in ("llama", "qwen2", "qwen3", "qwen3_moe"))


def _saved(tmp_path: Path, shard: int | None = None) -> Path:
    torch.manual_seed(0)
    save_pretrained(build_model(_tiny("qwen3")), tmp_path, max_shard_bytes=shard)
    return tmp_path


def test_missing_tensor_names_tensor_and_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors.*missing tensor 'model\.layers\.1\.self_attn\.k_norm"):
        load_pretrained(path)


def test_missing_tensor_in_sharded_checkpoint_names_index(tmp_path: Path) -> None:
    path = _saved(tmp_path, shard=10_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json: missing tensor 'lm_head\.weight'"):
        load_pretrained(path)
    (path / index["weight_map"]["model.norm.weight"]).unlink()
    index["weight_map"]["lm_head.weight"] = index["weight_map"]["model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(path)


def test_wrong_shape_and_unexpected_tensor_name_tensor_and_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    good = load_file(path / "model.safetensors")
    bad = dict(good, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(47, 32)})
    save_file(bad, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' "
        r"has shape \(47, 32\), expected \(48, 32\)",
    ):
        load_pretrained(path)
    save_file(dict(good, extra=torch.zeros(1)), path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'extra'"):
        load_pretrained(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(path)
