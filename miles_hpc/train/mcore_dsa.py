"""DeepSeek sparse attention (DSA: DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`) in the megatron-core backend
(stage: train; used by `train/mcore_model.py` through `train/mcore_mla.local_mla_spec`): megatron's MLA with its
experimental DSA core attention (`transformer/experimental_attention_variant/dsa.py`: `DSAttention`, `DSAIndexer`,
`unfused_dsa_fn`), made to compute what transformers 5.24 computes (our `models/dsa.py`).

What is megatron's here: MLA hands the core attention the layer input and the normed compressed query
(`experimental_attention_variant="dsa"`); `DSAIndexer` builds the indexer's modules (wq_b, wk, its LayerNorm
k_norm, weights_proj, and its RoPE, MLA's frequencies, yarn included) and scores (`_compute_index_scores`:
relu(q.k) weighted per head, summed, in float32); `apply_rotary_pos_emb` rotates the leading rope part
(interleaved pairs, as MLA's); `unfused_dsa_fn` attends over the selected keys (float32 softmax).

Where megatron-core 0.16's DSA differs from transformers, and what is ours instead (`_DSAIndexer.select`,
`_DSACoreAttention.forward`):
- it rotates q and k with a Hadamard transform before scoring (`rotate_activation`: bf16 only, and the CUDA
  package fast_hadamard_transform); transformers does not (orthogonal: the same scores up to rounding): not here;
- it splits the indexer head as [nope | rope]; transformers as [rope | nope]: the rope part is rotated first here;
  DeepSeek-V3.2's indexer rotates halves, not pairs: its rope part is laid out as pairs before megatron's rotation
  (which de-interleaves them back), so no weight is reordered;
- its k_norm takes `layernorm_epsilon` (= rms_norm_eps, 1e-5 in GLM-5); transformers builds it with 1e-6;
- it takes the head weights times softmax scale in the activations' dtype; here in float32 as transformers;
- it scores and selects over the whole packed row and its causal `attn_mask_type` ignores our block-diagonal
  mask, so a query attends across packed sequences; here each packed sequence (from the mask) is scored on its
  own, laid out as transformers lays it (future keys at -inf, top min(index_topk, length)), so equal scores (the
  exact zeros of relu) meet the same `torch.topk` as in the reference; the indices, offset into the row, go to
  `unfused_dsa_fn`, which then never sees another sequence's key;
- it computes the KL indexer loss in every training forward (a [heads, T, T] float32 softmax, even at
  coefficient 0) over the whole packed row, and attaches it with an autoscaler whose scale megatron's schedule
  does not set for it; here the loss is computed only with `train.indexer_loss_coef` > 0 (else the indexers are
  frozen, as in our model), per packed sequence, by megatron's own `compute_dsa_indexer_loss`, and summed over the
  rows into `SharedSelection.kl`, which the trainer adds to its loss as the FSDP backend does (models/dsa.py:
  `indexer_kl`, the same value; one pipeline stage only);
- it has no GLM-5.2 "shared" layers: here a shared layer has no indexer (`IdentityOp`) and takes the last full
  layer's selection through a per-model `SharedSelection`;
- its indexer linears are Transformer Engine's ("duplicated", replicated over TP): here a replicated local linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttention,
    DSAttentionSubmodules,
    compute_dsa_indexer_loss,
    unfused_dsa_fn,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.multiprocessing.reductions import StorageWeakRef

from miles_hpc.models import ModelConfig
from miles_hpc.planner.mcore_layout import INDEXER_SCORE_ELEMENTS, StageLayout, layout_limits
from miles_hpc.train.context_parallel import cp_layout, gather_row
from miles_hpc.train.mcore_mla import FixedEpsNorm

__all__ = [
    "SharedSelection",
    "check_dsa_pipeline",
    "decoder_selection",
    "dsa_core_attention",
    "dsa_kwargs",
    "share_selections",
]

INDEXER_K_NORM_EPS = 1e-6  # transformers' DeepseekV32Indexer / GlmMoeDsaIndexer: nn.LayerNorm(head_dim, eps=1e-6)


def dsa_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`MLATransformerConfig` fields of the DSA families (with `mcore_mla.mla_kwargs`)."""
    return dict(
        experimental_attention_variant="dsa",  # MLA passes the core attention its input and compressed query
        dsa_indexer_n_heads=cfg.index_n_heads,
        dsa_indexer_head_dim=cfg.index_head_dim,
        dsa_indexer_topk=cfg.index_topk,
        dsa_indexer_loss_coeff=0.0,
    )


def check_dsa_pipeline(cfg: ModelConfig, layout: StageLayout) -> None:
    """Refuse model chunks (pipeline stages, virtual chunks) that start with a GLM-5.2 "shared" layer: its selection
    is the previous full layer's, in the chunk before, and megatron's pipeline passes only hidden states between
    chunks."""
    if problems := layout_limits(cfg, pp=layout.pp, vpp=layout.vpp):
        raise NotImplementedError(problems[0])


def dsa_core_attention(cfg: ModelConfig, layer_idx: int) -> ModuleSpec:
    """The core attention spec of DSA layer `layer_idx` (global index; MTP layers past the decoder have their own
    indexer): with megatron's indexer modules on a full layer, none on a shared one."""
    indexer: Any = IdentityOp
    if cfg.indexer_full(layer_idx):
        parts = DSAIndexerSubmodules(
            linear_wq_b=_ReplicatedLinear,
            linear_wk=_ReplicatedLinear,
            k_norm=_IndexerKNorm,
            linear_weights_proj=_ReplicatedLinear,
        )
        indexer = ModuleSpec(
            module=_DSAIndexer, params={"rope_halves": not cfg.indexer_rope_interleave}, submodules=parts
        )
    source = max(i for i in range(layer_idx + 1) if cfg.indexer_full(i))  # a shared layer's full layer
    return ModuleSpec(
        module=_DSACoreAttention, params={"source": source}, submodules=DSAttentionSubmodules(indexer=indexer)
    )


