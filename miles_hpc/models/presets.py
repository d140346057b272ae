"""Size presets and ``init-model``: random-init HF-format checkpoints made here, no downloads.

A preset is a plain HF ``config.json`` dict, so what we write is exactly what ``transformers`` reads. The tokenizer
is the local byte-level one (``tokenizer.py``); its vocabulary fits in every preset's ``vocab_size``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_hpc.models.families import ARCHITECTURES, WRAPPERS
from miles_hpc.models.tokenizer import EOS_TOKEN, NUM_BYTE_TOKENS, PAD_TOKEN, SPECIAL_TOKENS, special_token_id

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa", "deepseek_v32")
# Hybrid families (issue 29): recurrent layers (Gated DeltaNet, Mamba-2) whose state the embedded engine keeps per
# sequence; not in ARCHS, the list every stage serves (SGLang, engine TP, megatron refuse them: config/checks.py).
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe_text", "nemotron_h")
# Multimodal checkpoints whose text model a family above is (families.WRAPPERS): the preset writes the wrapper's
# config.json and a random tower (towers.py) beside the text model, which is what every stage loads and trains.
WRAPPED_ARCHS = ("kimi_k25",)
# Families whose module holds their own tiny config (families.FAMILY_MODULES: `tiny_config()`, every layer kind); the
# engine keeps their own decode state, at TP 1 (config/checks.py `module_family`). Tiny only.
MODULE_ARCHS = ("deepseek_v4", "inkling_text")
SIZES = ("tiny", "small")

# Vocabulary: 256 bytes + specials, rounded up to a multiple of 64 (embedding rows past the tokenizer are unused).
_VOCAB = 320
assert _VOCAB >= NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

_SHAPES: dict[str, dict[str, int]] = {
    # tiny: seconds per RL step on a laptop CPU; small: a few minutes of CPU training still learn visibly.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768,
        moe_intermediate_size=192,
        num_experts=16,
        num_experts_per_tok=4,
    ),
}

# DeepSeek-V3 family (MLA + sigmoid group-limited router + one shared expert; layer 0 dense as in Kimi-K2), scaled
# down: the latent and head widths keep DeepSeek's proportions (nope 2x rope, v = nope).
_MLA: dict[str, dict[str, int]] = {
    "tiny": dict(
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1
    ),
    "small": dict(
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_group=4,
        topk_group=2,
    ),
}


# The DSA families scaled down with their real proportions (GLM-5.2: nope = 3x rope, v = 4x rope, the indexer's
# head 2x rope wide; DeepSeek-V3.2: nope = v = 2x rope) and every branch exercised: dense then MoE layers, GLM's
# full and shared indexer layers, an index_topk below the contexts the built-in tasks reach (so the sparsity
# matters), one MTP layer. The indexer keeps 16 heads (the releases have 32 and 64), not a fraction of the few
# attention heads: a score is an exact 0 when every head's dot product is negative (2^-heads of them), and torch.topk
# breaks such ties by row length, so with 2-4 heads the same token would select differently in a decode step and
# in the trainer's forward over the whole sample (docs/models.md).
_DSA: dict[str, dict[str, dict[str, Any]]] = {
    "glm_moe_dsa": {
        "tiny": dict(
            num_hidden_layers=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=24,
            qk_rope_head_dim=8,
            v_head_dim=32,
            index_n_heads=16,
            index_head_dim=16,
            index_topk=16,
            indexer_types=["full", "shared", "full", "shared"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        ),
        "small": dict(
            num_hidden_layers=6,
            q_lora_rank=96,
            kv_lora_rank=64,
            qk_nope_head_dim=48,
            qk_rope_head_dim=16,
            v_head_dim=64,
            index_n_heads=16,
            index_head_dim=32,
            index_topk=64,
            indexer_types=["full", "full", "shared", "shared", "full", "shared"],
            mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
        ),
    },
    "deepseek_v32": {
        "tiny": dict(
            num_hidden_layers=3,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            index_n_heads=16,
            index_head_dim=16,
            index_topk=16,
            n_group=2,
            topk_group=1,
        ),
        "small": dict(
            num_hidden_layers=4,
            q_lora_rank=96,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            index_n_heads=16,
            index_head_dim=32,
            index_topk=64,
            n_group=4,
            topk_group=2,
        ),
    },
}


def preset_config(arch: str, size: str) -> dict[str, Any]:
    """The HF config.json dict of a preset."""
    every = ARCHS + HYBRID_ARCHS + WRAPPED_ARCHS + MODULE_ARCHS
    if arch not in every:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(every)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if arch in MODULE_ARCHS:
        return _from_module(arch, size)
    if arch == "kimi_k25":
        return _kimi_k25(size)
    s = _SHAPES[size]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": _VOCAB,
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": special_token_id(EOS_TOKEN),
        "pad_token_id": special_token_id(PAD_TOKEN),
        "torch_dtype": "float32",
    }
    _add_family_keys(cfg, arch, size)
    return cfg


def _add_family_keys(cfg: dict[str, Any], arch: str, size: str) -> None:
    """The family-specific keys of a preset (its MoE, MLA, DSA and GLM fields), into `cfg`."""
    s = _SHAPES[size]
    if arch in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if arch == "qwen3_moe":
        cfg.update(
            num_experts=s["num_experts"],
            num_experts_per_tok=s["num_experts_per_tok"],
            moe_intermediate_size=s["moe_intermediate_size"],
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        )
    if arch == "deepseek_v3":
        del cfg["head_dim"]  # transformers derives it from qk_rope_head_dim
        cfg.update(
            _MLA[size],
            num_key_value_heads=s["num_attention_heads"],
            n_routed_experts=s["num_experts"],
            num_experts_per_tok=s["num_experts_per_tok"],
            moe_intermediate_size=s["moe_intermediate_size"],
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            attention_bias=False,
        )
    if arch in _DSA:
        del cfg["head_dim"]  # transformers derives it from qk_rope_head_dim
        cfg.update(
            num_key_value_heads=s["num_attention_heads"],
            n_routed_experts=s["num_experts"],
            num_experts_per_tok=s["num_experts_per_tok"],
            moe_intermediate_size=s["moe_intermediate_size"],
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            attention_bias=False,
            num_nextn_predict_layers=1,
            n_group=1,
            topk_group=1,
        )
        cfg.update(_DSA[arch][size])
        if arch == "glm_moe_dsa":
            cfg["rms_norm_eps"] = 1e-5
    if arch == "nemotron_h":
        _add_nemotron_keys(cfg, size)
    elif arch in HYBRID_ARCHS:
        _add_hybrid_keys(cfg, arch, size)
    if arch == "glm4_moe":  # GLM-4.5: q/k/v bias, QK-norm, half the head rotated, router as DeepSeek-V3's
        cfg.update(
            n_routed_experts=s["num_experts"],
            num_experts_per_tok=s["num_experts_per_tok"],
            moe_intermediate_size=s["moe_intermediate_size"],
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
        )


def _add_hybrid_keys(cfg: dict[str, Any], arch: str, size: str) -> None:
    """Qwen3-Next / Qwen3.5-MoE scaled down, every layer kind present: 4 (8) layers, every 4th full attention,
    the rest Gated DeltaNet; MoE with a shared expert (Qwen3-Next's first layer dense, its MLP kind)."""
    s = _SHAPES[size]
    layers = 4 if size == "tiny" else 8
    heads = dict(tiny=(2, 4, 16), small=(4, 8, 32))[size]  # key heads, value heads, head width
    cfg.update(
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=heads[0],
        linear_num_value_heads=heads[1],
        linear_key_head_dim=heads[2],
        linear_value_head_dim=heads[2],
        linear_conv_kernel_dim=4,
        num_experts=s["num_experts"],
        num_experts_per_tok=s["num_experts_per_tok"],
        moe_intermediate_size=s["moe_intermediate_size"],
        shared_expert_intermediate_size=s["moe_intermediate_size"],
        attention_bias=False,
        partial_rotary_factor=0.25,
    )
    if arch == "qwen3_next":
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True)
    else:
        del cfg["intermediate_size"]  # no dense layers: not a key of Qwen3.5-MoE


def _add_nemotron_keys(cfg: dict[str, Any], size: str) -> None:
    """Nemotron-H scaled down, every block kind present: Mamba-2 (M), attention (*), relu2 MLP (-) and MoE (E)
    with a latent projection half the hidden width; its own key names (NemotronHConfig)."""
    s = _SHAPES[size]
    for key in ("hidden_act", "rms_norm_eps", "rope_theta", "num_hidden_layers"):
        del cfg[key]
    cfg.update(
        hybrid_override_pattern="ME*M-E" if size == "tiny" else "MEM*ME-MEM*E",
        mlp_hidden_act="relu2",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        mamba_num_heads=s["num_attention_heads"],
        mamba_head_dim=s["head_dim"],
        ssm_state_size=s["head_dim"],
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        n_routed_experts=s["num_experts"],
        num_experts_per_tok=s["num_experts_per_tok"],
        moe_intermediate_size=s["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=s["moe_intermediate_size"],
        moe_latent_size=s["hidden_size"] // 2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


def _from_module(arch: str, size: str) -> dict[str, Any]:
    """The family module's `tiny_config()` with our tokenizer's special tokens and float32 weights."""
    from miles_hpc.models.families import family_module

    if size != "tiny":
        raise ValueError(f"{arch} has a tiny preset only (its module's tiny_config), not {size!r}")
    cfg = dict(family_module(arch).tiny_config())
    assert cfg["vocab_size"] >= _VOCAB
    cfg.update(
        eos_token_id=special_token_id(EOS_TOKEN),
        pad_token_id=special_token_id(PAD_TOKEN),
        bos_token_id=None,
        torch_dtype="float32",
        dtype="float32",  # both spellings: a module's `dtype` would win over `torch_dtype` (config.py)
        max_position_embeddings=max(int(cfg.get("max_position_embeddings") or 0), 2048),
    )
    return cfg


def _kimi_k25(size: str) -> dict[str, Any]:
    """Kimi-K2.5: the DeepSeek-V3 preset with Kimi-K2's router traits (one expert group, routed scale 2.827, layer
    0 dense, untied head) as `text_config` (`kimi_k2`, as published), and a MoonViT tower of the same width."""
    text = preset_config("deepseek_v3", size)
    del text["architectures"], text["torch_dtype"]
    text.update(model_type="kimi_k2", n_group=1, topk_group=1, routed_scaling_factor=2.827, tie_word_embeddings=False)
    width = text["hidden_size"]
    vision = dict(
        model_type="kimi_k25_vision",
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=1,
        num_attention_heads=4,
        patch_size=14,
        pos_emb_height=8,
        pos_emb_width=8,
        pos_emb_time=4,
        merge_kernel_size=[2, 2],
        hidden_act="gelu_pytorch_tanh",
    )
    return {
        "architectures": [WRAPPERS["kimi_k25"].architecture],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": vision,
        "projection_hidden_size": width,
        "projection_layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def init_model(
    arch: str, size: str, out_dir: str | Path, *, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a random-init checkpoint (config.json, model.safetensors, generation_config.json, tokenizer files);
    `overrides`: config.json fields replacing the preset's (larger shapes for benchmarks, same tokenizer)."""
    import torch

    from miles_hpc.models import build_model, save_pretrained
    from miles_hpc.models.config import ModelConfig
    from miles_hpc.models.families import text_model
    from miles_hpc.models.tokenizer import write_tokenizer
    from miles_hpc.models.towers import TOWERS

    out = Path(out_dir)
    hf = preset_config(arch, size) | (overrides or {})
    torch.manual_seed(seed)
    model = build_model(ModelConfig.from_hf_dict(hf))
    if arch in WRAPPED_ARCHS:  # the wrapper's config and tower, carried as a loaded checkpoint's are
        model.hf_wrapper = hf
        model.hf_extra = TOWERS[arch](hf, torch.Generator().manual_seed(seed))
        hf = dict(text_model(hf))
    save_pretrained(model, out)
    gen = {"eos_token_id": hf["eos_token_id"], "pad_token_id": hf["pad_token_id"], "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out, model_max_length=hf["max_position_embeddings"])
    return out
