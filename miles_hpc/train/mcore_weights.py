"""HF <-> megatron-core weight mapping (stage: train; used by `train/megatron.py`). Pure tensor functions: no
megatron import, no process group, so the layouts are unit-tested without megatron.

Megatron names are those of `GPTModel` built with the local layer spec (`get_gpt_layer_local_spec`):

| HF (our `iter_hf_tensors`) | megatron-core | TP split |
| --- | --- | --- |
| `model.embed_tokens.weight` | `embedding.word_embeddings.weight` | rows (vocab, padded) |
| `model.layers.i.input_layernorm.weight` | `decoder.layers.i.input_layernorm.weight` | replicated |
| `...self_attn.{q,k,v}_proj.weight` (`.bias`) | `...self_attention.linear_qkv.weight` | rows, by query group |
| `...self_attn.o_proj.weight` | `...self_attention.linear_proj.weight` | columns |
| `...self_attn.o_proj.bias` | `...self_attention.linear_proj.bias` | replicated |
| `...self_attn.{q,k}_norm.weight` | `...self_attention.{q,k}_layernorm.weight` | replicated |
| MLA: `...self_attn.q_proj.weight` (no q LoRA) | `...self_attention.linear_q_proj.weight` | rows, by head (**) |
| MLA: `...self_attn.q_a_proj.weight` | `...self_attention.linear_q_down_proj.weight` | rows |
| MLA: `...self_attn.q_a_layernorm.weight` | `...self_attention.q_layernorm.weight` | replicated |
| MLA: `...self_attn.q_b_proj.weight` | `...self_attention.linear_q_up_proj.weight` | rows, by head (**) |
| MLA: `...self_attn.kv_a_proj_with_mqa.weight` | `...self_attention.linear_kv_down_proj.weight` | rows (**) |
| MLA: `...self_attn.kv_a_layernorm.weight` | `...self_attention.kv_layernorm.weight` | replicated |
| MLA: `...self_attn.kv_b_proj.weight` | `...self_attention.linear_kv_up_proj.weight` | rows, by head |
| `...post_attention_layernorm.weight` | `decoder.layers.i.pre_mlp_layernorm.weight` | replicated |
| `...mlp.{gate,up}_proj.weight` | `decoder.layers.i.mlp.linear_fc1.weight` | rows, gate and up each |
| `...mlp.down_proj.weight` | `...mlp.linear_fc2.weight` | columns |
| `...mlp.gate.weight` (MoE router) | `decoder.layers.i.mlp.router.weight` | replicated |
| `...mlp.gate.e_score_correction_bias` (GLM) | `...mlp.router.expert_bias` (a buffer) | replicated |
| `...mlp.shared_experts.{gate,up,down}_proj.weight` | `...mlp.shared_experts.linear_fc{1,2}.weight` | as the MLP |
| `...mlp.experts.e.{gate,up}_proj.weight` | `...experts.local_experts.l.linear_fc1.weight` (*) | none (expert TP 1) |
| `...mlp.experts.e.down_proj.weight` | `...mlp.experts.local_experts.l.linear_fc2.weight` | none |
| DSA (full layers): `...self_attn.indexer.wq_b.weight` | `...self_attention.core_attention.indexer.linear_wq_b.weight` | replicated |
| DSA: `...self_attn.indexer.{wk,weights_proj}.weight` | `...core_attention.indexer.linear_{wk,weights_proj}.weight` | replicated |
| DSA: `...self_attn.indexer.k_norm.{weight,bias}` | `...core_attention.indexer.k_norm.{weight,bias}` | replicated |
| MTP: `model.layers.{N+j}.{enorm,hnorm}.weight` | `mtp.layers.j.{enorm,hnorm}.weight` | replicated |
| MTP: `model.layers.{N+j}.eh_proj.weight` | `mtp.layers.j.eh_proj.weight` | rows |
| MTP: `model.layers.{N+j}.shared_head.norm.weight` | `mtp.layers.j.final_layernorm.weight` | replicated |
| MTP: `model.layers.{N+j}.<decoder layer>` | `mtp.layers.j.transformer_layer.<as decoder.layers.i>` | as there |
| `model.norm.weight` | `decoder.final_layernorm.weight` | replicated |

| `lm_head.weight` (untied) | `output_layer.weight` | rows (vocab, padded) |

(*) on expert-parallel rank e // (E / ep), as local expert l = e % (E / ep).
(**) with `rope_interleave=False`, the rotary rows in megatron's order (below).
The indexers (without the indexer loss) and the MTP layers are held frozen (`is_frozen`): our model gives them no
gradient either.

Layouts (megatron's, for TP size t):
- `linear_qkv` holds, per query group g (a kv head), the group's query heads, then its key head, then its value
  head: `[g0: q.. k v | g1: q.. k v | ...]` along the output dim; rank r holds groups r*G/t .. (r+1)*G/t - 1. The
  query heads of those groups are exactly the heads whose `linear_proj` columns rank r holds.
- `linear_fc1` on rank r is `[gate rows of r; up rows of r]` (each of gate and up split in t), so the full
  (t = 1) tensor is `[gate; up]` and a TP shard is not a contiguous slice of it.
- MLA (DeepSeek-V3): megatron's down projections are column-parallel too (each rank computes its rows of the
  latent and gathers the rest), so every projection but `linear_proj` splits rows in t contiguous pieces; the
  per-head layouts ([nope | rope] for q, [nope | v] for kv_b) are HF's, so a rank's rows are whole heads. Megatron's
  MLA RoPE always reads the rotary dims as interleaved pairs (x0, x1), (x2, x3), ... (it de-interleaves them
  before rotating halves), which is `rope_interleave=True` as is. For `rope_interleave=False` (halves rotated) the
  rotary rows of q (per head) and of `kv_a_proj_with_mqa` are stored interleaved: megatron row 2i is HF row i,
  row 2i+1 is HF row d/2 + i, so the de-interleaving gives back HF's halves and the scores are HF's.
- The vocabulary is padded to `padded_vocab_size` (a multiple of 128 x t, as Megatron-LM does) with zero rows;
  logits of padding ids are dropped before any softmax (`train/megatron.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from miles_hpc.models import CausalLM, ModelConfig, iter_hf_tensors
from miles_hpc.planner.transfer import Box

__all__ = [
    "MCORE_FAMILIES",
    "Rule",
    "from_mcore",
    "hf_order",
    "is_frozen",
    "iter_full_hf",
    "local_hf_parts",
    "mcore_boxes",
    "mcore_rules",
    "padded_vocab_size",
    "to_mcore",
]

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


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary rows megatron holds: `vocab` rounded up to a multiple of `multiple * tp`."""
    step = multiple * tp
    return -(-vocab // step) * step


def mcore_rules(cfg: ModelConfig) -> list[Rule]:
    """Every megatron tensor of a `GPTModel` for `cfg` (local spec), with its HF sources, in layer order; the
    multi-token-prediction layers (`num_nextn_predict_layers`) as megatron's `MultiTokenPredictionLayer`s
    (`mtp.layers.j`, the decoder layer inside as `transformer_layer`)."""
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


def to_mcore(rule: Rule, hf: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_rank: int, tp: int) -> torch.Tensor:
    """The TP rank's shard of `rule.mcore` from the full HF tensors `hf` (a new tensor, contiguous)."""
    src = [hf[n] for n in rule.hf]
    if rule.kind == "replicated" or rule.kind == "expert_fc2":  # experts are whole on their owner (expert TP 1)
        return src[0].clone()
    if rule.kind == "expert_fc1":
        return torch.cat(src)
    if rule.kind == "cols":
        return _chunk(src[0], 1, tp, tp_rank, rule).clone()
    if rule.kind == "vocab":
        t = src[0]
        full = t.new_zeros((padded_vocab_size(cfg.vocab_size, tp), *t.shape[1:]))
        full[: t.shape[0]] = t
        return _chunk(full, 0, tp, tp_rank, rule).clone()
    if rule.kind == "fc1":
        return torch.cat([_chunk(s, 0, tp, tp_rank, rule) for s in src])
    if rule.kind == "qkv":
        return _chunk(_fuse_qkv(cfg, *src), 0, tp, tp_rank, rule).clone()
    if rule.kind in ("rows", "q_heads", "kv_down"):
        perm = _row_perm(rule, cfg, tp)
        return _chunk(src[0] if perm is None else src[0][perm], 0, tp, tp_rank, rule).clone()
    raise AssertionError(rule.kind)


def from_mcore(rule: Rule, shards: list[torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The full HF tensors of `rule` from its shards on TP ranks 0..t-1 (inverse of `to_mcore`; an expert tensor
    has one shard, its owner's)."""
    tp = len(shards)
    if rule.kind == "replicated" or rule.kind == "expert_fc2":
        return {rule.hf[0]: shards[0]}
    if rule.kind == "expert_fc1":
        gate, up = shards[0].chunk(2, 0)
        return {rule.hf[0]: gate, rule.hf[1]: up}
    if rule.kind == "cols":
        return {rule.hf[0]: torch.cat(shards, 1)}
    if rule.kind == "vocab":
        return {rule.hf[0]: torch.cat(shards, 0)[: cfg.vocab_size]}
    if rule.kind == "fc1":
        halves = [s.chunk(2, 0) for s in shards]
        return {rule.hf[0]: torch.cat([h[0] for h in halves]), rule.hf[1]: torch.cat([h[1] for h in halves])}
    if rule.kind == "qkv":
        q, k, v = _split_qkv(cfg, torch.cat(shards, 0))
        return dict(zip(rule.hf, (q, k, v)))
    if rule.kind in ("rows", "q_heads", "kv_down"):
        full, perm = torch.cat(shards, 0), _row_perm(rule, cfg, tp)
        return {rule.hf[0]: full if perm is None else full[torch.argsort(perm)]}
    raise AssertionError(rule.kind)


def hf_order(cfg: ModelConfig) -> list[str]:
    """HF tensor names in `iter_hf_tensors` order (the order `Trainer.state_for_sync` yields), from a model on
    the meta device: no memory."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return [name for name, _ in iter_hf_tensors(model)]


def iter_full_hf(cfg: ModelConfig, gather: Callable[[Rule], list[torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) in `hf_order`, each rule's TP shards fetched by `gather(rule)` once, when its first
    HF tensor comes up (at most one rule's tensors held at a time, plus fused partners waiting their turn)."""
    by_hf = {name: rule for rule in mcore_rules(cfg) for name in rule.hf}
    ready: dict[str, torch.Tensor] = {}
    for name in hf_order(cfg):
        if name not in ready:
            ready.update(from_mcore(by_hf[name], gather(by_hf[name]), cfg))
        yield name, ready.pop(name)


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


def local_hf_parts(rule: Rule, local: torch.Tensor, cfg: ModelConfig, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's parts of `rule`'s HF tensors from its local megatron tensor: the data of the boxes of
    `mcore_boxes` (views where the layout allows, copies for the fused QKV's q, k, v)."""
    if rule.kind in ("replicated", "cols", "expert_fc2"):
        return {rule.hf[0]: local}
    if rule.kind == "vocab":  # the padding rows are nobody's
        step = padded_vocab_size(cfg.vocab_size, tp) // tp
        held = max(0, min(cfg.vocab_size, (tp_rank + 1) * step) - tp_rank * step)
        return {rule.hf[0]: local[:held]}
    if rule.kind in ("fc1", "expert_fc1"):
        gate, up = local.chunk(2, 0)
        return {rule.hf[0]: gate, rule.hf[1]: up}
    if rule.kind == "qkv":
        groups = cfg.num_key_value_heads // tp
        q, k, v = _split_groups(local, groups, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim)
        return dict(zip(rule.hf, (q, k, v)))
    if rule.kind in ("rows", "q_heads", "kv_down"):
        perm = _row_perm(rule, cfg, tp)
        if perm is None:
            return {rule.hf[0]: local}
        step = perm.numel() // tp  # this rank's rows, back in HF order (a copy)
        return {rule.hf[0]: local[torch.argsort(perm[tp_rank * step : (tp_rank + 1) * step])]}
    raise AssertionError(rule.kind)


# ---------------------------------------------------------------- layouts
def _row_perm(rule: Rule, cfg: ModelConfig, tp: int) -> torch.Tensor | None:
    """MLA with `rope_interleave=False`: megatron row j of `rule`'s tensor is HF row perm[j] (the rotary rows
    interleaved, see the module docstring); None where the rows are HF's as they are. The reordering stays inside
    each TP rank's rows (whole heads for q; for kv_a, raises where the rotary rows straddle two ranks)."""
    if rule.kind not in ("q_heads", "kv_down") or cfg.rope_interleave:
        return None
    d = cfg.head_dim
    rope = torch.arange(d).view(2, d // 2).t().reshape(-1)  # [0, d/2, 1, d/2 + 1, ...]
    if rule.kind == "q_heads":
        nope = cfg.qk_nope_head_dim
        head = torch.cat([torch.arange(nope), nope + rope])
        return (head + (nope + d) * torch.arange(cfg.num_attention_heads)[:, None]).reshape(-1)
    rank = cfg.kv_lora_rank
    step = (rank + d) // tp
    if rank // step != (rank + d - 1) // step:
        raise NotImplementedError(
            f"{rule.mcore}: rope_interleave=False with tensor parallel {tp}: the rotary rows "
            f"{rank}..{rank + d - 1} of kv_a_proj_with_mqa straddle two TP ranks"
        )
    return torch.cat([torch.arange(rank), rank + rope])


def _chunk(t: torch.Tensor, dim: int, tp: int, rank: int, rule: Rule) -> torch.Tensor:
    if t.shape[dim] % tp:
        raise ValueError(f"{rule.mcore}: dim {dim} of size {t.shape[dim]} does not split over tensor parallel {tp}")
    return t.chunk(tp, dim)[rank]


def _fuse_qkv(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[G x (q heads of the group, k, v)] along dim 0 (weights [rows, hidden] or biases [rows])."""
    groups, hd = cfg.num_key_value_heads, cfg.head_dim
    per = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, per * hd, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest))
    return torch.cat(parts, 1).reshape(-1, *rest)


def _split_qkv(cfg: ModelConfig, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = cfg.num_key_value_heads
    return _split_groups(fused, groups, cfg.num_attention_heads // groups, cfg.head_dim)


def _split_groups(
    fused: torch.Tensor, groups: int, per: int, hd: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v rows of `groups` fused query groups of `per` query heads each."""
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, (per + 2) * hd, *rest).split([per * hd, hd, hd], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
