"""The Inkling text model family (`inkling_text`, transformers 5.24's InklingTextConfig / InklingForCausalLM): its
config keys, checks and backbone, as one FAMILY_MODULES module (see families.py for the protocol).

Stage: shared (config.py parses with these; the engine and the trainer build the backbone).

The family, as transformers' modeling_inkling.py computes it (the layers: inkling_attention.py, inkling_blocks.py):
- No RoPE. Token order reaches attention through per-query relative logits (a learned bias per backward distance,
  zero at distance >= the layer's extent) and through short causal depthwise convolutions with a residual, which
  run on k and v inside attention and on the outputs of attention and of the MLP (four per layer, float32).
- Two attention layouts: "hybrid_sliding" layers (swa_* heads, a window of `sliding_window_size` keys, relative
  extent = the window) and "hybrid" global layers (the common head keys, relative extent `rel_extent`, optional
  logarithmic query scaling from `log_scaling_n_floor`). q and k are RMS-normed per head; the softmax scale is
  1 / head_dim.
- MLPs are "dense" (SwiGLU times a learned scalar) or "sparse": a sigmoid router over routed and shared experts
  whose top-k routed logits and the shared ones are normalised together (the shared experts are a softmax sink),
  times route_scale and a learned scalar.
- The embedding is RMS-normed (`embed_tokens.embed_norm`); the final hidden state is divided by
  `logits_mup_width_multiplier` before the head (folded into `model.norm` here, so CausalLM stays generic); the
  head is never tied; with `unpadded_vocab_size` the logits past it are dropped (`trim_logits`: CausalLM must
  apply it, it holds the head).

Invariants:
- `ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg`, and transformers' AutoConfig reads `keys(cfg)` as the same
  architecture (InklingTextConfig's key names).
- Every Inkling-only key lives in `InklingSpec` (hashable: tuples, no lists).
- The state dict is transformers' in-memory one; transformers' save_pretrained writes it unchanged for this model
  type (fused `mlp.experts.gate_up_proj` / `down_proj`, no `.weight`): `FUSED_EXPERTS` says so to hf_io.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .config import ModelConfig

MODEL_TYPE = "inkling_text"
LAYER_TYPES = ("hybrid_sliding", "hybrid")  # sliding-window, global
MLP_TYPES = ("dense", "sparse")
# The Hub and transformers hold the routed experts fused under their in-memory names (no per-expert tensors).
FUSED_EXPERTS = True

# InklingTextConfig's class defaults for the keys every family has (families.FAMILY_DEFAULTS' shape).
DEFAULTS: dict[str, Any] = dict(
    vocab_size=201024,
    hidden_size=6144,
    intermediate_size=24576,
    num_hidden_layers=66,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
)
# ... and for its own keys.
SPEC_DEFAULTS: dict[str, Any] = dict(
    swa_num_attention_heads=64,
    swa_num_key_value_heads=16,
    swa_head_dim=128,
    sliding_window_size=512,
    d_rel=16,
    rel_extent=1024,
    log_scaling_n_floor=None,
    log_scaling_alpha=0.1,
    conv_kernel_size=4,
    shared_expert_sink=True,
    route_scale=8.0,
    logits_mup_width_multiplier=24.0,
    rms_norm_eps_moe_gate=1e-6,
    unpadded_vocab_size=None,
    num_mtp_layers=None,
    chain_hidden_post_norm=False,
    mtp_hidden_states_first=True,
    mtp_local_layer_ids=None,
)
MOE_DEFAULTS: dict[str, Any] = dict(
    n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=3072
)
# InklingTextConfig.attribute_map: another spelling -> the key (checkpoints write some of these).
ALIASES: dict[str, str] = {
    "embedding_multiplier": "logits_mup_width_multiplier",
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class InklingSpec:
    """Inkling's own keys (InklingTextConfig's names), parsed with its defaults and derivations."""

    layer_types: tuple[str, ...]
    """Per layer, "hybrid_sliding" (sliding-window attention) or "hybrid" (global)."""
    mlp_layer_types: tuple[str, ...]
    """Per layer, "dense" (SwiGLU) or "sparse" (MoE)."""
    swa_num_attention_heads: int
    swa_num_key_value_heads: int
    swa_head_dim: int
    sliding_window_size: int
    """A sliding layer's query attends to the keys at distance 0 .. sliding_window_size - 1."""
    d_rel: int
    """Width of each head's relative state (r_proj), mixed by rel_logits_proj.proj [d_rel, extent]."""
    rel_extent: int
    """Global layers' relative-logit extent (sliding layers': sliding_window_size); the bias is 0 beyond."""
    log_scaling_n_floor: int | None
    """Global layers: queries at position p >= n_floor are scaled by 1 + alpha * log((p + 1) / n_floor)."""
    log_scaling_alpha: float
    conv_kernel_size: int
    shared_expert_sink: bool
    route_scale: float
    logits_mup_width_multiplier: float
    rms_norm_eps_moe_gate: float
    """Kept for the config's round trip; transformers' router applies no norm (neither do we)."""
    unpadded_vocab_size: int | None
    """The logits are cut to this many columns (the head and embedding keep vocab_size rows)."""
    num_mtp_layers: int | None
    """Multi-token-prediction keys: kept for the round trip; transformers builds no MTP layers (nor do we)."""
    chain_hidden_post_norm: bool
    mtp_hidden_states_first: bool
    mtp_local_layer_ids: tuple[int, ...] | None