class _Forward:
    """One forward of the decoder (one micro-batch, keyed by its mask): its packed sequences' bounds and each full
    layer's selection (global layer index -> top-k [b, T, K] int32), which the layer's "shared" followers read."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans = spans
        self.topk: dict[int, torch.Tensor] = {}


class SharedSelection:
    """The DSA state the forwards of a decoder share between its layers, per forward (`_Forward`, keyed by the
    storage of its attention mask): the packed sequences' bounds and each full layer's selection, which "shared"
    layers reuse. Under activation recompute (megatron's full or selective) a layer runs again in backward, in
    reverse order and, under the 1F1B schedule, after later micro-batches' forwards: keyed by the mask its
    checkpoint saved, a recomputed shared layer reads the selection its full layer made in that micro-batch's
    forward, and a recomputed full layer reuses its own. A forward's entry lives as long as its mask does (until
    its backward is done)."""

    def __init__(self) -> None:
        self._forwards: dict[StorageWeakRef, _Forward] = {}
        self.loss_mode: str | None = None  # the indexer loss: None (off), "sparse" or "dense"
        self.collect_kl = False  # set by the trainer for the forwards that train (the indexer loss is computed)
        self.kl: list[torch.Tensor] = []  # each full layer's KL sum over its rows in the training forwards since read

    def forward_of(self, mask: torch.Tensor) -> _Forward:
        """The forward that `mask` (the packed row's block-diagonal causal mask [1, 1, T, T], True = masked)
        belongs to; a new mask starts a new one, with the bounds of its packed sequences."""
        key = StorageWeakRef(mask.untyped_storage())
        if (found := self._forwards.get(key)) is not None:
            return found
        if mask.dim() != 4 or mask.shape[:2] != (1, 1) or mask.dtype != torch.bool:
            raise ValueError(f"DSA needs the packed row's boolean mask [1, 1, T, T], got {tuple(mask.shape)}")
        self._forwards = {k: f for k, f in self._forwards.items() if not k.expired()}  # backward done: dropped
        t = mask.shape[-1]
        first_key = (~mask[0, 0]).int().argmax(-1)  # each row's first visible key: its sequence's start
        starts = torch.nonzero(first_key == torch.arange(t, device=mask.device)).flatten().tolist()
        self._forwards[key] = _Forward(list(zip(starts, [*starts[1:], t])))
        return self._forwards[key]


def share_selections(module: torch.nn.Module) -> None:
    """One `SharedSelection` for the DSA core attentions in `module` (a decoder, or one MTP layer)."""
    shared = SharedSelection()
    for m in module.modules():
        if isinstance(m, _DSACoreAttention):
            m.shared = shared


def decoder_selection(model: torch.nn.Module) -> SharedSelection | None:
    """The decoder's `SharedSelection` (None for a model without DSA layers on this stage; MTP layers, never run
    here, have their own)."""
    for name, m in model.named_modules():
        if isinstance(m, _DSACoreAttention) and ".mtp." not in f".{name}" and m.shared is not None:
            return m.shared
    return None


class _DSAIndexer(DSAIndexer):
    """megatron's DSA indexer (its modules, RoPE and scores), selecting as transformers does (module docstring)."""

    def __init__(self, *args: Any, rope_halves: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rope_halves = rope_halves

    def _apply_rope(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor, mscale: float) -> torch.Tensor:
        """RoPE on the leading `qk_pos_emb_head_dim` dims of x [T, b, *, index_head_dim] (transformers' layout;
        megatron rotates what its freqs span and passes the rest). DeepSeek-V3.2 rotates halves: they are laid out
        as pairs, which megatron's MLA rotation de-interleaves back into halves."""
        d = self.qk_pos_emb_head_dim
        if self.rope_halves:
            rot = x[..., :d]
            x = torch.cat([torch.stack(rot.chunk(2, dim=-1), dim=-1).flatten(-2), x[..., d:]], dim=-1)
        return apply_rotary_pos_emb(
            x, rotary_pos_emb, config=self.config, cu_seqlens=None, mscale=mscale, cp_group=self.pg_collection.cp
        )

    def _project(self, x: torch.Tensor, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's rotated queries [T, b, heads, dim], keys [T, b, dim] and float32 head weights [T, b, heads]
        (with the softmax scale folded in, as megatron does)."""
        t, b, _ = x.shape  # the whole row (megatron's `get_rotary_seq_len` would take x for a TP rank's chunk)
        # packed_seq=True: the whole row's frequencies (megatron slices them for the CP rank otherwise)
        if self.config.rope_type == "rope":
            freqs, mscale = self.rotary_pos_emb(t, packed_seq=True), 1.0
        else:
            freqs, mscale = self.rotary_pos_emb(t, packed_seq=True)
        q, _ = self.linear_wq_b(qr)
        q = self._apply_rope(q.reshape(t, b, self.index_n_heads, self.index_head_dim), freqs, mscale)
        k, _ = self.linear_wk(x)
        k = self._apply_rope(self.k_norm(k).reshape(t, b, 1, self.index_head_dim), freqs, mscale).reshape(t, b, -1)
        w, _ = self.linear_weights_proj(x)
        w = w.float() * (self.index_n_heads**-0.5 * self.softmax_scale)
        return q, k, w

    @torch.no_grad()
    def select(self, x: torch.Tensor, qr: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Top-k key indices [b, T, K] into the packed row for x [T, b, hidden] and the compressed query qr
        [T, b, q_lora_rank]: each sequence's top min(index_topk, length) of its own keys (future keys masked),
        padded to K with a repeat of its first pick."""
        q, k, w = self._project(x, qr)
        width = min(self.index_topk, max(e - s for s, e in spans))
        parts = []
        for s, e in spans:
            # the queries of a sequence in chunks of rows: the float32 scores [rows, b, heads, S] stay within
            # INDEXER_SCORE_ELEMENTS (a 64k-token sequence's whole [S, heads, S] would be TBs); each row's top-k
            # is its own, so the chunks select what the whole would
            step = max(1, INDEXER_SCORE_ELEMENTS // (q.shape[1] * self.index_n_heads * (e - s)))
            keys = torch.arange(e - s, device=q.device)
            for a in range(s, e, step):
                z = min(a + step, e)
                scores = self._compute_index_scores(q[a:z], w[a:z], k[s:e])  # [b, rows, S] float32
                future = keys[None, :] > torch.arange(a - s, z - s, device=q.device)[:, None]
                top = scores.masked_fill(future, float("-inf")).topk(min(self.index_topk, e - s), dim=-1).indices
                parts.append(torch.cat([top, top[..., :1].expand(-1, -1, width - top.shape[-1])], dim=-1) + s)
        return torch.cat(parts, dim=1).to(torch.int32)  # held per forward until its backward: half of int64

    def kl_sum(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        spans: list[tuple[int, int]],
        topk: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        attn_scale: float,
        sparse: bool,
    ) -> torch.Tensor:
        """The indexer loss of this layer summed over the rows: megatron's `compute_dsa_indexer_loss` per packed
        sequence (its mean over rows times their count), with autograd into the indexer only."""
        q, k, w = self._project(x.detach(), qr.detach())
        total = w.new_zeros(())
        for s, e in spans:
            scores = self._compute_index_scores(q[s:e], w[s:e], k[s:e])  # [b, S, S] float32
            future = torch.ones(e - s, e - s, dtype=torch.bool, device=scores.device).triu(1)
            total = (
                total
                + compute_dsa_indexer_loss(
                    scores.masked_fill(future, float("-inf")),
                    (topk[:, s:e] - s).long(),  # the sequence's own positions (padding repeats a pick: no new key)
                    query[s:e].detach(),
                    key[s:e].detach(),
                    attn_scale,
                    float(e - s),  # megatron averages over the rows: back to their sum
                    sparse,
                    self.pg_collection,
                )
            )
        return total


class _DSACoreAttention(DSAttention):
    """megatron's DSA core attention over packed sequences: the selection of this layer's indexer (a full layer)
    or of `source`, the last full layer before it (a shared layer), then megatron's `unfused_dsa_fn`; the indexer
    loss of a full layer in the forwards that train, with `SharedSelection.loss_mode` set (module docstring)."""

    shared: SharedSelection | None = None

    def __init__(self, *args: Any, source: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source  # global index of the full layer whose selection this layer uses (itself if full)

    def forward(  # megatron's signature (MLA passes x and qr with experimental_attention_variant="dsa")
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        x: torch.Tensor | None = None,
        qr: torch.Tensor | None = None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_mask is None or query.shape[1] != 1:
            raise NotImplementedError("megatron DSA here runs one packed row with its block-diagonal mask")
        if self.shared is None:
            raise RuntimeError("DSA core attention without its SharedSelection (share_selections)")
        fwd = self.shared.forward_of(attention_mask)
        recompute = is_checkpointing() and torch.is_grad_enabled()  # megatron's recompute of this layer in backward
        cp = self.config.context_parallel_size
        if isinstance(self.indexer, DSAIndexer) and not (recompute and self.source in fwd.topk):
            assert x is not None and qr is not None
            if self.config.sequence_parallel:  # MLA hands this rank's chunk of the tokens: the indexer scores all
                x, qr = _whole_row(x), _whole_row(qr)
            if cp > 1:  # ... and this CP rank's share of the row
                x, qr = _whole_cp_row(x, attention_mask), _whole_cp_row(qr, attention_mask)
            fwd.topk[self.source] = topk = self.indexer.select(x.detach(), qr.detach(), fwd.spans)
            if self.shared.loss_mode is not None and self.shared.collect_kl and self.training:
                # in a checkpointed forward (no grad) too: the loss trains the indexer alone, from detached inputs
                with torch.enable_grad():
                    sparse = self.shared.loss_mode == "sparse"
                    kl = self.indexer.kl_sum(
                        x, qr, fwd.spans, topk, query, key, attn_scale=self.softmax_scale, sparse=sparse
                    )
                self.shared.kl.append(kl)
        if self.source not in fwd.topk:
            raise RuntimeError(
                f"layer {self.layer_number}: a shared DSA layer before its full layer {self.source} in this forward"
            )
        if cp == 1:
            return unfused_dsa_fn(query, key, value, fwd.topk[self.source].long(), self.softmax_scale)
        # CP: this rank's queries over the whole row's keys and values (gathered: their gradients summed back)
        layout, group = cp_layout(attention_mask.shape[-1], cp), parallel_state.get_context_parallel_group()
        pos = layout.positions(group.rank(), query.device)
        keys, values = gather_row(key, layout, group), gather_row(value, layout, group)
        return _sparse_attention(query, keys, values, fwd.topk[self.source][:, pos].long(), pos, self.softmax_scale)


def _whole_cp_row(share: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The whole packed row [T, b, *] from each CP rank's share (detached, as `_whole_row`), `mask` the row's."""
    layout = cp_layout(mask.shape[-1], parallel_state.get_context_parallel_world_size())
    parts = [torch.empty_like(share) for _ in range(layout.cp)]
    torch.distributed.all_gather(parts, share.detach().contiguous(), group=parallel_state.get_context_parallel_group())
    return torch.cat(parts)[layout.gathered_order(share.device)]


def _sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """megatron's `unfused_dsa_fn` for queries [sq, b, heads, d] at row `positions` [sq] (a CP rank's share) over
    the whole row's keys [skv, b, heads, d]: float32 scores, each query's selected keys `topk` [b, sq, K] at or
    before its position (a sequence shorter than index_topk selects future keys too, at -inf: the causal mask
    drops them, as megatron's), softmax in float32; returns [sq, b, heads * dv]."""
    sq, b, h, _ = query.shape
    scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * scale
    keep = torch.full((b, sq, key.shape[0]), float("-inf"), device=scores.device).scatter_(-1, topk, 0.0)
    future = torch.arange(key.shape[0], device=scores.device)[None, :] > positions[:, None]
    keep = keep.masked_fill(future[None], float("-inf"))
    probs = torch.softmax(scores + keep[:, None], dim=-1, dtype=torch.float32)
    out = torch.einsum("bhqk,kbhd->qbhd", probs.to(value.dtype), value)
    return out.reshape(sq, b, -1)


def _whole_row(chunk: torch.Tensor) -> torch.Tensor:
    """The whole packed row [T, b, *] from each TP rank's chunk under sequence parallelism, detached: the indexer
    selects without gradient, and its loss (`_DSAIndexer.kl_sum`) trains the indexer only, replicated over TP, from
    the same whole row on every rank."""
    return gather_from_sequence_parallel_region(chunk.detach(), tensor_parallel_output_grad=False)


class _IndexerKNorm(FixedEpsNorm):
    """The indexer's LayerNorm (megatron passes it a LayerNorm config) with transformers' eps."""

    eps = INDEXER_K_NORM_EPS


class _ReplicatedLinear(torch.nn.Module):
    """A linear layer whole on every TP rank, megatron's calling convention (returns (output, None)): the local
    stand-in for the Transformer Engine `TELinear(parallel_mode="duplicated")` that megatron's DSA spec uses."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any,
        bias: bool = False,
        parallel_mode: str = "duplicated",
        skip_weight_param_allocation: bool = False,
        **_: Any,
    ) -> None:
        super().__init__()
        if bias or parallel_mode != "duplicated" or skip_weight_param_allocation:
            raise NotImplementedError("the replicated local linear has no bias and allocates its weight")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None
