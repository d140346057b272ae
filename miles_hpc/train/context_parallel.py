"""Context parallelism for packed rows (stage: train; the megatron trainer's CP, `train/mcore_cp.py`): a packed
micro-batch's row split over the CP ranks of one model replica, causal attention of each rank's queries against
the whole row's keys and values, gathered from the CP ranks, and the per-token log-probs gathered back.

Layout (`cp_layout`, pure): the row is padded to a multiple of 2 x CP x `multiple` (`multiple`: TP under sequence
parallelism, whose ranks split each CP rank's share again) and cut into 2 x CP equal chunks; rank r holds chunks r
and 2 CP - 1 - r, megatron's load balancing for causal attention: over one sequence that fills the row every rank's
queries see the same number of keys (the early chunk few, the late one many). megatron-core's RoPE for CP slices
its frequencies the same way (`get_pos_emb_on_this_cp_rank`).

Attention (`cp_attention`): all-gather of K and V over the CP group (`gather_row`; backward: the row's gradient
summed over the CP ranks, each keeping its own positions), then torch's scaled_dot_product_attention of the local
queries against the whole row under the packed row's rule: a query sees the keys of its own sequence at or before
its position. Exact against attention over the unsplit row (tests/test_context_parallel.py, gloo).

Memory: each rank holds the whole row's K and V per layer while it attends ([S, kv heads, d], all-gather
attention, not a ring), and a boolean [S / CP, S] mask; the scores are what torch's SDPA kernel keeps (on the CPU
the math kernel materialises [heads, S / CP, S]; on a GPU a kernel that takes a mask need not: not measured, and
the layout planner counts them materialised).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from miles_hpc.train.logprobs import LogProbEntropy, PackedMicroBatch, rows_to_tokens

__all__ = [
    "CPLayout",
    "allowed_rows",
    "cp_attention",
    "cp_layout",
    "cp_token_logprobs",
    "gather_replicated",
    "gather_row",
]


@dataclass(frozen=True, slots=True)
class CPLayout:
    """A packed row of `tokens` tokens split over `cp` ranks: padded to `padded`, in 2 x cp chunks of `chunk` (cp 1:
    one chunk, the row)."""

    tokens: int
    cp: int
    padded: int
    chunk: int

    def chunks(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank `rank` holds, in the order its local tokens follow."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"CP rank {rank} outside 0..{self.cp - 1}")
        return rank, 2 * self.cp - 1 - rank

    def positions(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Row positions [padded / cp] of rank `rank`'s local tokens, in local order."""
        a, b = self.chunks(rank)
        if self.cp == 1:
            return torch.arange(self.padded, device=device)
        c = self.chunk
        return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]).to(device)

    def gathered_order(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """For the ranks' local tokens concatenated rank by rank (an all-gather), the index of each row position
        in that concatenation: `gathered[order]` is the row in order."""
        ranks = torch.cat([self.positions(r) for r in range(self.cp)])
        order = torch.empty_like(ranks)
        order[ranks] = torch.arange(ranks.numel())
        return order.to(device)


def cp_layout(tokens: int, cp: int, multiple: int = 1) -> CPLayout:
    """The split of a packed row of `tokens` tokens over `cp` ranks, each rank's share a multiple of `multiple`
    (module docstring). cp 1: the row as it is, padded to `multiple`."""
    if tokens < 1 or cp < 1 or multiple < 1:
        raise ValueError(f"cp_layout: tokens, cp and multiple must be >= 1, got {tokens}, {cp}, {multiple}")
    unit = 2 * cp * multiple if cp > 1 else multiple
    padded = -(-tokens // unit) * unit
    return CPLayout(tokens=tokens, cp=cp, padded=padded, chunk=padded // (2 * cp) if cp > 1 else padded)


class _GatherRow(torch.autograd.Function):
    """Forward: the whole row [padded, ...] from each CP rank's local tokens [padded / cp, ...]. Backward: the row's
    gradient summed over the CP ranks (each one's queries reached every key), this rank's positions kept."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, layout: CPLayout, group: Any) -> torch.Tensor:
        ctx.layout, ctx.group = layout, group
        parts = [torch.empty_like(local) for _ in range(layout.cp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)[layout.gathered_order(local.device)]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout, group = ctx.layout, ctx.group
        # a copy: the reduction is in place, and autograd may hold the incoming gradient elsewhere
        # TODO(scale): a reduce-scatter on NCCL (gloo has none) sends 1 / cp of this
        grad = grad.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(grad, group=group)
        rank = torch.distributed.get_rank(group)
        return grad[layout.positions(rank, grad.device)], None, None


def gather_row(local: torch.Tensor, layout: CPLayout, group: Any) -> torch.Tensor:
    """The whole packed row from each CP rank's local tokens (dim 0), differentiable (`_GatherRow`)."""
    if layout.cp == 1:
        return local
    return _GatherRow.apply(local, layout, group)


class _GatherReplicated(torch.autograd.Function):
    """Forward: as `_GatherRow`. Backward: this rank's positions of the row's gradient, not summed: for values every
    CP rank then uses alike (the per-token log-probs the loss reads), whose gradient is the same on every rank."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, layout: CPLayout, group: Any) -> torch.Tensor:
        ctx.layout, ctx.rank = layout, torch.distributed.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(layout.cp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)[layout.gathered_order(local.device)]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[ctx.layout.positions(ctx.rank, grad.device)], None, None


def gather_replicated(local: torch.Tensor, layout: CPLayout, group: Any) -> torch.Tensor:
    """The whole row from each CP rank's local values (dim 0), for a computation every CP rank repeats alike: its
    backward hands each rank its own positions' gradient (`_GatherReplicated`)."""
    if layout.cp == 1:
        return local
    return _GatherReplicated.apply(local, layout, group)


def cp_token_logprobs(
    logits: torch.Tensor,
    mb: PackedMicroBatch,
    layout: CPLayout,
    group: Any,
    *,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs.token_logprobs` of a micro-batch whose logits [1, padded / cp, vocab] are this CP rank's rows
    (`layout.positions` order): each row scores the row's next token, then the per-row log-probs (and entropies)
    are gathered into the whole row, so every CP rank returns the same [T] as the unsplit computation."""
    ids = mb.input_ids[0]
    t = ids.shape[0]
    rank = torch.distributed.get_rank(group) if layout.cp > 1 else 0
    nxt = torch.cat([ids[1:], ids.new_zeros(layout.padded - t + 1)])  # the row's next tokens (padding: any)
    target = nxt[layout.positions(rank, ids.device)]
    lp, ent = LogProbEntropy.apply(logits.flatten(0, 1), target, with_entropy)
    rows = gather_replicated(lp, layout, group)[:t]
    ent_rows = gather_replicated(ent, layout, group)[:t] if with_entropy else None
    return rows_to_tokens(rows, ent_rows, mb, entropy_grad=entropy_grad)


def allowed_rows(seq_ids: torch.Tensor, layout: CPLayout, rank: int) -> torch.Tensor:
    """The packed row's attention rule for rank `rank`'s queries: [padded / cp, padded] True where a query sees a
    key (its own sequence, at or before its position); `seq_ids` [padded] the sequence of every row position
    (padding: each its own id)."""
    pos = layout.positions(rank, seq_ids.device)
    row = torch.arange(layout.padded, device=seq_ids.device)
    return (seq_ids[pos][:, None] == seq_ids[None, :]) & (row[None, :] <= pos[:, None])


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    layout: CPLayout,
    group: Any,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this CP rank's queries over a packed row: q [n, heads, d], k [n, kv heads, d] and v [n, kv
    heads, dv] for its local tokens (n = padded / cp, `layout.positions` order), `allowed` [n, padded] which keys
    each query sees (`allowed_rows`; a causal block-diagonal mask's rows at the local positions, negated). Returns
    [n, heads, dv]. GQA: heads a multiple of kv heads."""
    n = layout.padded // layout.cp
    if q.shape[0] != n or k.shape[0] != n or v.shape[0] != n or allowed.shape != (n, layout.padded):
        raise ValueError(
            f"cp_attention: {n} local tokens of a {layout.padded}-token row expected, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, allowed {tuple(allowed.shape)}"
        )
    keys, values = gather_row(k, layout, group), gather_row(v, layout, group)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=allowed[None, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