def canonical(d: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json with InklingTextConfig's aliases resolved, its derivations applied (`dense_intermediate_size`
    checkpoints: `intermediate_size` is the experts' width), `layer_types` / `mlp_layer_types` filled in, and the
    keys the family does not have removed (RoPE, attention_bias, tie_word_embeddings: transformers never ties)."""
    out = dict(d)
    for alias, key in ALIASES.items():
        if out.get(alias) is not None:  # transformers: the alias wins over the key
            out[key] = out[alias]
        out.pop(alias, None)
    if out.get("dense_intermediate_size") is not None:
        out["moe_intermediate_size"] = out.get("intermediate_size", DEFAULTS["intermediate_size"])
        out["intermediate_size"] = out.pop("dense_intermediate_size")
    n = int(out.get("num_hidden_layers") or DEFAULTS["num_hidden_layers"])
    if out.get("layer_types") is None:
        local = out.get("local_layer_ids")
        sliding = set(local) if local is not None else {i for i in range(n) if (i + 1) % 6}
        out["layer_types"] = ["hybrid_sliding" if i in sliding else "hybrid" for i in range(n)]
    if out.get("mlp_layer_types") is None:
        dense = int(out.get("dense_mlp_idx") or 0)
        out["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(n)]
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias"):
        out.pop(key, None)
    out["tie_word_embeddings"] = False  # InklingForCausalLM ties nothing, whatever the file says
    out.setdefault("bos_token_id", 1)  # InklingTextConfig's defaults
    out.setdefault("eos_token_id", 2)
    return out


def fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a canonical config.json beyond the common ones: the MoE sizes and `spec`."""

    def get(key: str) -> Any:
        value = d.get(key)
        return (SPEC_DEFAULTS | MOE_DEFAULTS).get(key) if value is None else value

    if float(d.get("attention_dropout") or 0.0) != 0.0:
        raise ValueError(f"attention_dropout={d['attention_dropout']}: attention dropout is not built (use 0.0)")
    floor, unpadded, mtp_local = get("log_scaling_n_floor"), get("unpadded_vocab_size"), get("mtp_local_layer_ids")
    spec = InklingSpec(
        layer_types=tuple(str(t) for t in d["layer_types"]),
        mlp_layer_types=tuple(str(t) for t in d["mlp_layer_types"]),
        swa_num_attention_heads=int(get("swa_num_attention_heads")),
        swa_num_key_value_heads=int(get("swa_num_key_value_heads")),
        swa_head_dim=int(get("swa_head_dim")),
        sliding_window_size=int(get("sliding_window_size")),
        d_rel=int(get("d_rel")),
        rel_extent=int(get("rel_extent")),
        log_scaling_n_floor=None if floor is None else int(floor),
        log_scaling_alpha=float(get("log_scaling_alpha")),
        conv_kernel_size=int(get("conv_kernel_size")),
        shared_expert_sink=bool(get("shared_expert_sink")),
        route_scale=float(get("route_scale")),
        logits_mup_width_multiplier=float(get("logits_mup_width_multiplier")),
        rms_norm_eps_moe_gate=float(get("rms_norm_eps_moe_gate")),
        unpadded_vocab_size=None if unpadded is None else int(unpadded),
        num_mtp_layers=None if get("num_mtp_layers") is None else int(get("num_mtp_layers")),
        chain_hidden_post_norm=bool(get("chain_hidden_post_norm")),
        mtp_hidden_states_first=bool(get("mtp_hidden_states_first")),
        mtp_local_layer_ids=None if mtp_local is None else tuple(int(i) for i in mtp_local),
    )
    return dict(
        num_experts=int(get("n_routed_experts")),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        n_shared_experts=int(get("n_shared_experts")),
        spec=spec,
    )


def keys(c: ModelConfig) -> dict[str, Any]:
    """to_hf_dict's part: InklingTextConfig's names; None drops the common keys the family has not."""
    s: InklingSpec = c.spec
    out: dict[str, Any] = {name: getattr(s, name) for name in InklingSpec.__slots__}
    out.update(
        layer_types=list(s.layer_types),
        mlp_layer_types=list(s.mlp_layer_types),
        mtp_local_layer_ids=None if s.mtp_local_layer_ids is None else list(s.mtp_local_layer_ids),
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        n_shared_experts=c.n_shared_experts,
        rope_theta=None,
        rope_scaling=None,
        attention_bias=None,
        tie_word_embeddings=None,
    )
    return out


def _positive(c: ModelConfig, s: InklingSpec) -> None:
    sizes = dict(
        swa_num_attention_heads=s.swa_num_attention_heads,
        swa_num_key_value_heads=s.swa_num_key_value_heads,
        swa_head_dim=s.swa_head_dim,
        sliding_window_size=s.sliding_window_size,
        d_rel=s.d_rel,
        rel_extent=s.rel_extent,
        conv_kernel_size=s.conv_kernel_size,
        logits_mup_width_multiplier=s.logits_mup_width_multiplier,
    )
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if s.swa_num_attention_heads % s.swa_num_key_value_heads:
        raise ValueError(
            f"swa_num_attention_heads={s.swa_num_attention_heads} is not a multiple of "
            f"swa_num_key_value_heads={s.swa_num_key_value_heads}"
        )
    if s.log_scaling_n_floor is not None and s.log_scaling_n_floor <= 0:
        raise ValueError(f"log_scaling_n_floor must be positive or null, got {s.log_scaling_n_floor}")
    if s.unpadded_vocab_size is not None and not 0 < s.unpadded_vocab_size <= c.vocab_size:
        raise ValueError(f"unpadded_vocab_size={s.unpadded_vocab_size} not in [1, vocab_size={c.vocab_size}]")


def check(c: ModelConfig) -> None:
    """Field consistency; each error names the key."""
    s = c.spec
    if not isinstance(s, InklingSpec):
        raise ValueError(f"spec: {MODEL_TYPE} needs its InklingSpec, got {type(s).__name__}")
    n = c.num_hidden_layers
    for name, values, allowed in (
        ("layer_types", s.layer_types, LAYER_TYPES),
        ("mlp_layer_types", s.mlp_layer_types, MLP_TYPES),
    ):
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for num_hidden_layers={n}")
        bad = sorted({v for v in values if v not in allowed})
        if bad:
            raise ValueError(f"{name}: unknown entries {bad}; each is one of {allowed}")
    _positive(c, s)
    if c.tie_word_embeddings:
        raise ValueError("tie_word_embeddings=true: Inkling's head is never tied (transformers ties nothing)")
    if c.qkv_bias or c.o_bias or c.mlp_bias:
        raise ValueError("attention_bias / mlp_bias: Inkling's projections have no biases")
    if not s.shared_expert_sink:
        # transformers 5.24 always normalises the shared experts' logits with the routed ones (it never reads the
        # flag): a checkpoint asking otherwise would be mis-computed by it and by us alike.
        raise ValueError("shared_expert_sink=false is not supported (transformers 5.24 always sinks)")
    if "sparse" in s.mlp_layer_types:
        if min(c.num_experts, c.moe_intermediate_size) <= 0:
            raise ValueError("n_routed_experts and moe_intermediate_size must be positive")
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            raise ValueError(
                f"num_experts_per_tok={c.num_experts_per_tok} not in [1, n_routed_experts={c.num_experts}]"
            )
        if c.n_shared_experts <= 0:
            # transformers slices the router's last n_shared_experts columns: with none it routes nothing.
            raise ValueError(f"n_shared_experts={c.n_shared_experts}: Inkling's MoE needs at least one shared expert")


def is_moe_layer(c: ModelConfig, i: int) -> bool:
    return i < c.num_hidden_layers and c.spec.mlp_layer_types[i] == "sparse"


def backbone(c: ModelConfig) -> nn.Module:
    from .inkling_blocks import InklingBackbone

    return InklingBackbone(c)


def trim_logits(c: ModelConfig, logits: torch.Tensor) -> torch.Tensor:
    """The logits transformers returns: the first `unpadded_vocab_size` columns (all when it is null). CausalLM's
    head gives vocab_size columns; the padded ones are not tokens (transformers drops them before any softmax)."""
    n = c.spec.unpadded_vocab_size
    return logits if n is None or n >= logits.shape[-1] else logits[..., :n]


def tiny_config() -> dict[str, Any]:
    """A config.json for `init-model`: 4 layers with every kind (sliding and global attention with different head
    layouts, dense and MoE MLPs, log scaling, a padded vocabulary)."""
    return dict(
        architectures=["InklingForCausalLM"],
        model_type=MODEL_TYPE,
        vocab_size=512,
        unpadded_vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=2,
        swa_num_key_value_heads=1,
        swa_head_dim=24,
        sliding_window_size=16,
        d_rel=4,
        rel_extent=32,
        log_scaling_n_floor=8,
        log_scaling_alpha=0.1,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        conv_kernel_size=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        route_scale=2.0,
        # muP's width multiplier is the model's width over its base width (the release: 24 at 6,144). At 64 wide
        # it is 1 at most; 4 divided the tiny head's logits by 4 and its warm-up learned 3x slower (docs/models.md).
        logits_mup_width_multiplier=1.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )
