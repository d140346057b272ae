"""Context parallelism in the megatron-core backend (stage: train; used by `train/mcore_model.py` and
`train/megatron.py`): megatron's CP groups and RoPE slicing, with this project's attention for the packed row
(`train/context_parallel.py`), since megatron-core's local `DotProductAttention` refuses CP (only Transformer
Engine's attention takes it).

How a packed micro-batch runs at CP > 1: `packed_logits` pads the row to `row_layout(T).padded` (a multiple of
2 x CP, and of TP under sequence parallelism) and hands the model this CP rank's tokens, in the load-balanced
order (chunks r and 2 CP - 1 - r), with the whole row's mask; megatron's rotary embedding slices its frequencies
the same way (`get_pos_emb_on_this_cp_rank`), so each token keeps its row position. Every layer but the attention
is per token; `CPCoreAttention` all-gathers K and V over the CP group and attends the local queries under the
mask's rows for their positions. The logits stay local: `context_parallel.cp_token_logprobs` scores each local row
and gathers the per-token log-probs into the whole row, which every CP rank then reads alike (the loss, metrics),
its backward handing each rank its own rows' gradient; megatron's DDP sums the weights' gradients over the data-
and context-parallel ranks (the trainer scales the loss by DP x CP, as by DP alone without CP).

The MLA families: MLA's core attention is replaced the same way (its v head width differs: SDPA takes it); the DSA
core attention (`mcore_dsa._DSACoreAttention`) selects over the whole row (the indexer's inputs gathered over the
CP ranks) and attends its local queries over the gathered keys. The DSA indexer loss under CP is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state

from miles_hpc.train.context_parallel import CPLayout, cp_attention, cp_layout
from miles_hpc.train.mcore_attention import RowCoreAttention, replace_core_attention

__all__ = ["CPCoreAttention", "context_parallel", "cp_core_attention", "cp_rows", "row_layout"]


def context_parallel() -> int:
    """The CP size of megatron's parallel state."""
    return parallel_state.get_context_parallel_world_size()


def row_layout(tokens: int, sequence_parallel: bool) -> CPLayout:
    """The split of a packed row of `tokens` tokens over this model's CP ranks (each share a multiple of TP under
    sequence parallelism, whose ranks split it again)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return cp_layout(tokens, context_parallel(), tp if sequence_parallel else 1)


def cp_rows(rows: torch.Tensor, layout: CPLayout, fill: int = -1) -> torch.Tensor:
    """This CP rank's rows of per-token `rows` [T, ...] (padded with `fill` to the layout's row), in its local
    order."""
    t = rows.shape[0]
    if layout.padded > t:
        rows = torch.cat([rows, rows.new_full((layout.padded - t, *rows.shape[1:]), fill)])
    return rows[layout.positions(parallel_state.get_context_parallel_rank(), rows.device)]


class CPCoreAttention(RowCoreAttention):
    """megatron's core-attention interface (the local `DotProductAttention`'s arguments) for CP > 1: this rank's
    queries [n, 1, heads, d] against the whole row's keys and values (`context_parallel.cp_attention`), the mask
    the whole row's [1, 1, T, T] (True = masked). Scale and dropout as `RowCoreAttention`."""

    WHAT = "context parallelism here"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None or query.shape[1] != 1:
            raise NotImplementedError("context parallelism here runs one packed row with its block-diagonal mask")
        t = attention_mask.shape[-1]
        layout = cp_layout(t, context_parallel())
        if layout.padded != t or query.shape[0] != t // layout.cp:
            raise ValueError(f"CP attention: a {t}-token row split over {layout.cp} ranks, got {query.shape[0]} here")
        rank = parallel_state.get_context_parallel_rank()
        allowed = ~attention_mask[0, 0][layout.positions(rank, attention_mask.device)]
        group = parallel_state.get_context_parallel_group()
        out = cp_attention(query[:, 0], key[:, 0], value[:, 0], allowed, layout, group, scale=self.softmax_scale)
        return out.reshape(out.shape[0], 1, -1)


def cp_core_attention(spec: Any) -> Any:
    """`spec` (a layer or block spec, nested) with megatron's local core attention (and MLA's, a subclass)
    replaced by `CPCoreAttention`; DSA's core attention handles CP itself (`mcore_dsa`)."""
    return replace_core_attention(spec, CPCoreAttention)
