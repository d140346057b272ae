"""DeepSeek-V4's config keys, checks, checkpoint names and backbone (the FAMILY_MODULES protocol of families.py):
parsed from and written to config.json as transformers 5.24's DeepseekV4Config does; layers in dsv4_attention.py
and dsv4_blocks.py.

Stage: shared (config.py parses with this module; CausalLM builds its backbone from it).

The family's fixed traits (as transformers' modeling_deepseek_v4.py computes them, whatever the config says):
- One key-value head (num_key_value_heads is ignored: written as 1), compressed queries (q_lora_rank), no
  attention or MLP biases; `intermediate_size` is an alias of `moe_intermediate_size` (the one shared expert's
  width); every layer is MoE: "hash_moe" (experts from the token id) or "moe" (top-k routed).
- Per-layer attention kinds `layer_types`: "sliding_attention", "compressed_sparse_attention" (CSA),
  "heavily_compressed_attention" (HCA), with `compress_rates` per kind (dsv4_attention.py explains them).
- RoPE: "main" (`rope_theta`, never scaled) for sliding layers, "compress" (`compress_rope_theta`, with the
  config's `rope_scaling`) for CSA/HCA layers and the indexer; both rotate the last int(head_dim *
  partial_rotary_factor) dims. ModelConfig keeps the main one as rope_theta (rope_scaling None) and the compress
  one in the spec; to_hf_dict writes the Hub's flat style (`rope_scaling` = the compress scaling).
- Legacy keys fold in as transformers folds them: `compress_ratios` (per layer 0 / 4 / 128, truncated to
  num_hidden_layers: releases list the MTP layer too), `compress_rate_csa` / `compress_rate_hca`,
  `num_hash_layers`, `qk_rope_head_dim` (= head_dim * partial_rotary_factor).
- Multi-token-prediction layers (`num_nextn_predict_layers`) are not built, as transformers builds none.

Checkpoint names: in memory (our state dict) transformers' DeepseekV4ForCausalLM names; on the Hub (what
`hub_name` gives, and what we save) the release's names without a `model.` prefix (`embed.weight`,
`layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{j}.w1.weight`, `hc_head_fn`, `head.weight`, ...), which
transformers loads. `our_name` reads those, transformers' own save_pretrained mix (`model.layers.{i}.attn.*`,
`model.embed_tokens.weight`, `head.weight`) and the in-memory names.

Engine notes (what a cached decode step keeps per layer; built in dsv4_state.py, `DSV4Backbone.new_state`):
every layer keeps the last sliding_window - 1 post-RoPE kv vectors [D]; an HCA layer also its compressed entries
so far [N, D] and the kv_proj / gate_proj rows of the current partial block (< rate tokens); a CSA layer also its
entries, the indexer's entries [N, index_head_dim], both partial blocks (2 * D and 2 * index_head_dim wide) and
the first halves of the last complete block of each (the overlap the next entry pools). The mHC streams are
recomputed per token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .config_keys import RopeScaling, parse_rope

if TYPE_CHECKING:
    from .config import ModelConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
LEGACY_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # `compress_ratios` entries, as transformers maps them
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")  # transformers 5.24 has no "softmax" activation to score with

# The release's multi-token-prediction tensors: not built (transformers builds none either), ignored by hf_io.py.
IGNORED_PREFIXES = ("mtp.",)

DEFAULTS: dict[str, Any] = dict(  # DeepseekV4Config's class defaults
    vocab_size=129280,
    hidden_size=4096,
    intermediate_size=2048,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    q_lora_rank=1024,
    num_experts_per_tok=6,
    n_routed_experts=256,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    compress_rope_theta=160000.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    sliding_window=128,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
)
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
DEFAULT_PARTIAL_ROTARY = 64 / 512


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepseekV4Spec:
    """DeepSeek-V4's own keys (ModelConfig.spec)."""

    layer_types: tuple[str, ...]
    """Attention kind per layer: one of LAYER_TYPES."""
    mlp_layer_types: tuple[str, ...]
    """MoE kind per layer: "hash_moe" (tid2eid picks the experts) or "moe" (top-k routed)."""
    csa_rate: int
    hca_rate: int
    """compress_rates: tokens per compressed entry of CSA / HCA layers."""
    compress_rope_theta: float
    compress_rope_scaling: RopeScaling | None
    """The compressed layers' RoPE (config.json's rope_scaling; yarn's attention_factor defaults to 1 here)."""
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    scoring_func: str
    num_nextn_predict_layers: int
    """Kept for the config round trip; the MTP layers are not built."""

    def compress_rate(self, kind: str) -> int:
        return {CSA: self.csa_rate, HCA: self.hca_rate}.get(kind, 0)


