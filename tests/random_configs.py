"""Random configs of every supported family (no tests here): each family's tiny preset with its shape and option
keys drawn from a seeded generator, so tests/test_models_random.py checks parity on configs no other test names
(head counts, GQA ratios, head dims, RoPE scalings, tied heads, biases, layer patterns, MoE routing options,
DSA/compression/hybrid layouts). The draws stay inside what transformers 5.24 builds and we accept; a config we
refuse on purpose (e.g. Qwen2's `use_sliding_window`) is not drawn."""

from __future__ import annotations

import copy
import random
import zlib
from typing import Any

from miles_hpc.models.families import ARCHITECTURES
from miles_hpc.models.presets import preset_config

FAMILIES = tuple(ARCHITECTURES)


def _rope(r: random.Random) -> dict[str, Any]:
    theta = r.choice([1e4, 5e5, 1e6])
    kind = r.choice(["default", "linear", "dynamic", "yarn", "yarn-full", "llama3"])
    base: dict[str, Any] = {"rope_type": kind.split("-")[0], "rope_theta": theta}
    if kind in ("linear", "dynamic"):
        return {**base, "factor": r.choice([2.0, 4.0])}
    if kind == "yarn":
        return {**base, "factor": r.choice([2.0, 4.0, 40.0]), "original_max_position_embeddings": r.choice([8, 16])}
    if kind == "yarn-full":
        return {
            **base,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "attention_factor": r.choice([0.5, 1.3]),
            "beta_fast": 24.0,
            "beta_slow": 2.0,
            "truncate": r.random() < 0.5,
        }
    if kind == "llama3":
        llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        return {**base, **llama3, "original_max_position_embeddings": r.choice([8, 16])}
    return base


def _heads(r: random.Random, d: dict[str, Any], choices: tuple[int, ...] = (2, 4, 8)) -> None:
    d["num_attention_heads"] = h = r.choice(choices)
    d["num_key_value_heads"] = r.choice([k for k in (1, 2, 4, 8) if h % k == 0])


def _dense(r: random.Random, d: dict[str, Any]) -> None:
    _heads(r, d)
    d.update(hidden_size=r.choice([32, 48, 64]), num_hidden_layers=r.choice([1, 2, 3]), head_dim=r.choice([8, 16]))
    d.update(hidden_act=r.choice(["silu", "gelu"]), rms_norm_eps=r.choice([1e-6, 1e-5]))
    d["max_position_embeddings"] = r.choice([32, 64, 128])
    d["rope_parameters"] = _rope(r)
    if d["model_type"] != "qwen2":
        d["attention_bias"] = r.random() < 0.3
    if d["model_type"] == "llama":
        d["mlp_bias"] = r.random() < 0.3


def _moe_routing(r: random.Random, d: dict[str, Any]) -> None:
    d.update(num_experts_per_tok=r.choice([1, 2]), norm_topk_prob=r.random() < 0.5)
    if "n_group" in d:
        d.update(n_group=r.choice([1, 2]), topk_group=1, routed_scaling_factor=r.choice([1.0, 2.5]))


def _mla(r: random.Random, d: dict[str, Any]) -> None:
    d["num_attention_heads"] = d["num_key_value_heads"] = r.choice([2, 4, 8])
    d.update(kv_lora_rank=r.choice([16, 32]), qk_rope_head_dim=r.choice([4, 8]), qk_nope_head_dim=r.choice([8, 16]))
    d.update(v_head_dim=r.choice([8, 16]), rope_interleave=r.random() < 0.5)


