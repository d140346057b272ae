"""The hybrid families' config keys (issue 29): the layer pattern of Gated DeltaNet ("linear_attention") and gated
full-attention layers, the DeltaNet sizes, and the MoE with a gated shared expert; parsed from and written to
config.json as transformers 5.24's Qwen3NextConfig and Qwen3_5MoeTextConfig do, checked field by field.

Stage: shared (config.py parses with these; transformer.py builds the layers they describe).

Both families' other traits are fixed (config.py's properties): RMSNorms scale by ``1 + weight`` (zero-centred:
initialised to 0), q and k are RMS-normed per head, the full-attention query projection carries a per-head output
gate (sigmoid) beside the query, RoPE rotates the first quarter of each head (partial_rotary_factor 0.25 unless
given). Qwen3.5 (``qwen3_5_moe_text``) differs in: separate DeltaNet input projections (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), MoE in every layer with the top-k weights always renormalised, and multimodal RoPE
sections (``mrope_section``), which for text (one position per token, the same on every axis) are plain RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .linear_attn import DeltaNetDims

if TYPE_CHECKING:
    from .config import ModelConfig

LAYER_TYPES = ("linear_attention", "full_attention")
LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def hybrid_fields(d: Mapping[str, Any], get: Any, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3-Next config.json beyond the dense ones: `layer_types` (else every
    `full_attention_interval`-th layer full, default 4, as transformers), the DeltaNet sizes, the MoE keys."""
    qwen35 = d.get("model_type") == "qwen3_5_moe_text"
    types: Any = d.get("layer_types")
    if types is None:
        interval = int(d.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    return dict(
        layer_types=tuple(str(t) for t in types),
        **{k: int(get(k)) for k in LINEAR_KEYS},
        num_experts=int(d.get("num_experts") or d.get("num_local_experts") or get("num_experts") or 0),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
        norm_topk_prob=True if qwen35 else bool(d.get("norm_topk_prob", True)),
        decoder_sparse_step=1 if qwen35 else int(get("decoder_sparse_step", 1)),
        mlp_only_layers=() if qwen35 else tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )


def hybrid_keys(c: ModelConfig) -> dict[str, Any]:
    """to_hf_dict's part for a hybrid family."""
    if c.model_type == "qwen3_5_moe_text":  # MoE everywhere, renormalised top-k: no keys for either
        return dict(
            layer_types=list(c.layer_types),
            **{k: getattr(c, k) for k in LINEAR_KEYS},
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size,
            partial_rotary_factor=c.partial_rotary_factor,
        )
    return dict(
        layer_types=list(c.layer_types),
        **{k: getattr(c, k) for k in LINEAR_KEYS},
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=c.decoder_sparse_step,
        mlp_only_layers=list(c.mlp_only_layers),
        partial_rotary_factor=c.partial_rotary_factor,
    )


def check_hybrid(c: ModelConfig) -> None:
    """Field consistency of the hybrid families (and none of their fields elsewhere); each error names the field."""
    if not c.is_hybrid:
        if c.layer_types or c.shared_expert_intermediate_size or any(getattr(c, k) for k in LINEAR_KEYS):
            raise ValueError(f"layer_types / linear_* / shared_expert_*: hybrid fields; {c.model_type} has none")
        return
    if len(c.layer_types) != c.num_hidden_layers:
        raise ValueError(f"layer_types has {len(c.layer_types)} entries for num_hidden_layers={c.num_hidden_layers}")
    bad = sorted({t for t in c.layer_types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types: unknown entries {bad}; each is one of {LAYER_TYPES}")
    for k in LINEAR_KEYS:
        if "linear_attention" in c.layer_types and getattr(c, k) <= 0:
            raise ValueError(f"{k} must be positive, got {getattr(c, k)}")
    if c.model_type == "qwen3_5_moe_text":
        if c.num_experts <= 0 or not c.norm_topk_prob or c.decoder_sparse_step != 1 or c.mlp_only_layers:
            raise ValueError("qwen3_5_moe_text: every layer is MoE (num_experts > 0) with renormalised top-k weights")
    if c.num_experts:
        if c.moe_intermediate_size <= 0 or c.decoder_sparse_step <= 0:
            raise ValueError(f"{c.model_type} with experts needs moe_intermediate_size, decoder_sparse_step > 0")
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            raise ValueError(f"num_experts_per_tok={c.num_experts_per_tok} not in [1, {c.num_experts}]")
        if c.shared_expert_intermediate_size <= 0:
            raise ValueError("shared_expert_intermediate_size must be positive: every MoE layer has a shared expert")
    if "linear_attention" in c.layer_types:
        linear_dims(c)  # the heads must group


def linear_dims(c: ModelConfig) -> DeltaNetDims:
    """The Gated DeltaNet layers' sizes."""
    return DeltaNetDims(
        hidden=c.hidden_size,
        key_heads=c.linear_num_key_heads,
        value_heads=c.linear_num_value_heads,
        key_dim=c.linear_key_head_dim,
        value_dim=c.linear_value_head_dim,
        conv_width=c.linear_conv_kernel_dim,
        eps=c.rms_norm_eps,
        fused=c.model_type == "qwen3_next",  # Qwen3.5: four separate input projections
        conv_act=c.hidden_act,
    )