def _default_layer_types(n: int) -> list[str]:
    # DeepseekV4Config's default: two HCA layers, then CSA and HCA alternating.
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def _rope(d: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    """rope_theta (main), partial_rotary_factor, compress_rope_theta and the compress scaling dict (or None),
    from transformers' nested rope_parameters {"main", "compress"} or the Hub's flat keys."""
    params: Any = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, comp = params["main"], dict(params["compress"])
        partial: Any = float(main.get("partial_rotary_factor", 1.0))
        if float(comp.get("partial_rotary_factor", 1.0)) != partial:
            raise ValueError("rope_parameters: main and compress rotate different partial_rotary_factor")
        if main.get("rope_type", "default") != "default":
            raise ValueError("rope_parameters.main: DeepSeek-V4's main RoPE is never scaled (rope_type default)")
        main_theta: Any = main.get("rope_theta", DEFAULTS["rope_theta"])
        comp_theta: Any = comp.get("rope_theta")
    else:
        comp = {k: v for k, v in params.items() if k not in ("main", "compress")}
        qk_rope = d.get("qk_rope_head_dim")
        partial = d.get("partial_rotary_factor")
        if partial is None:
            partial = qk_rope / head_dim if qk_rope is not None else DEFAULT_PARTIAL_ROTARY
        main_theta = d.get("rope_theta") or comp.get("rope_theta") or DEFAULTS["rope_theta"]
        comp_theta = d.get("compress_rope_theta")
    comp_theta = float(comp_theta if comp_theta is not None else DEFAULTS["compress_rope_theta"])
    comp.pop("rope_theta", None)
    comp.pop("partial_rotary_factor", None)
    rope_type = comp.get("rope_type", comp.get("type", "default"))
    if rope_type == "yarn":
        comp.setdefault("attention_factor", 1.0)  # transformers: the V4 reference does not scale cos/sin
    if rope_type == "dynamic":
        raise ValueError("rope_scaling: dynamic RoPE is not supported for DeepSeek-V4's compressed layers")
    return dict(
        rope_theta=float(main_theta),
        partial_rotary_factor=float(partial),
        compress_rope_theta=comp_theta,
        compress_rope=None if rope_type == "default" else comp,
    )


def _types(d: Mapping[str, Any], n: int) -> tuple[list[str], list[str]]:
    """layer_types and mlp_layer_types, explicit or from the legacy keys (explicit lists must have n entries)."""
    layer_types: Any = d.get("layer_types")
    ratios = d.get("compress_ratios")
    if layer_types is None and ratios is not None:
        bad = sorted({r for r in ratios if r not in LEGACY_RATIO_TYPES})
        if bad:
            raise ValueError(f"compress_ratios: unknown entries {bad}; each is one of {sorted(LEGACY_RATIO_TYPES)}")
        if len(ratios) < n:
            raise ValueError(f"compress_ratios has {len(ratios)} entries for num_hidden_layers={n}")
        layer_types = [LEGACY_RATIO_TYPES[r] for r in ratios[:n]]
    if layer_types is None:
        layer_types = _default_layer_types(n)
    mlp_types: Any = d.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = d.get("num_hash_layers")
        n_hash = DEFAULT_HASH_LAYERS if n_hash is None else int(n_hash)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    return [str(t) for t in layer_types], [str(t) for t in mlp_types]


def canonical(d: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json with the keys config.py reads for every family: intermediate_size (transformers' alias of
    moe_intermediate_size: a given intermediate_size wins, as in DeepseekV4Config), num_key_value_heads 1, no
    attention_bias, the main RoPE flat (rope_theta, partial_rotary_factor); the V4 keys resolved for `fields`."""
    out = dict(d)
    n = int(d.get("num_hidden_layers") or DEFAULTS["num_hidden_layers"])
    inter = d.get("intermediate_size")
    inter = inter if inter is not None else d.get("moe_intermediate_size", DEFAULTS["moe_intermediate_size"])
    out["intermediate_size"] = out["moe_intermediate_size"] = int(inter)
    out["num_key_value_heads"] = 1
    out["attention_bias"] = False
    rope = _rope(d, int(d.get("head_dim") or DEFAULTS["head_dim"]))
    for key in ("rope_scaling", "rope_parameters", "compress_ratios", "num_hash_layers", "qk_rope_head_dim"):
        out.pop(key, None)
    out.update(rope)
    out["layer_types"], out["mlp_layer_types"] = _types(d, n)
    rates = dict(d.get("compress_rates") or DEFAULT_RATES)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if d.get(legacy) is not None:
            rates[kind] = d[legacy]
    out["compress_rates"] = rates
    return out


def fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields beyond the common ones, from a canonical() config.json (the spec among them)."""

    def get(key: str) -> Any:
        return d[key] if d.get(key) is not None else DEFAULTS[key]

    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true: DeepSeek-V4's experts have no biases (only the shared expert would)")
    rates = d["compress_rates"]
    unknown = sorted(set(rates) - {CSA, HCA})
    if unknown:
        raise ValueError(f"compress_rates: unknown layer types {unknown}; the compressed ones are {[CSA, HCA]}")
    comp = d["compress_rope"]
    scaling = None
    if comp is not None:
        _, scaling = parse_rope({"rope_scaling": comp}, int(get("max_position_embeddings")))
    q_rank = d.get("q_lora_rank", DEFAULTS["q_lora_rank"])
    spec = DeepseekV4Spec(
        layer_types=tuple(d["layer_types"]),
        mlp_layer_types=tuple(d["mlp_layer_types"]),
        csa_rate=int(rates.get(CSA, DEFAULT_RATES[CSA])),
        hca_rate=int(rates.get(HCA, DEFAULT_RATES[HCA])),
        compress_rope_theta=float(d["compress_rope_theta"]),
        compress_rope_scaling=scaling,
        hc_mult=int(get("hc_mult")),
        hc_sinkhorn_iters=int(get("hc_sinkhorn_iters")),
        hc_eps=float(get("hc_eps")),
        swiglu_limit=float(get("swiglu_limit")),
        sliding_window=int(get("sliding_window")),
        o_groups=int(get("o_groups")),
        o_lora_rank=int(get("o_lora_rank")),
        index_n_heads=int(get("index_n_heads")),
        index_head_dim=int(get("index_head_dim")),
        index_topk=int(get("index_topk")),
        scoring_func=str(get("scoring_func")),
        num_nextn_predict_layers=int(get("num_nextn_predict_layers")),
    )
    return dict(
        num_experts=int(d.get("n_routed_experts") or d.get("num_local_experts") or DEFAULTS["n_routed_experts"]),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        # transformers' DeepSeek-V4 builds one shared expert and renormalises the top-k whatever these keys say
        n_shared_experts=1,
        routed_scaling_factor=float(get("routed_scaling_factor")),
        norm_topk_prob=True,
        q_lora_rank=None if q_rank is None else int(q_rank),
        spec=spec,
    )


def keys(cfg: ModelConfig) -> dict[str, Any]:
    """to_hf_dict's part: DeepseekV4Config's key names; the Hub's flat RoPE style."""
    s: DeepseekV4Spec = cfg.spec
    return dict(
        intermediate_size=None,  # an alias transformers derives from moe_intermediate_size
        rope_scaling=s.compress_rope_scaling.to_hf_dict() if s.compress_rope_scaling else None,
        partial_rotary_factor=cfg.partial_rotary_factor,
        compress_rope_theta=s.compress_rope_theta,
        q_lora_rank=cfg.q_lora_rank,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        n_shared_experts=cfg.n_shared_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.norm_topk_prob,
        scoring_func=s.scoring_func,
        layer_types=list(s.layer_types),
        mlp_layer_types=list(s.mlp_layer_types),
        compress_rates={CSA: s.csa_rate, HCA: s.hca_rate},
        hc_mult=s.hc_mult,
        hc_sinkhorn_iters=s.hc_sinkhorn_iters,
        hc_eps=s.hc_eps,
        swiglu_limit=s.swiglu_limit,
        sliding_window=s.sliding_window,
        o_groups=s.o_groups,
        o_lora_rank=s.o_lora_rank,
        index_n_heads=s.index_n_heads,
        index_head_dim=s.index_head_dim,
        index_topk=s.index_topk,
        num_nextn_predict_layers=s.num_nextn_predict_layers,
    )


def _check_lists(s: DeepseekV4Spec, n: int) -> None:
    for name, values, allowed in (
        ("layer_types", s.layer_types, LAYER_TYPES),
        ("mlp_layer_types", s.mlp_layer_types, MLP_LAYER_TYPES),
    ):
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for num_hidden_layers={n}")
        bad = sorted({v for v in values if v not in allowed})
        if bad:
            raise ValueError(f"{name}: unknown entries {bad}; each is one of {allowed}")


def check(cfg: ModelConfig) -> None:
    """Field consistency of DeepSeek-V4; each error names the key."""
    s = cfg.spec
    if not isinstance(s, DeepseekV4Spec):
        raise ValueError("spec: a deepseek_v4 config needs its DeepseekV4Spec")
    _check_lists(s, cfg.num_hidden_layers)
    positive = dict(
        q_lora_rank=cfg.q_lora_rank or 0,
        n_routed_experts=cfg.num_experts,
        moe_intermediate_size=cfg.moe_intermediate_size,
        hc_mult=s.hc_mult,
        hc_sinkhorn_iters=s.hc_sinkhorn_iters,
        sliding_window=s.sliding_window,
        o_groups=s.o_groups,
        o_lora_rank=s.o_lora_rank,
    )
    if CSA in s.layer_types:
        positive.update(index_n_heads=s.index_n_heads, index_head_dim=s.index_head_dim, index_topk=s.index_topk)
        positive["compress_rates.compressed_sparse_attention"] = s.csa_rate
    if HCA in s.layer_types:
        positive["compress_rates.heavily_compressed_attention"] = s.hca_rate
    for name, value in positive.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if cfg.num_key_value_heads != 1:
        raise ValueError(f"num_key_value_heads={cfg.num_key_value_heads}: DeepSeek-V4 has one shared key-value head")
    if cfg.intermediate_size != cfg.moe_intermediate_size:
        raise ValueError("intermediate_size: DeepSeek-V4's is moe_intermediate_size (the shared expert's width)")
    if (cfg.num_attention_heads * cfg.head_dim) % s.o_groups:
        raise ValueError(f"o_groups={s.o_groups} must divide num_attention_heads * head_dim")
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} not in [1, {cfg.num_experts}]")
    if CSA in s.layer_types and cfg.rotary_dim > s.index_head_dim:
        raise ValueError(f"index_head_dim={s.index_head_dim} is narrower than the rotary dims ({cfg.rotary_dim})")
    if s.scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={s.scoring_func!r}: one of {SCORING_FUNCS}")
    if not cfg.norm_topk_prob or cfg.n_shared_experts != 1:  # a ModelConfig built by hand (config.json: read past)
        raise ValueError("deepseek_v4 always renormalises the top-k (norm_topk_prob) and has one shared expert")
    if cfg.rope_scaling is not None:
        raise ValueError("rope_scaling: DeepSeek-V4's main RoPE is unscaled (the scaling is the compress RoPE's)")
    if cfg.qkv_bias or cfg.o_bias:
        raise ValueError("deepseek_v4: no attention biases")
    if s.num_nextn_predict_layers < 0:
        raise ValueError(f"num_nextn_predict_layers must be >= 0, got {s.num_nextn_predict_layers}")


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Top-k routed ("moe") layers: the ones whose routing R3 records and replays (hash layers have none)."""
    return i < cfg.num_hidden_layers and cfg.spec.mlp_layer_types[i] == "moe"


def backbone(cfg: ModelConfig) -> nn.Module:
    from .dsv4_blocks import DSV4Backbone

    return DSV4Backbone(cfg)


# ---------------------------------------------------------------- checkpoint names
# (ours, Hub) leaf names: top level (ours under `model.` except lm_head) and within `layers.{i}.`.
_TOP = (
    ("embed_tokens.weight", "embed.weight"),
    ("norm.weight", "norm.weight"),
    ("hc_head.hc_fn", "hc_head_fn"),
    ("hc_head.hc_base", "hc_head_base"),
    ("hc_head.hc_scale", "hc_head_scale"),
)
_COMPRESSOR = (("kv_proj.weight", "wkv.weight"), ("gate_proj.weight", "wgate.weight"), ("position_bias", "ape"))
_ATTN = (
    ("sinks", "attn_sink"),
    ("q_a_proj.weight", "wq_a.weight"),
    ("q_a_norm.weight", "q_norm.weight"),
    ("q_b_proj.weight", "wq_b.weight"),
    ("kv_proj.weight", "wkv.weight"),
    ("kv_norm.weight", "norm.weight"),
    ("o_a_proj.weight", "wo_a.weight"),
    ("o_b_proj.weight", "wo_b.weight"),
    *((f"compressor.{a}", f"compressor.{b}") for a, b in (*_COMPRESSOR, ("kv_norm.weight", "norm.weight"))),
    *(
        (f"compressor.indexer.{a}", f"indexer.compressor.{b}")
        for a, b in (*_COMPRESSOR, ("kv_norm.weight", "norm.weight"))
    ),
    ("compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight"),
    ("compressor.indexer.scorer.weights_proj.weight", "indexer.weights_proj.weight"),
)
_SWIGLU = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_LAYER = (
    *((f"self_attn.{a}", f"attn.{b}") for a, b in _ATTN),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.experts.gate_up_proj", "ffn.experts.gate_up_proj"),  # fused (transformers' in-memory layout)
    ("mlp.experts.down_proj", "ffn.experts.down_proj"),
    *((f"mlp.shared_experts.{a}.weight", f"ffn.shared_experts.{b}.weight") for a, b in _SWIGLU.items()),
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    *((f"{hc}_hc.{p}", f"hc_{hc}_{p}") for hc in ("attn", "ffn") for p in ("fn", "base", "scale")),
)
_TOP_TO_HUB, _TOP_TO_OURS = dict(_TOP), {b: a for a, b in _TOP}
_LAYER_TO_HUB, _LAYER_TO_OURS = dict(_LAYER), {b: a for a, b in _LAYER}
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"^(?:mlp|ffn)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_OURS_SWIGLU = {**{v: k for k, v in _SWIGLU.items()}, **{k: k for k in _SWIGLU}}


def our_name(name: str) -> str:
    """Our (transformers' in-memory) name of a Hub, transformers-saved or in-memory tensor name; per-expert tensors
    as `model.layers.{i}.mlp.experts.{j}.gate_proj|up_proj|down_proj.weight`; an unknown name as it is."""
    if name in ("lm_head.weight", "head.weight"):
        return "lm_head.weight"
    rest = name.removeprefix("model.")
    if rest in _TOP_TO_OURS or rest in _TOP_TO_HUB:
        return "model." + _TOP_TO_OURS.get(rest, rest)
    m = _LAYER_NAME.match(rest)
    if m is None:
        return name
    i, leaf = m.groups()
    if leaf in _LAYER_TO_OURS or leaf in _LAYER_TO_HUB:
        return f"model.layers.{i}.{_LAYER_TO_OURS.get(leaf, leaf)}"
    e = _EXPERT_NAME.match(leaf)
    if e is not None:
        return f"model.layers.{i}.mlp.experts.{e.group(1)}.{_OURS_SWIGLU[e.group(2)]}.weight"
    return name


def hub_name(name: str) -> str:
    """The Hub's name of ours (or of any name `our_name` reads); a Hub name as it is; an unknown name as it is."""
    ours = our_name(name)
    if ours == "lm_head.weight":
        return "head.weight"
    rest = ours.removeprefix("model.")
    if rest in _TOP_TO_HUB:
        return _TOP_TO_HUB[rest]
    m = _LAYER_NAME.match(rest)
    if m is None or not ours.startswith("model."):
        return name
    i, leaf = m.groups()
    if leaf in _LAYER_TO_HUB:
        return f"layers.{i}.{_LAYER_TO_HUB[leaf]}"
    e = _EXPERT_NAME.match(leaf)
    if e is not None:
        return f"layers.{i}.ffn.experts.{e.group(1)}.{_SWIGLU[_OURS_SWIGLU[e.group(2)]]}.weight"
    return name


def tiny_config() -> dict[str, Any]:
    """A config.json for `miles-hpc init-model --arch deepseek_v4 --size tiny`: every attention kind (sliding,
    CSA, HCA) and both MoE kinds, rates small enough that short prompts fill several compressed entries.

    The indexer keeps 16 heads (the release has 64): an entry's score is a sum over heads of ReLU(q . k), exactly 0
    when every head's dot product is negative (2^-heads of the entries), and torch.topk breaks such ties by the
    length of the row; with 2 heads a query would pick different entries in a sequence cut short (the engine's
    prefix) than in the whole sample (the trainer's), as the DSA presets would (docs/models.md)."""
    return dict(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, attention_factor=1.0),
        layer_types=[SLIDING, CSA, HCA, CSA, HCA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        sliding_window=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        hc_mult=2,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=10.0,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,  # not fewer: see the docstring
        index_head_dim=16,
        index_topk=4,
        num_nextn_predict_layers=0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        dtype="float32",
    )


__all__ = ["DEFAULTS", "DeepseekV4Spec", "backbone", "canonical", "check", "fields", "hub_name", "keys", "our_name"]
