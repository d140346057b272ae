"""Typed architecture config for the model families in `miles_hpc.models`, parsed from and written to HF `config.json`.

Stage: shared (engine and trainer both build models from it).

Invariants:
- `ModelConfig` is frozen; `from_hf_dict(d)` reproduces what transformers 5.x makes of the same dict (its per-class
  defaults for absent keys, `rope_scaling` winning over `rope_parameters`, `num_local_experts` as an alias of
  `num_experts`), so a model built from it computes what transformers computes.
- `to_hf_dict()` writes the Hub's long-standing key style (`rope_theta` + `rope_scaling`, `torch_dtype`,
  `num_experts`), which transformers 4.x and 5.x, SGLang and vLLM all read; `from_hf_dict(to_hf_dict())` is identity.
- Attention biases are two flags because the families differ: Llama/Qwen3 put `attention_bias` on q, k, v and o;
  Qwen2 always has a q/k/v bias and never an o bias.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .config_keys import RopeScaling, group_router_fields, parse_rope, partial_rotary, qwen3_moe_fields
from .families import (
    ARCHITECTURES,
    DELTANET_TYPES,
    DSA_TYPES,
    FAMILY_DEFAULTS,
    GROUP_ROUTER_TYPES,
    HYBRID_TYPES,
    INDEXER_ROPE_INTERLEAVED,
    MLA_TYPES,
    MODEL_TYPE_ALIASES,
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_MODEL_TYPES,
    check_dsa,
    dsa_fields,
    family_module,
    text_model,
)
from .hybrid import check_hybrid, hybrid_fields, hybrid_keys
from .nemotron import DROPPED_KEYS, canonical, check_nemotron, nemotron_fields, nemotron_keys


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Architecture of one dense (llama, qwen2, qwen3), MoE (qwen3_moe, deepseek_v3, glm4_moe, deepseek_v32,
    glm_moe_dsa) or hybrid (qwen3_next, qwen3_5_moe_text: Gated DeltaNet and attention layers, hybrid.py;
    nemotron_h: Mamba-2, attention, MoE and MLP blocks, nemotron.py) decoder-only model."""

    model_type: str
    """HF model_type; one of SUPPORTED_MODEL_TYPES."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """FFN width of dense layers (in qwen3_moe: of the layers that `is_moe_layer` says are dense)."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """GQA: each kv head serves num_attention_heads // num_key_value_heads query heads."""
    head_dim: int
    """May differ from hidden_size // num_attention_heads (e.g. Qwen3)."""
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    """Bias on q_proj, k_proj, v_proj."""
    o_bias: bool = False
    """Bias on o_proj."""
    mlp_bias: bool = False
    """Bias on the dense SwiGLU projections (llama `mlp_bias`)."""
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    # ---- deepseek_v3 (MLA attention, sigmoid group-limited router, shared experts); 0 / None elsewhere ----
    q_lora_rank: int | None = None
    """MLA: rank of the query compression (None: one q_proj)."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed KV latent."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without RoPE; with qk_rope_head_dim (= head_dim, the rotary width) the
    attention width qk_head_dim."""
    v_head_dim: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    """Router: experts are chosen only from the topk_group of n_group groups with the best top-2 sums."""
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    """Layers 0..first_k_dense_replace-1 are dense; every later layer is MoE (unless mlp_layer_types says)."""
    mlp_layer_types: tuple[str, ...] = ()
    """DSA families: "dense" or "sparse" (MoE) per layer; () = the first_k_dense_replace rule."""
    # ---- DeepSeek sparse attention (deepseek_v32, glm_moe_dsa): the lightning indexer; 0 / () elsewhere ----
    index_n_heads: int = 0
    index_head_dim: int = 0
    """Indexer query heads and their width (the one indexer key per token has this width too)."""
    index_topk: int = 0
    """Each query attends to the index_topk cached tokens its indexer scores highest (all of them when fewer)."""
    indexer_types: tuple[str, ...] = ()
    """glm_moe_dsa: "full" (the layer runs its indexer) or "shared" (reuses the previous full layer's top-k) per
    layer; () = every layer full."""
    num_nextn_predict_layers: int = 0
    """MLA families: multi-token-prediction layers, held as `model.layers.{num_hidden_layers + j}` (mtp.py)."""
    rope_interleave: bool = False
    """RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... instead of the two halves."""
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first int(head_dim * factor) dims of each head and passes the rest (glm4_moe: 0.5)."""
    use_qk_norm: bool = False
    """glm4_moe: per-head RMSNorm on q and k (qwen3 families always have it)."""
    # ---- hybrid families (qwen3_next; hybrid.py): 0 / () elsewhere ----
    layer_types: tuple[str, ...] = ()
    """Per layer: "linear_attention" (Gated DeltaNet; nemotron_h: Mamba-2), "full_attention"; nemotron_h: "moe", "mlp"."""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    shared_expert_intermediate_size: int = 0
    """MoE layers: one shared expert of this width (the Qwen hybrids scale it by sigmoid(shared_expert_gate(x)))."""
    # ---- nemotron_h (nemotron.py): the Mamba-2 layers' sizes, the MoE's latent width; 0 elsewhere ----
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_kernel: int = 0
    mamba_chunk_size: int = 0
    mamba_conv_bias: bool = False
    mamba_proj_bias: bool = False
    mamba_dt_min: float = 0.0
    moe_latent_size: int = 0
    """The routed experts run at this width between fc1/fc2_latent_proj (0: at hidden_size)."""
    spec: Any = None
    """A FAMILY_MODULES family's own keys (its module's frozen dataclass); None elsewhere."""
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None
    """Checkpoint dtype name ("bfloat16", ...); the default dtype of `load_pretrained`."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise ValueError("qwen2 always has a q/k/v bias and no o_proj bias (qkv_bias=True, o_bias=False)")
        if self.model_type in ("llama", "qwen3", "qwen3_moe", *HYBRID_TYPES) and self.qkv_bias != self.o_bias:
            raise ValueError(f"{self.model_type} has one attention_bias flag: qkv_bias and o_bias must be equal")
        if self.model_type == "glm4_moe" and self.o_bias:
            raise ValueError("glm4_moe's attention_bias is on q/k/v only (o_bias=False)")
        # An odd rotary_dim is transformers' too: its frequencies over that dim, the next even number of dims rotated.
        bad_rope = not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim == 0
        if self.uses_rope and bad_rope:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={self.head_dim} must "
                f"leave rotary dims (int(head_dim x factor) > 0)"
            )
        if self.mlp_bias and self.model_type not in ("llama", "nemotron_h"):
            raise ValueError("mlp_bias exists only in llama and nemotron_h")
        if self.model_type == "qwen3_moe" or self.group_router:
            if self.num_experts <= 0 or self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError(f"{self.model_type} needs num_experts, moe_intermediate_size, decoder_sparse_step > 0")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} not in [1, {self.num_experts}]")
        elif (
            self.num_experts and not self.is_hybrid and self.spec is None
        ):  # a hybrid family's MoE is optional (check_hybrid)
            raise ValueError(f"{self.model_type} is dense but num_experts={self.num_experts}")
        if self.is_mla and min(self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim) <= 0:
            raise ValueError(f"{self.model_type} needs kv_lora_rank, qk_nope_head_dim, v_head_dim > 0")
        check_dsa(self)
        if (fam := family_module(self.model_type)) is not None:
            fam.check(self)
        elif self.model_type == "nemotron_h":
            check_nemotron(self)
        else:
            check_hybrid(self)
            if self.mamba_num_heads or self.moe_latent_size:
                raise ValueError(f"mamba_* / moe_latent_size: Nemotron-H fields; {self.model_type} has none")
        if self.group_router:
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(
                    f"n_group={self.n_group} must divide num_experts={self.num_experts} and hold "
                    f"topk_group={self.topk_group}"
                )
            if self.num_experts // self.n_group < 2:
                raise ValueError("the group-limited router ranks groups by their top-2 scores: >= 2 experts a group")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} out of range [0, {self.num_hidden_layers})")
        if self.dtype is not None:
            self.torch_dtype()  # validates the name

    # ---- derived ----
    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3 family, and the DSA families built on it)."""
        return self.model_type in MLA_TYPES

    @property
    def is_dsa(self) -> bool:
        """DeepSeek sparse attention: MLA whose keys are the indexer's top-k per query (deepseek_v32, glm_moe_dsa)."""
        return self.model_type in DSA_TYPES

    @property
    def indexer_rope_interleave(self) -> bool:
        """The indexer rotates interleaved pairs (GLM-5) or halves (DeepSeek-V3.2) of its rope part."""
        return INDEXER_ROPE_INTERLEAVED.get(self.model_type, False)

    def indexer_full(self, layer_idx: int) -> bool:
        """A DSA layer that runs (and holds) its own indexer; "shared" layers reuse the last full layer's top-k.
        Multi-token-prediction layers (past num_hidden_layers) always run their own."""
        return self.is_dsa and (
            layer_idx >= self.num_hidden_layers or not self.indexer_types or self.indexer_types[layer_idx] == "full"
        )

    @property
    def is_hybrid(self) -> bool:
        """Linear-attention (Gated DeltaNet) layers among full-attention ones: recurrent state per sequence."""
        return self.model_type in HYBRID_TYPES

    def is_linear_layer(self, layer_idx: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_idx] == "linear_attention"

    @property
    def zero_centered_norms(self) -> bool:
        """RMSNorms scale by 1 + weight (weights start at 0; computed in float32): the Qwen hybrids."""
        return self.model_type in DELTANET_TYPES

    @property
    def attn_output_gate(self) -> bool:
        """q_proj also gives a per-head gate; the attention output is scaled by its sigmoid: the Qwen hybrids."""
        return self.model_type in DELTANET_TYPES

    @property
    def uses_rope(self) -> bool:
        """Nemotron-H's attention has no position embedding (its Mamba layers carry the order)."""
        return self.model_type != "nemotron_h"

    @property
    def group_router(self) -> bool:
        """The sigmoid group-limited router with shared experts and first-k dense layers (DeepSeek-V3, GLM-4.5,
        and the DSA families)."""
        return self.model_type in GROUP_ROUTER_TYPES

    @property
    def rotary_dim(self) -> int:
        """int(head_dim x partial_rotary_factor), 0 without RoPE: the width RoPE's frequencies are spread over; the
        first `2 * ceil(rotary_dim / 2)` dims of each head are rotated (one more when odd, as in transformers and
        megatron), the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor) if self.uses_rope else 0

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: MLA's nope + rope parts, else head_dim."""
        return self.qk_nope_head_dim + self.head_dim if self.is_mla else self.head_dim

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on q and k before RoPE: fixed by the family (qwen3, qwen3_moe)."""
        return self.model_type in ("qwen3", "qwen3_moe", *DELTANET_TYPES) or (
            self.model_type == "glm4_moe" and self.use_qk_norm
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Which layers get the sparse MoE block: transformers' Qwen3MoeDecoderLayer / DeepseekV3DecoderLayer rule
        (nemotron_h: its "moe" blocks)."""
        if (fam := family_module(self.model_type)) is not None:
            return bool(fam.is_moe_layer(self, layer_idx))
        if self.model_type == "nemotron_h":
            return layer_idx < self.num_hidden_layers and self.layer_types[layer_idx] == "moe"
        if self.group_router:
            if layer_idx < self.num_hidden_layers and self.mlp_layer_types:
                return self.mlp_layer_types[layer_idx] == "sparse"
            return layer_idx >= self.first_k_dense_replace  # MTP layers (past the decoder) are MoE
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    def torch_dtype(self) -> torch.dtype | None:
        if self.dtype is None:
            return None
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        return dt

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ----
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse an HF config dict; `source` (the file) is named in every error."""
        raw_type: Any = (d := text_model(d)).get("model_type")  # a multimodal checkpoint's: its text model
        model_type = MODEL_TYPE_ALIASES.get(raw_type, raw_type)
        if model_type is None:
            by_arch = {arch: mt for mt, arch in ARCHITECTURES.items()}
            archs = [a for a in d.get("architectures") or () if a in by_arch]
            model_type = by_arch[archs[0]] if archs else None
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported model_type {d.get('model_type')!r} "
                f"(architectures={d.get('architectures')!r}); supported model types: {list(SUPPORTED_MODEL_TYPES)}"
            )
        fam = family_module(model_type)
        defaults = fam.DEFAULTS if fam is not None else FAMILY_DEFAULTS[model_type]
        if fam is not None or model_type == "nemotron_h":
            d = fam.canonical(d) if fam is not None else canonical(d)

        def get(key: str, default: Any = None) -> Any:
            value = d.get(key)
            return defaults.get(key, default) if value is None else value

        try:
            heads = int(get("num_attention_heads"))
            hidden = int(get("hidden_size"))
            rope_theta, rope_scaling = parse_rope(d, int(get("max_position_embeddings")))
            attention_bias = bool(d.get("attention_bias", False))
            eos = d.get("eos_token_id")
            moe: dict[str, Any] = {}
            if model_type == "qwen3_moe":  # MoE keys of a dense config (if any) are ignored, as transformers does
                moe = qwen3_moe_fields(d, get)
            elif model_type in GROUP_ROUTER_TYPES:
                moe = group_router_fields(d, get, mla=model_type in MLA_TYPES)
                if model_type in DSA_TYPES:
                    moe.update(dsa_fields(d, get, model_type, int(get("num_hidden_layers"))))
            elif fam is not None:
                moe = fam.fields(d)
            elif model_type == "nemotron_h":
                moe = nemotron_fields(d)
            elif model_type in HYBRID_TYPES:
                moe = hybrid_fields(d, get, int(get("num_hidden_layers")))
            partial = partial_rotary(d)
            if partial != 1.0 and model_type not in ("glm4_moe", *HYBRID_TYPES) and fam is None:
                raise ValueError("partial_rotary_factor is supported for glm4_moe and the Qwen hybrids only")
            return cls(
                model_type=model_type,
                vocab_size=int(get("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(get("intermediate_size")),
                num_hidden_layers=int(get("num_hidden_layers")),
                num_attention_heads=heads,
                num_key_value_heads=int(get("num_key_value_heads", heads) or heads),
                head_dim=int(
                    get("qk_rope_head_dim") if model_type in MLA_TYPES else get("head_dim") or hidden // heads
                ),
                hidden_act=str(get("hidden_act", "silu")),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(get("max_position_embeddings")),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=False if model_type in ("qwen2", "glm4_moe") else attention_bias,
                partial_rotary_factor=partial,
                use_qk_norm=bool(d.get("use_qk_norm", False)) if model_type == "glm4_moe" else False,
                mlp_bias=bool(d.get("mlp_bias", False)) if model_type == "llama" else moe.pop("mlp_bias", False),
                # transformers never ties Nemotron-H's head (it ignores the flag and stores lm_head): neither do we
                tie_word_embeddings=model_type != "nemotron_h" and bool(d.get("tie_word_embeddings", False)),
                initializer_range=float(get("initializer_range", 0.02)),
                **moe,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                pad_token_id=d.get("pad_token_id"),
                dtype=d.get("dtype") or d.get("torch_dtype"),
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """HF config.json content (Hub key style) that transformers' AutoConfig loads as the same architecture."""
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf_dict() if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.group_router:
            d.update(self._group_router_keys(d))
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        elif self.model_type == "nemotron_h":
            d.update(nemotron_keys(self))
            for key in DROPPED_KEYS:
                d.pop(key)
        elif self.is_hybrid:
            d.update(hybrid_keys(self))
        elif (fam := family_module(self.model_type)) is not None:
            d.update(fam.keys(self))
            d = {k: v for k, v in d.items() if v is not None or k in ("rope_scaling", "pad_token_id")}
        elif not self.group_router:
            d["use_sliding_window"] = False
        if self.model_type == "qwen3_moe":
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        if self.dtype is not None:
            # Both spellings: transformers 5 reads `dtype`, older readers `torch_dtype`.
            d["torch_dtype"] = d["dtype"] = self.dtype
        return d

    def _group_router_keys(self, d: dict[str, Any]) -> dict[str, Any]:
        """The router keys of the DeepSeek-V3 / GLM families, MLA's, the DSA indexer's (to_hf_dict's part;
        removes the keys those families do not have from `d`)."""
        out: dict[str, Any] = dict(
            n_routed_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            n_shared_experts=self.n_shared_experts,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            first_k_dense_replace=self.first_k_dense_replace,
        )
        if self.model_type == "glm4_moe":
            out.update(partial_rotary_factor=self.partial_rotary_factor, use_qk_norm=self.use_qk_norm)
            return out
        del d["head_dim"]  # transformers derives it (= qk_rope_head_dim)
        out.update(
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )
        out["num_nextn_predict_layers"] = self.num_nextn_predict_layers  # 0 too: over a wrapper's original
        if not self.is_dsa:
            out["rope_interleave"] = self.rope_interleave
            return out
        # (no rope_interleave: not a field of either DSA family, whose attention always interleaves)
        out.update(index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk)
        if self.mlp_layer_types:
            out["mlp_layer_types"] = list(self.mlp_layer_types)
        if self.model_type == "glm_moe_dsa":
            out["indexer_types"] = ["full" if self.indexer_full(i) else "shared" for i in range(self.num_hidden_layers)]
        return out


__all__ = ["ARCHITECTURES", "MODEL_TYPE_ALIASES", "SUPPORTED_MODEL_TYPES", "ModelConfig", "RopeScaling"]
