"""Nemotron-H's config keys (issue 29): the block pattern of Mamba-2 ("M"), attention ("*"), MoE ("E") and MLP ("-")
layers, the Mamba-2 sizes, and the MoE with a sigmoid group-limited router, non-gated experts, one shared expert and
an optional latent projection; parsed from and written to config.json as transformers 5.24's NemotronHConfig does.

Stage: shared (config.py parses with these; mixer_blocks.py builds the blocks they describe).

The family's fixed traits (as transformers' modeling_nemotron_h.py computes them, whatever the config says):
- A block is one pre-norm and one mixer (``model.layers.{i}.norm``, ``.mixer``); the model's names are
  ``model.embeddings``, ``model.norm_f`` (``backbone.*`` on the Hub), ``lm_head``; the head is never tied
  (transformers ties nothing for this family: a config asking for it is refused rather than mis-computed).
- Attention has no RoPE, no QK-norm and no biases (``attention_bias`` is ignored by transformers too); the MLP and
  the experts are ``down(relu(up(x))^2)`` (``mlp_hidden_act`` relu2), biased when ``mlp_bias``.
- The RMSNorms multiply by the weight in float32 and cast after (unlike Llama's).
- Multi-token-prediction layers (``num_nextn_predict_layers``) are not built, as transformers builds none: their
  tensors (``mtp.*``) are refused by the loader rather than dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .mamba2 import Mamba2Dims

if TYPE_CHECKING:
    from .config import ModelConfig

BLOCK_TYPES = ("linear_attention", "full_attention", "moe", "mlp")  # M, *, E, -
PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap of older names
# config.json key -> ModelConfig field (the Mamba-2 sizes); older configs spell some of them mamba_* (first wins).
MAMBA_KEYS: dict[str, tuple[str, ...]] = {
    "mamba_num_heads": ("mamba_num_heads",),
    "mamba_head_dim": ("mamba_head_dim",),
    "ssm_state_size": ("ssm_state_size",),
    "mamba_n_groups": ("n_groups", "mamba_n_groups"),
    "mamba_conv_kernel": ("conv_kernel", "mamba_d_conv"),
    "mamba_chunk_size": ("chunk_size", "mamba_chunk_size"),
}
DEFAULTS: dict[str, Any] = dict(  # NemotronHConfig's class defaults for the keys above and the MoE's
    mamba_num_heads=128,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
    chunk_size=128,
    time_step_min=0.001,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=7688,
    moe_shared_expert_intermediate_size=7688,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
)


def canonical(d: Mapping[str, Any]) -> dict[str, Any]:
    """A Nemotron-H config.json with the keys config.py reads for every family: ``num_hidden_layers`` (the
    pattern's length, as transformers derives it), ``rms_norm_eps`` (``layer_norm_epsilon``), ``hidden_act``
    (``mlp_hidden_act``), no ``attention_bias`` (ignored by the family)."""
    out = dict(d)
    out["layer_types"] = block_types(d)
    out["num_hidden_layers"] = len(out["layer_types"])
    out["rms_norm_eps"] = d.get("layer_norm_epsilon", 1e-5)
    out["hidden_act"] = d.get("mlp_hidden_act", "relu2")
    out["attention_bias"] = False
    return out


def block_types(d: Mapping[str, Any]) -> list[str]:
    """Per layer, one of BLOCK_TYPES: ``layers_block_type`` (or ``layer_types``), else ``hybrid_override_pattern``
    (M * E -), else transformers' default (M E * -)."""
    types: Any = d.get("layers_block_type") or d.get("layer_types")
    if types is None:
        pattern = d.get("hybrid_override_pattern")
        if pattern is None:
            return ["linear_attention", "moe", "full_attention", "mlp"]
        bad = sorted(set(str(pattern)) - set(PATTERN))
        if bad:
            raise ValueError(f"hybrid_override_pattern {pattern!r}: unknown characters {bad} (each is one of M * E -)")
        return [PATTERN[ch] for ch in str(pattern)]
    return [LEGACY_TYPES.get(str(t), str(t)) for t in types]


def nemotron_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a (canonical) Nemotron-H config.json beyond the dense ones."""

    def first(*keys: str) -> Any:
        for k in keys:
            if d.get(k) is not None:
                return d[k]
        return DEFAULTS[keys[0]] if keys[0] in DEFAULTS else DEFAULTS[keys[-1]]

    if d.get("mamba_hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"mamba_hidden_act={d.get('mamba_hidden_act')!r}: the Mamba-2 layers use silu")
    mamba = {field: int(first(*keys)) for field, keys in MAMBA_KEYS.items()}
    latent = d.get("moe_latent_size")
    return dict(
        layer_types=tuple(d["layer_types"]),
        **mamba,
        mamba_conv_bias=bool(d["use_conv_bias"] if "use_conv_bias" in d else d.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(d.get("use_bias", False)),
        mamba_dt_min=float(first("time_step_min", "mamba_dt_min")),
        mlp_bias=bool(d.get("mlp_bias", False)),
        num_experts=int(first("n_routed_experts", "num_local_experts")),
        num_experts_per_tok=int(first("num_experts_per_tok")),
        moe_intermediate_size=int(first("moe_intermediate_size")),
        shared_expert_intermediate_size=int(first("moe_shared_expert_intermediate_size")),
        moe_latent_size=0 if latent is None else int(latent),
        n_group=int(first("n_group")),
        topk_group=int(first("topk_group")),
        routed_scaling_factor=float(first("routed_scaling_factor")),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
    )


def nemotron_keys(c: ModelConfig) -> dict[str, Any]:
    """to_hf_dict's part (NemotronHConfig's key names; the generic ones config.py writes are renamed here)."""
    return dict(
        layers_block_type=list(c.layer_types),
        layer_norm_epsilon=c.rms_norm_eps,
        mlp_hidden_act=c.hidden_act,
        mlp_bias=c.mlp_bias,
        mamba_num_heads=c.mamba_num_heads,
        mamba_head_dim=c.mamba_head_dim,
        ssm_state_size=c.ssm_state_size,
        n_groups=c.mamba_n_groups,
        conv_kernel=c.mamba_conv_kernel,
        chunk_size=c.mamba_chunk_size,
        use_conv_bias=c.mamba_conv_bias,
        use_bias=c.mamba_proj_bias,
        time_step_min=c.mamba_dt_min,
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        moe_latent_size=c.moe_latent_size or None,
        n_group=c.n_group,
        topk_group=c.topk_group,
        routed_scaling_factor=c.routed_scaling_factor,
        norm_topk_prob=c.norm_topk_prob,
    )


DROPPED_KEYS = ("rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling", "attention_bias", "num_hidden_layers")


def check_nemotron(c: ModelConfig) -> None:
    """Field consistency of Nemotron-H; each error names the field."""
    if len(c.layer_types) != c.num_hidden_layers:
        raise ValueError(f"layers_block_type has {len(c.layer_types)} entries for {c.num_hidden_layers} layers")
    bad = sorted({t for t in c.layer_types if t not in BLOCK_TYPES})
    if bad:
        raise ValueError(f"layers_block_type: unknown entries {bad}; each is one of {BLOCK_TYPES}")
    if c.hidden_act != "relu2":
        raise ValueError(f"mlp_hidden_act={c.hidden_act!r}: Nemotron-H's MLPs and experts are relu2")
    if c.tie_word_embeddings or c.qkv_bias or c.o_bias:
        raise ValueError("nemotron_h: no tied head, no attention biases (transformers builds neither)")
    if "linear_attention" in c.layer_types:
        mamba_dims(c)  # the heads must group
        if min(c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_conv_kernel) <= 0:
            raise ValueError("mamba_num_heads, mamba_head_dim, ssm_state_size, conv_kernel must be positive")
    if "moe" in c.layer_types:
        if min(c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size) <= 0:
            raise ValueError("n_routed_experts, moe_intermediate_size, moe_shared_expert_intermediate_size must be > 0")
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            raise ValueError(f"num_experts_per_tok={c.num_experts_per_tok} not in [1, {c.num_experts}]")
        if c.num_experts % c.n_group or not 0 < c.topk_group <= c.n_group or c.num_experts // c.n_group < 2:
            raise ValueError(
                f"n_group={c.n_group} must divide n_routed_experts={c.num_experts} into groups of >= 2 experts and "
                f"hold topk_group={c.topk_group}"
            )
    if c.moe_latent_size < 0:
        raise ValueError(f"moe_latent_size must be positive or absent, got {c.moe_latent_size}")


def mamba_dims(c: ModelConfig) -> Mamba2Dims:
    """The Mamba-2 layers' sizes."""
    return Mamba2Dims(
        hidden=c.hidden_size,
        heads=c.mamba_num_heads,
        head_dim=c.mamba_head_dim,
        state=c.ssm_state_size,
        groups=c.mamba_n_groups,
        conv_width=c.mamba_conv_kernel,
        conv_bias=c.mamba_conv_bias,
        proj_bias=c.mamba_proj_bias,
        dt_min=c.mamba_dt_min,
        eps=c.rms_norm_eps,
        chunk=c.mamba_chunk_size,
    )