def _draw(family: str, r: random.Random, d: dict[str, Any]) -> None:
    if family in ("llama", "qwen2", "qwen3"):
        _dense(r, d)
    elif family == "qwen3_moe":
        _dense(r, d)
        d.update(
            num_experts=r.choice([4, 6]), decoder_sparse_step=r.choice([1, 2]), mlp_only_layers=r.choice([[], [0]])
        )
        _moe_routing(r, d)
    elif family == "glm4_moe":
        _dense(r, d)
        d.update(n_routed_experts=r.choice([4, 8]), n_shared_experts=r.choice([1, 2]), use_qk_norm=r.random() < 0.5)
        d.update(first_k_dense_replace=r.choice([0, 1]), partial_rotary_factor=r.choice([0.5, 1.0]))
        _moe_routing(r, d)
    elif family == "deepseek_v3":
        d.update(num_hidden_layers=r.choice([1, 2, 3]), first_k_dense_replace=r.choice([0, 1]))
        d.update(q_lora_rank=r.choice([None, 16]), rope_parameters=_rope(r), max_position_embeddings=64)
        _mla(r, d)
        _moe_routing(r, d)
    elif family in ("deepseek_v32", "glm_moe_dsa"):
        _mla(r, d)
        d.update(
            index_topk=r.choice([4, 8, 16, 64]), index_n_heads=r.choice([4, 16]), index_head_dim=r.choice([16, 32])
        )
        d.update(q_lora_rank=r.choice([16, 32]), num_nextn_predict_layers=0, rope_interleave=True)
        _moe_routing(r, d)
        if family == "glm_moe_dsa":
            d["num_hidden_layers"] = n = r.choice([2, 3, 4])
            d["indexer_types"] = ["full"] + [r.choice(["full", "shared"]) for _ in range(n - 1)]
            d["mlp_layer_types"] = [r.choice(["dense", "sparse"]) for _ in range(n)]
        else:
            d["first_k_dense_replace"] = r.choice([0, 1, 2])
    elif family in ("qwen3_next", "qwen3_5_moe_text"):
        _heads(r, d)
        d["num_hidden_layers"] = n = r.choice([2, 3, 4])
        d["layer_types"] = ["full_attention"] + [r.choice(["linear_attention", "full_attention"]) for _ in range(n - 1)]
        r.shuffle(d["layer_types"])
        d.update(head_dim=r.choice([8, 16, 32]), partial_rotary_factor=r.choice([0.25, 0.5, 1.0]))
        d["linear_num_key_heads"] = kh = r.choice([1, 2, 4])
        d.update(linear_num_value_heads=kh * r.choice([1, 2]), linear_conv_kernel_dim=r.choice([2, 4]))
        d.update(linear_key_head_dim=r.choice([8, 16]), linear_value_head_dim=r.choice([8, 16, 32]))
        d.update(num_experts=r.choice([4, 8]), shared_expert_intermediate_size=r.choice([16, 48]))
        if family == "qwen3_next":
            d.update(mlp_only_layers=r.choice([[], [0]]), decoder_sparse_step=r.choice([1, 2]))
        _moe_routing(r, d)
    elif family == "nemotron_h":
        _heads(r, d, (2, 4))
        # One attention layer at least: transformers 5.24 asks a cache with none for its length and fails.
        pattern = ["*"] + [r.choice("ME*-") for _ in range(r.choice([2, 3, 5]))]
        r.shuffle(pattern)
        d.update(hybrid_override_pattern="".join(pattern), head_dim=r.choice([16, 32]))
        d["mamba_num_heads"] = mh = r.choice([2, 4, 8])
        d.update(mamba_head_dim=r.choice([8, 16]), n_groups=r.choice([g for g in (1, 2, 4) if mh % g == 0]))
        d.update(ssm_state_size=r.choice([8, 16]), conv_kernel=r.choice([2, 4]), chunk_size=r.choice([8, 16, 64]))
        d["moe_latent_size"] = r.choice([None, 32])
        _moe_routing(r, d)
    elif family == "deepseek_v4":
        d["num_hidden_layers"] = n = r.choice([2, 3, 5])
        kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
        d["layer_types"] = [r.choice(kinds) for _ in range(n)]
        hashed = min(r.choice([0, 1, 2]), n)
        d["mlp_layer_types"] = ["hash_moe"] * hashed + ["moe"] * (n - hashed)
        d["compress_rates"] = {kinds[1]: r.choice([2, 4]), kinds[2]: r.choice([8, 16])}
        d.update(sliding_window=r.choice([8, 16]), hc_mult=r.choice([1, 2, 4]), o_groups=r.choice([1, 2, 4]))
        d.update(num_attention_heads=r.choice([4, 8]), head_dim=r.choice([16, 32]), index_topk=r.choice([2, 4, 8]))
        d.update(num_experts_per_tok=r.choice([1, 2]), partial_rotary_factor=r.choice([0.25, 0.5]))
    elif family == "inkling_text":
        d["num_hidden_layers"] = n = r.choice([2, 3, 4])
        d["layer_types"] = [r.choice(["hybrid", "hybrid_sliding"]) for _ in range(n)]
        d["mlp_layer_types"] = [r.choice(["dense", "sparse"]) for _ in range(n)]
        _heads(r, d, (2, 4))
        d["num_key_value_heads"] = min(d["num_key_value_heads"], 2)
        d["swa_num_attention_heads"] = sh = r.choice([2, 4])
        d.update(swa_num_key_value_heads=r.choice([k for k in (1, 2) if sh % k == 0]), swa_head_dim=r.choice([8, 24]))
        d.update(head_dim=r.choice([8, 16]), sliding_window_size=r.choice([4, 16]), d_rel=r.choice([2, 4]))
        d.update(rel_extent=r.choice([8, 32]), conv_kernel_size=r.choice([2, 4]), route_scale=r.choice([1.0, 2.0]))
        d.update(logits_mup_width_multiplier=r.choice([1.0, 0.5]), num_experts_per_tok=r.choice([1, 2]))
    else:
        raise KeyError(f"no random configs for {family}: add its draws here")


def random_config(family: str, seed: int) -> dict[str, Any]:
    """The family's tiny preset (miles_hpc.models.presets) with random shapes and options: a config.json dict.
    The same (family, seed) gives the same config in every process."""
    r = random.Random(seed * 7919 + zlib.crc32(family.encode()))
    d = copy.deepcopy(preset_config(family, "tiny"))
    d["tie_word_embeddings"] = r.random() < 0.5
    _draw(family, r, d)
    if "rope_parameters" in d:
        d.pop("rope_theta", None)
        d.pop("rope_scaling", None)
    return d
