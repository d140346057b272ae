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

import torch

from miles_hpc.models import CausalLM, ModelConfig, iter_hf_tensors
from miles_hpc.planner.mcore_layout import (
    MCORE_FAMILIES,
    Rule,
    is_frozen,
    mcore_boxes,
    mcore_rules,
    padded_vocab_size,
)

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
