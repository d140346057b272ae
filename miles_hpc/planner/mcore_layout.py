"""Megatron-core's layout as pure functions (stage: planner; used by `train/mcore_weights.py`,
`train/mcore_pipeline.py` and the layout planner `planner/layouts.py`): the megatron tensors of a model and their
HF sources (`mcore_rules`), what each tensor-, expert- and pipeline-parallel rank holds (`mcore_boxes`,
`StageLayout`). No torch, no megatron: the planner counts exactly what the trainer builds. The mapping table and
the TP layouts are in `train/mcore_weights.py`'s docstring.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from miles_hpc.models import ModelConfig
from miles_hpc.planner.transfer import Box

__all__ = [
    "INDEXER_SCORE_ELEMENTS",
    "MCORE_FAMILIES",
    "Kind",
    "Rule",
    "StageLayout",
    "is_frozen",
    "layout_limits",
    "mcore_boxes",
    "mcore_rules",
    "padded_vocab_size",
]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")

# Families whose megatron mapping exists (deepseek_v3 includes Kimi-K2, model_type alias kimi_k2; deepseek_v32 and
# glm_moe_dsa are DeepSeek-V3 with DeepSeek sparse attention, train/mcore_dsa.py).
MCORE_FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
)
# rows: contiguous rows per TP rank; q_heads / kv_down: rows, MLA's rotary rows reordered (`_row_perm`)
Kind = Literal["replicated", "cols", "vocab", "qkv", "fc1", "expert_fc1", "expert_fc2", "rows", "q_heads", "kv_down"]


@dataclass(frozen=True, slots=True)
class Rule:
    """One megatron tensor and the HF tensors it is made of. Expert tensors (`expert` set) are named here by their
    global expert index; the rank that holds expert e under expert parallelism ep calls it local expert
    e % (E / ep) (`mcore_name`)."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind
    expert: int | None = None

    def owner(self, num_experts: int, ep: int) -> int:
        """The expert-parallel rank holding this expert tensor."""
        if self.expert is None:
            raise ValueError(f"{self.mcore} is not an expert tensor: every rank holds it")
        return self.expert // (num_experts // ep)

    def mcore_name(self, num_experts: int, ep: int) -> str:
        """The parameter name on its owner: the local expert index under expert parallelism."""
        if self.expert is None:
            return self.mcore
        local = self.expert % (num_experts // ep)
        return self.mcore.replace(f".local_experts.{self.expert}.", f".local_experts.{local}.")


# The megatron trainer's DSA indexer scores a sequence's queries in chunks of rows whose float32 scores
# [rows, batch, index heads, S] hold at most this many elements (`train/mcore_dsa._DSAIndexer.select`); the planner
# counts the same bound.
INDEXER_SCORE_ELEMENTS = 1 << 26


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary rows megatron holds: `vocab` rounded up to a multiple of `multiple * tp`."""
    step = multiple * tp
    return -(-vocab // step) * step


# The layers of a family that megatron-core cannot express (docs/models.md's family table).
UNMAPPED_LAYERS = {
    "deepseek_v4": (
        "compressed sparse attention (CSA/HCA compressors, an indexer over compressed entries, per-head sinks), "
        "manifold-constrained hyper-connections, hash-routed MoE or sqrt-softplus routers"
    ),
    "inkling_text": (
        "attention with relative logits and log scaling, short convolutions on keys, values and residuals, or a "
        "router whose shared experts act as a sink"
    ),
}


def mcore_rules(cfg: ModelConfig) -> list[Rule]:
    """Every megatron tensor of a `GPTModel` for `cfg` (local spec), with its HF sources, in layer order; the
    multi-token-prediction layers (`num_nextn_predict_layers`) as megatron's `MultiTokenPredictionLayer`s
    (`mtp.layers.j`, the decoder layer inside as `transformer_layer`)."""
    if cfg.is_hybrid:  # docs/models.md, "Hybrid families"
        raise NotImplementedError(
            f"model_type {cfg.model_type!r} is not mapped yet: megatron-core 0.16's GatedDeltaNet needs "
            "flash-linear-attention's CUDA kernels and takes no packed sequences, its MambaMixer needs mamba_ssm's "
            "and causal_conv1d's: neither runs on CPU; use train.backend=fsdp"
        )
    if cfg.model_type in UNMAPPED_LAYERS:
        raise NotImplementedError(
            f"model_type {cfg.model_type!r} is not mapped: megatron-core 0.16 has no {UNMAPPED_LAYERS[cfg.model_type]}; "
            "use train.backend=fsdp"
        )
    if cfg.model_type not in MCORE_FAMILIES:
        raise NotImplementedError(
            f"the megatron backend maps {', '.join(MCORE_FAMILIES)} so far; model_type {cfg.model_type!r} is not "
            "mapped yet: use train.backend=fsdp"
        )
    if cfg.is_mla and cfg.qkv_bias:
        raise NotImplementedError(
            f"megatron backend: {cfg.model_type} with attention_bias=True (megatron's MLA has no bias "
            "on its q/kv down projections)"
        )
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(cfg.num_hidden_layers):
        rules.extend(_layer_rules(cfg, i, f"model.layers.{i}.", f"decoder.layers.{i}."))
    for j in range(cfg.num_nextn_predict_layers):
        i = cfg.num_hidden_layers + j
        hf, mc = f"model.layers.{i}.", f"mtp.layers.{j}."
        rules += [
            Rule(mc + "enorm.weight", (hf + "enorm.weight",), "replicated"),
            Rule(mc + "hnorm.weight", (hf + "hnorm.weight",), "replicated"),
            Rule(mc + "eh_proj.weight", (hf + "eh_proj.weight",), "rows"),  # column-parallel
            Rule(mc + "final_layernorm.weight", (hf + "shared_head.norm.weight",), "replicated"),
            *_layer_rules(cfg, i, hf, mc + "transformer_layer."),
        ]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not cfg.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def is_frozen(mcore_name: str, *, train_indexers: bool = False) -> bool:
    """Megatron tensors the loss does not train, as in our model (no gradient there): the DSA indexers (their
    top-k is not differentiable) unless the indexer loss trains them (`train_indexers`, `train.indexer_loss_coef`),
    and the multi-token-prediction layers (not run: `train.mtp_loss_coef` is the FSDP backend's)."""
    if mcore_name.startswith("mtp."):
        return True
    return ".core_attention.indexer." in mcore_name and not train_indexers


def _layer_rules(cfg: ModelConfig, i: int, hf: str, mc: str) -> list[Rule]:
    """Decoder layer i's tensors (`hf`: its HF prefix, `mc`: its megatron prefix)."""
    att = hf + "self_attn."
    rules = [Rule(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated")]
    if cfg.is_mla:
        rules.extend(_mla_rules(cfg, att, mc + "self_attention."))
        if cfg.indexer_full(i):
            rules.extend(_indexer_rules(att + "indexer.", mc + "self_attention.core_attention.indexer."))
    else:
        rules.append(
            Rule(mc + "self_attention.linear_qkv.weight", tuple(f"{att}{p}_proj.weight" for p in "qkv"), "qkv")
        )
    if cfg.qkv_bias:
        qkv_bias = tuple(f"{att}{p}_proj.bias" for p in "qkv")
        rules.append(Rule(mc + "self_attention.linear_qkv.bias", qkv_bias, "qkv"))
    rules.append(Rule(mc + "self_attention.linear_proj.weight", (att + "o_proj.weight",), "cols"))
    if cfg.o_bias:
        rules.append(Rule(mc + "self_attention.linear_proj.bias", (att + "o_proj.bias",), "replicated"))
    if cfg.qk_norm:
        rules.append(Rule(mc + "self_attention.q_layernorm.weight", (att + "q_norm.weight",), "replicated"))
        rules.append(Rule(mc + "self_attention.k_layernorm.weight", (att + "k_norm.weight",), "replicated"))
    rules.append(Rule(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated"))
    if cfg.is_moe_layer(i):
        return rules + _moe_rules(cfg, hf, mc)
    gate_up = (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
    rules.append(Rule(mc + "mlp.linear_fc1.weight", gate_up, "fc1"))
    rules.append(Rule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "cols"))
    if cfg.mlp_bias:
        rules.append(Rule(mc + "mlp.linear_fc1.bias", (hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias"), "fc1"))
        rules.append(Rule(mc + "mlp.linear_fc2.bias", (hf + "mlp.down_proj.bias",), "replicated"))
    return rules


def _moe_rules(cfg: ModelConfig, hf: str, mc: str) -> list[Rule]:
    """An MoE layer's router, shared experts (GLM's router) and experts."""
    rules = [Rule(mc + "mlp.router.weight", (hf + "mlp.gate.weight",), "replicated")]
    if cfg.group_router:  # GLM-4.5: sigmoid router with a score correction bias, shared experts
        rules.append(Rule(mc + "mlp.router.expert_bias", (hf + "mlp.gate.e_score_correction_bias",), "replicated"))
        shared = f"{hf}mlp.shared_experts."
        shared_fc1 = (shared + "gate_proj.weight", shared + "up_proj.weight")
        rules.append(Rule(mc + "mlp.shared_experts.linear_fc1.weight", shared_fc1, "fc1"))
        rules.append(Rule(mc + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), "cols"))
    for e in range(cfg.num_experts):
        src, dst = f"{hf}mlp.experts.{e}.", f"{mc}mlp.experts.local_experts.{e}."
        fc1 = (src + "gate_proj.weight", src + "up_proj.weight")
        rules.append(Rule(dst + "linear_fc1.weight", fc1, "expert_fc1", e))
        rules.append(Rule(dst + "linear_fc2.weight", (src + "down_proj.weight",), "expert_fc2", e))
    return rules


def _indexer_rules(hf: str, mc: str) -> list[Rule]:
    """A DSA layer's lightning indexer (megatron's `DSAIndexer` under `core_attention`): replicated over TP, as
    megatron builds its linears ("duplicated")."""
    names = [("wq_b.weight", "linear_wq_b.weight"), ("wk.weight", "linear_wk.weight")]
    names += [("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias")]
    names += [("weights_proj.weight", "linear_weights_proj.weight")]
    return [Rule(mc + m, (hf + h,), "replicated") for h, m in names]


def _mla_rules(cfg: ModelConfig, att: str, mc: str) -> list[Rule]:
    """One layer's MLA projections and norms (`att`: HF prefix, `mc`: megatron prefix); o_proj is the common rule.
    No biases: megatron's MLA has none on its down projections (`mcore_rules` refuses MLA's attention_bias)."""
    if cfg.q_lora_rank is None:
        q = [Rule(mc + "linear_q_proj.weight", (att + "q_proj.weight",), "q_heads")]
    else:
        q = [
            Rule(mc + "linear_q_down_proj.weight", (att + "q_a_proj.weight",), "rows"),
            Rule(mc + "q_layernorm.weight", (att + "q_a_layernorm.weight",), "replicated"),
            Rule(mc + "linear_q_up_proj.weight", (att + "q_b_proj.weight",), "q_heads"),
        ]
    return [
        *q,
        Rule(mc + "linear_kv_down_proj.weight", (att + "kv_a_proj_with_mqa.weight",), "kv_down"),
        Rule(mc + "kv_layernorm.weight", (att + "kv_a_layernorm.weight",), "replicated"),
        Rule(mc + "linear_kv_up_proj.weight", (att + "kv_b_proj.weight",), "rows"),
    ]


# ---------------------------------------------------------------- what each rank holds (p2p sync)
def mcore_boxes(
    rule: Rule, shapes: Mapping[str, tuple[int, ...]], cfg: ModelConfig, tp_rank: int, tp: int, ep_rank: int, ep: int
) -> dict[str, Box]:
    """The part of each of `rule`'s HF tensors (global `shapes`) that the rank at (tp_rank, ep_rank) holds: a box,
    empty where it holds nothing. Every TP layout above holds contiguous rows (or columns) of each HF tensor: the
    fused QKV's groups are whole query groups, i.e. contiguous heads of q, k and v."""
    out = {}
    for name in rule.hf:
        shape = shapes[name]
        full = Box.full(shape)
        if rule.expert is not None:
            out[name] = full if rule.owner(cfg.num_experts, ep) == ep_rank else full.with_dim(0, 0, 0)
        elif rule.kind == "replicated":
            out[name] = full
        elif rule.kind == "cols":
            step = shape[1] // tp
            out[name] = full.with_dim(1, tp_rank * step, (tp_rank + 1) * step)
        elif rule.kind == "vocab":
            step = padded_vocab_size(cfg.vocab_size, tp) // tp
            lo, hi = min(shape[0], tp_rank * step), min(shape[0], (tp_rank + 1) * step)
            out[name] = full.with_dim(0, lo, hi)
        else:  # qkv, fc1, rows, q_heads, kv_down: rows, split evenly (`_row_perm` keeps rows on their rank)
            step = shape[0] // tp
            out[name] = full.with_dim(0, tp_rank * step, (tp_rank + 1) * step)
    return out


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Where megatron's tensors live over `pp` pipeline stages of a `num_layers`-layer model (names as
    `mcore_weights.mcore_rules` gives them: global layer indices), each stage holding `vpp` model chunks (virtual
    pipeline stages, megatron's interleaved schedule). The decoder is cut into pp x vpp chunks of equal size; chunk
    c holds layers c * L / (pp vpp) onwards and lives on stage c % pp as its virtual chunk c // pp (megatron's
    `get_transformer_layer_offset`), so stage s holds chunks s, pp + s, 2 pp + s, ...; the embedding is on stage 0's
    chunk 0, the final norm, output layer and MTP layers on the last stage's last chunk."""

    pp: int
    num_layers: int
    tied_embeddings: bool = False
    vpp: int = 1

    def __post_init__(self) -> None:
        if self.vpp > 1 and self.pp < 3:
            raise ValueError(
                f"megatron.virtual_pipeline={self.vpp} needs megatron.pipeline_parallel >= 3, got {self.pp}: it "
                "splits each stage's layers into interleaved chunks, and at 2 stages megatron-core's interleaved "
                "schedule sends activations and gradients to the one peer in an order that peer does not receive them "
                "in (train/mcore_pipeline.py)"
            )
        if self.num_layers % (self.pp * self.vpp):
            raise ValueError(
                f"megatron.pipeline_parallel={self.pp} x megatron.virtual_pipeline={self.vpp} does not divide "
                f"num_hidden_layers={self.num_layers} (model chunks hold equal numbers of layers)"
            )

    @property
    def per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def per_chunk(self) -> int:
        """Decoder layers in one model chunk (`per_stage` without virtual stages)."""
        return self.num_layers // (self.pp * self.vpp)

    def layer_of(self, name: str) -> int | None:
        """The global decoder layer of megatron tensor `name`, None outside the decoder layers."""
        m = _LAYER.match(name)
        return int(m.group(1)) if m else None

    def place_of(self, name: str) -> tuple[int, int]:
        """(stage, virtual chunk) holding megatron tensor `name` (global layer index)."""
        m = _LAYER.match(name)
        if m:
            chunk = int(m.group(1)) // self.per_chunk
            return chunk % self.pp, chunk // self.pp
        return (0, 0) if name.startswith("embedding.") else (self.pp - 1, self.vpp - 1)

    def stage_of(self, name: str) -> int:
        """The stage holding megatron tensor `name` (global layer index)."""
        return self.place_of(name)[0]

    def local_name(self, name: str) -> str:
        """`name` as its model chunk calls it (the layer index relative to the chunk)."""
        return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) % self.per_chunk}.", name, count=1)

    def layer_index(self, stage: int, local: int, chunk: int = 0) -> int:
        """The global index of layer `local` of `stage`'s virtual `chunk`."""
        return (chunk * self.pp + stage) * self.per_chunk + local

    def chunk_starts(self) -> list[int]:
        """The first decoder layer of every model chunk but the first, in layer order: where only hidden states
        arrive from the previous chunk."""
        return [c * self.per_chunk for c in range(1, self.pp * self.vpp)]

    def copies(self, name: str, stage: int) -> list[tuple[int, str]]:
        """(virtual chunk, local name) under which `stage` holds megatron tensor `name`: the tensor itself on its
        chunk, and the last chunk's copy of a tied embedding."""
        where, chunk = self.place_of(name)
        out = [(chunk, self.local_name(name))] if where == stage else []
        tied_copy = self.tied_embeddings and self.pp > 1 and name == "embedding.word_embeddings.weight"
        if tied_copy and stage == self.pp - 1:
            out.append((self.vpp - 1, "output_layer.weight"))
        return out


def layout_limits(cfg: ModelConfig, *, pp: int = 1, vpp: int = 1, recompute: str | None = None) -> list[str]:
    """What the megatron trainer refuses to build for `cfg` in this layout (`pp` stages of `vpp` virtual chunks) and
    activation `recompute` (None, "full" or "selective"), empty: nothing; each message names the key;
    `train/mcore_model.py` raises the first, the layout planner reports them all."""
    out = []
    if recompute == "selective" and cfg.is_dsa:
        out.append(
            f"megatron.recompute_granularity=selective with {cfg.model_type}: megatron-core's MLA does not hand a "
            "checkpointed core attention the DSA indexer's inputs; use recompute_granularity=full"
        )
    chunked = vpp == 1 or pp >= 3  # else `StageLayout` refuses the layout itself
    if cfg.is_dsa and pp > 1 and chunked and cfg.num_hidden_layers % (pp * vpp) == 0:
        layout = StageLayout(pp, cfg.num_hidden_layers, vpp=vpp)
        for first in layout.chunk_starts():
            if not cfg.indexer_full(first):
                full = max(i for i in range(first) if cfg.indexer_full(i))
                stage, chunk = layout.place_of(f"decoder.layers.{first}.x")
                where = f"stage {stage}" if vpp == 1 else f"stage {stage}'s virtual chunk {chunk}"
                out.append(
                    f"megatron.pipeline_parallel={pp}"
                    + (f" x megatron.virtual_pipeline={vpp}" if vpp > 1 else "")
                    + f": indexer_types[{first}] is 'shared' and starts {where}; it reuses the top-k of layer {full} "
                    "in the model chunk before, and megatron's pipeline passes only hidden states between chunks"
                )
                break
    return out
