"""The supported model families as data: HF architecture names, aliases, and transformers 5.24's per-class
defaults for the keys a config.json may omit (configuration_<family>.py of each); and the parsing and checks of
the DSA families' indexer keys, which config.py calls.

Stage: shared (config.py parses with these tables).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig

    Transform = Callable[[torch.Tensor], torch.Tensor]

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "inkling_text": "InklingForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Wrapper:
    """A multimodal checkpoint whose text model is one of our families: its config under `text_config`, its
    tensors under `prefixes`. We train the text model; hf_io.py keeps the other tensors and writes them back."""

    architecture: str
    """The checkpoint's class as released (its config.json `architectures`), the name SGLang registers."""
    aliases: tuple[str, ...] = ()
    """Other names of the same class in a config.json (transformers' own, which its save_pretrained writes)."""
    text_type: str | None
    """The text model's family (None: the text_config's own model_type)."""
    prefixes: tuple[tuple[str, str], ...]
    """(stored prefix, our prefix) pairs for the text model's tensors; the first is the one we write."""
    heads: tuple[str, ...]
    """Names the LM head is stored under; the first is the one we write."""
    tie_default: bool
    """The wrapper class's `tie_word_embeddings` when neither it nor its text_config sets the key."""

    codec: str | None = None
    """A module of this package that renames and reshapes the text tensors (its `sources` and `stored`), where a
    prefix is not enough (Inkling's release: inkling_release.py); None: `prefixes` and `heads` say it all."""

    def sources(self, names: Iterable[str]) -> dict[str, tuple[str, Transform | None]]:
        """Our name -> (the stored tensor it is read from, what turns that into ours) for the text model's tensors
        among a checkpoint's `names`; the others are the towers'."""
        if self.codec is not None:
            return dict(importlib.import_module(f"{__package__}.{self.codec}").sources(names))
        return {ours: (n, None) for n in names if (ours := self.ours(n)) is not None}

    def store(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """(stored name, tensor) for our text tensors, as the checkpoint keeps them."""
        if self.codec is not None:
            return list(importlib.import_module(f"{__package__}.{self.codec}").stored(tensors))
        return [(self.stored(n), t) for n, t in tensors]

    def ours(self, name: str) -> str | None:
        """Our name for a stored tensor of the text model, else None (a tower's tensor, kept as it is)."""
        if name in self.heads:
            return "lm_head.weight"
        for stored, our in sorted(self.prefixes, key=lambda p: -len(p[0])):  # the longest prefix decides
            if name.startswith(stored):
                return our + name.removeprefix(stored)
        return None

    def stored(self, name: str) -> str:
        """The name we write our tensor under."""
        if name == "lm_head.weight":
            return self.heads[0]
        stored, our = self.prefixes[0]
        return stored + name.removeprefix(our) if name.startswith(our) else name


WRAPPERS: dict[str, Wrapper] = {
    # Qwen3.5-MoE as published: `model.language_model.*` beside `model.visual.*` and `mtp.*`.
    "qwen3_5_moe": Wrapper(
        architecture="Qwen3_5MoeForConditionalGeneration",
        text_type="qwen3_5_moe_text",
        prefixes=(("model.language_model.", "model."),),
        heads=("lm_head.weight",),
        tie_default=False,
    ),
    # Kimi-K2.5 / K2.6: a DeepSeek-V3 text model (`kimi_k2`) under `language_model.*` (the Hub's), beside
    # `vision_tower.*` and `mm_projector.*`; transformers' in-memory names and its save_pretrained output (which
    # reverses its vision tower's `blocks` -> `layers` rename on the text layers too) read as well. The release
    # names its class `KimiK25ForConditionalGeneration` (SGLang's too); transformers calls it Kimi_K25....
    "kimi_k25": Wrapper(
        architecture="KimiK25ForConditionalGeneration",
        aliases=("Kimi_K25ForConditionalGeneration",),
        text_type=None,
        prefixes=(
            ("language_model.model.", "model."),
            ("language_model.model.blocks.", "model.layers."),
            ("model.language_model.", "model."),
        ),
        heads=("language_model.lm_head.weight", "lm_head.weight"),
        tie_default=True,
    ),
    # Inkling as released: the text model under `model.llm.*` in the release's own names, gate and up rows
    # interleaved in fused tensors (inkling_release.py), beside `model.visual.*`, `model.audio.*`, `model.mtp.*`.
    "inkling_mm_model": Wrapper(
        architecture="InklingForConditionalGeneration",
        text_type="inkling_text",
        prefixes=(("model.llm.", "model."),),
        heads=("model.llm.unembed.weight",),
        tie_default=False,
        codec="inkling_release",
    ),
}


def text_model(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config of a multimodal checkpoint's text model (the wrapper's `tie_word_embeddings` decides, its class
    default when absent, whatever the text_config says: transformers' rule); any other config as it is."""
    wrapper = WRAPPERS.get(d.get("model_type", ""))
    if wrapper is None:
        return d
    text = d["text_config"]
    tie = d.get("tie_word_embeddings", wrapper.tie_default)
    return {
        **text,
        "model_type": wrapper.text_type or text.get("model_type", "deepseek_v3"),
        "tie_word_embeddings": tie,
    }


# Families whose own config keys, checks and layers live in one module of this package (the recipe of
# docs/models.md): model_type -> module name. The module provides
#   DEFAULTS                  transformers' class defaults for the keys every family has (as FAMILY_DEFAULTS);
#   canonical(d) -> dict      the config.json with those keys under the names config.py reads;
#   fields(d) -> dict         ModelConfig field values beyond the common ones, `spec` (its frozen dataclass) among them;
#   keys(cfg) -> dict         what to_hf_dict writes beyond the common keys (a None value removes a common key);
#   check(cfg)                its consistency checks (ValueError naming the key);
#   is_moe_layer(cfg, i)      which layers' routing R3 records;
#   backbone(cfg) -> Module   `model.*` of CausalLM (embed_tokens, layers, norm, and `run`: see transformer.py).
FAMILY_MODULES: dict[str, str] = {"inkling_text": "inkling", "deepseek_v4": "deepseek_v4"}


def logits_width(config: ModelConfig) -> int:
    """Columns of the logits CausalLM returns: the vocabulary, less a family's padding (Inkling's
    `unpadded_vocab_size`, whose extra head rows are no tokens)."""
    return getattr(config.spec, "unpadded_vocab_size", None) or config.vocab_size


def family_module(model_type: str) -> Any:
    """The module of a family listed in FAMILY_MODULES, else None."""
    name = FAMILY_MODULES.get(model_type)
    if name is None:
        return None
    return importlib.import_module(f"{__package__}.{name}")


# Checkpoints that name another model_type for one of these architectures (Kimi-K2 ships DeepSeek-V3 weights).
MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = (
    "silu",
    "swish",
    "gelu",
    "gelu_pytorch_tanh",
    "gelu_new",
    "quick_gelu",
    "relu",
    "relu2",
    "tanh",
    "mish",
)

# transformers 5.24 class defaults for keys a config.json may omit (configuration_<family>.py). Keys absent here
# default the same for all families (see `from_hf_dict`).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=None,
        max_position_embeddings=32768,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
    ),
    "qwen3_moe": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=None,
        max_position_embeddings=32768,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "deepseek_v3": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=None,
        max_position_embeddings=4096,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
    "glm4_moe": dict(
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=None,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
    ),
    # DeepSeek-V3.2: DeepSeek-V3 + the DSA lightning indexer in every layer (DeepseekV32Config).
    "deepseek_v32": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=64,
    ),
    # GLM-5 / GLM-5.2: the same attention and router, layer-shared indexer results (GlmMoeDsaConfig).
    "glm_moe_dsa": dict(
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        num_hidden_layers=78,
        num_attention_heads=64,
        num_key_value_heads=64,
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=2048,
        qk_rope_head_dim=64,
        v_head_dim=256,
        qk_nope_head_dim=192,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=32,
    ),
    # Qwen3-Next: Gated DeltaNet layers with a gated full-attention layer every 4th, MoE with a gated shared expert
    # (Qwen3NextConfig).
    "qwen3_next": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=32768,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
    ),
    # Qwen3.5-MoE's text model: Qwen3-Next's layers with separate DeltaNet input projections, MoE in every layer
    # (Qwen3_5MoeTextConfig). No dense layers: intermediate_size is not a key of the family (kept for the config).
    # Nemotron-H (NemotronHConfig; its Mamba and MoE defaults are nemotron.DEFAULTS).
    "nemotron_h": dict(
        vocab_size=131072,
        hidden_size=4096,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
    ),
    "qwen3_5_moe_text": dict(
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=512,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=32768,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
    ),
}

# Hybrid families: recurrent layers among full-attention ones: Gated DeltaNet (the Qwen hybrids, models/hybrid.py)
# or Mamba-2 (Nemotron-H, models/nemotron.py).
DELTANET_TYPES: tuple[str, ...] = ("qwen3_next", "qwen3_5_moe_text")
HYBRID_TYPES: tuple[str, ...] = (*DELTANET_TYPES, "nemotron_h")

# MLA families (DeepSeek-V3 attention); the DSA ones add the lightning indexer. The indexer rotates its rope part
# as interleaved pairs in GLM-5 and as halves in DeepSeek-V3.2 (transformers' GlmMoeDsaIndexer vs DeepseekV32Indexer).
MLA_TYPES: tuple[str, ...] = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DSA_TYPES: tuple[str, ...] = ("deepseek_v32", "glm_moe_dsa")
GROUP_ROUTER_TYPES: tuple[str, ...] = ("deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa")
INDEXER_ROPE_INTERLEAVED: dict[str, bool] = {"deepseek_v32": False, "glm_moe_dsa": True}


def dsa_fields(d: Mapping[str, Any], get: Any, model_type: str, num_layers: int) -> dict[str, Any]:
    """The indexer keys of a DeepSeek-V3.2 / GLM-5 config.json (transformers 5.24 DeepseekV32Config and
    GlmMoeDsaConfig): GLM's per-layer `indexer_types`, else its `index_topk_pattern` ("FSS..."), else the schedule
    `index_topk_freq` / `index_skip_topk_offset` (layer i is full when max(i - offset + 1, 0) % freq == 0)."""
    rope_interleaved = d.get("indexer_rope_interleave")
    if rope_interleaved is not None and bool(rope_interleaved) != INDEXER_ROPE_INTERLEAVED[model_type]:
        raise ValueError(
            f"indexer_rope_interleave={rope_interleaved!r}: the {model_type} indexer always rotates "
            f"{'interleaved pairs' if INDEXER_ROPE_INTERLEAVED[model_type] else 'halves'}"
        )
    if d.get("rope_interleave") is False:
        raise ValueError(f"rope_interleave=false: {model_type} attention always rotates interleaved pairs")
    types: Any = d.get("indexer_types")
    if model_type == "deepseek_v32":
        if types is not None or d.get("index_topk_pattern") is not None:
            raise ValueError("indexer_types / index_topk_pattern: DeepSeek-V3.2 runs the indexer in every layer")
        types = ()
    elif types is None:
        pattern = d.get("index_topk_pattern")
        if isinstance(pattern, str):
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        elif pattern is not None:
            types = list(pattern)
        else:
            freq, offset = max(int(d.get("index_topk_freq") or 1), 1), int(d.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    mlp_types: Any = d.get("mlp_layer_types")
    return dict(
        index_n_heads=int(get("index_n_heads")),
        index_head_dim=int(get("index_head_dim")),
        index_topk=int(get("index_topk")),
        indexer_types=tuple(str(t) for t in types),
        mlp_layer_types=tuple(str(t) for t in mlp_types) if mlp_types is not None else (),
    )


def check_dsa(c: ModelConfig) -> None:
    """Field consistency of the DSA families (and none of their fields elsewhere); each error names the field."""
    if not c.is_dsa:
        if c.index_n_heads or c.index_topk or c.indexer_types or c.mlp_layer_types:
            raise ValueError(f"index_* / indexer_types / mlp_layer_types are DSA fields; {c.model_type} has none")
        if c.num_nextn_predict_layers and not c.is_mla:
            raise ValueError(f"num_nextn_predict_layers: {c.model_type} has no multi-token-prediction layers here")
        return
    n = c.num_hidden_layers
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        if getattr(c, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(c, name)}")
    if c.q_lora_rank is None:
        raise ValueError(f"q_lora_rank: {c.model_type} needs compressed queries (the indexer reads them)")
    if c.index_head_dim < c.head_dim:
        raise ValueError(
            f"index_head_dim={c.index_head_dim} is narrower than its rope part qk_rope_head_dim={c.head_dim}"
        )
    if c.num_nextn_predict_layers < 0:
        raise ValueError(f"num_nextn_predict_layers must be >= 0, got {c.num_nextn_predict_layers}")
    for name, allowed in (("indexer_types", ("full", "shared")), ("mlp_layer_types", ("dense", "sparse"))):
        values = getattr(c, name)
        if values and len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for num_hidden_layers={n}")
        bad = sorted({v for v in values if v not in allowed})
        if bad:
            raise ValueError(f"{name}: unknown entries {bad}; each is one of {allowed}")
    if c.indexer_types and c.indexer_types[0] != "full":
        raise ValueError('indexer_types[0] is "shared": a shared layer reuses an earlier full layer\'s top-k')
