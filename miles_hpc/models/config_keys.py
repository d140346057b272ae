"""The config.json keys that several families share, parsed for config.py: RoPE (both key styles, partial
rotation) and the DeepSeek-V3 / GLM-4.5 router with MLA's sizes.

Stage: shared (config.py parses with these).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .families import MODEL_TYPE_ALIASES, SUPPORTED_ROPE_TYPES


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """RoPE scaling parameters, named as in HF `rope_scaling` / `rope_parameters` (absent keys stay None)."""

    rope_type: str
    """One of SUPPORTED_ROPE_TYPES except "default" (no scaling is `ModelConfig.rope_scaling=None`)."""
    factor: float | None = None
    """Context extension factor (linear, dynamic, llama3, yarn); yarn derives it from the lengths when None."""
    original_max_position_embeddings: int | None = None
    """Pre-training context length (llama3, yarn)."""
    low_freq_factor: float | None = None
    """llama3 only."""
    high_freq_factor: float | None = None
    """llama3 only."""
    attention_factor: float | None = None
    """yarn: scale on cos/sin; derived from factor (and mscale) when None."""
    beta_fast: float | None = None
    """yarn: extrapolation boundary (HF default 32)."""
    beta_slow: float | None = None
    """yarn: interpolation boundary (HF default 1)."""
    mscale: float | None = None
    """yarn (DeepSeek style): numerator mscale."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek style): denominator mscale."""
    truncate: bool | None = None
    """yarn: floor/ceil the correction range (HF default True)."""

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES or self.rope_type == "default":
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES[1:]}")
        needs: dict[str, tuple[str, ...]] = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("original_max_position_embeddings",),
        }
        missing = [k for k in needs[self.rope_type] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"rope_scaling of type {self.rope_type!r} needs {missing}")

    def to_hf_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def group_router_fields(d: Mapping[str, Any], get: Any, *, mla: bool) -> dict[str, Any]:
    """The router keys of a DeepSeek-V3 or GLM-4.5 MoE config.json, plus MLA's for DeepSeek-V3 (transformers 5.24
    DeepseekV3Config / Glm4MoeConfig defaults)."""
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(
            "only the sigmoid router with noaux_tc top-k (DeepSeek-V3, Kimi-K2, GLM-4.5) is supported, "
            f"got scoring_func={d.get('scoring_func')!r}, topk_method={d.get('topk_method')!r}"
        )
    out: dict[str, Any] = dict(
        num_experts=int(d.get("n_routed_experts") or d.get("num_local_experts") or get("num_experts")),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        n_shared_experts=int(get("n_shared_experts")),
        n_group=int(get("n_group")),
        topk_group=int(get("topk_group")),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        first_k_dense_replace=int(get("first_k_dense_replace")),
    )
    if mla:
        q_rank = d.get("q_lora_rank", get("q_lora_rank"))
        out.update(
            q_lora_rank=None if q_rank is None else int(q_rank),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            rope_interleave=bool(get("rope_interleave", True)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
        )
    return out


def partial_rotary(d: Mapping[str, Any]) -> float:
    """`partial_rotary_factor`, in rope_parameters or else top level (transformers keeps the rope dict's value when
    both are given); defaults: glm4_moe 0.5, the Qwen hybrids 0.25."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))  # the rope dict wins (transformers)
    if value is None:
        mt = str(d.get("model_type"))
        return {"glm4_moe": 0.5, "qwen3_next": 0.25, "qwen3_5_moe_text": 0.25}.get(MODEL_TYPE_ALIASES.get(mt, mt), 1.0)
    return float(value)


def parse_rope(d: Mapping[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """RoPE from either key style: Hub `rope_theta` + `rope_scaling`, or transformers 5 `rope_parameters`."""
    if d.get("use_sliding_window"):
        # Qwen2/Qwen3 sliding-window layers are off in every released checkpoint; refuse rather than mis-compute.
        raise ValueError("use_sliding_window=true is not supported")
    # transformers 5: `rope_scaling` (legacy) wins over `rope_parameters` when both are present.
    params: dict[str, Any] = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # `_partial_rotary` reads it
    for key in ("mrope_section", "mrope_interleaved"):  # multimodal RoPE's axes: plain RoPE for text (models/hybrid.py)
        params.pop(key, None)
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        # transformers gives a top-level original_max_position_embeddings priority, then falls back to max_pos.
        top = d.get("original_max_position_embeddings")
        if top is not None:
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"rope_scaling of type {rope_type!r} has unsupported keys {unknown}")
    return theta, RopeScaling(rope_type=rope_type, **params)


def qwen3_moe_fields(d: Mapping[str, Any], get: Any) -> dict[str, Any]:
    """The MoE keys of a Qwen3-MoE config.json (transformers 5.24 Qwen3MoeConfig defaults through `get`)."""
    return dict(
        # transformers 5 writes `num_local_experts` (Qwen3MoeConfig.attribute_map), the Hub `num_experts`
        num_experts=int(d.get("num_experts") or d.get("num_local_experts") or get("num_experts")),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )
