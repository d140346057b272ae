"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window, plus (per layer kind) entries
compressed from whole blocks of tokens; as transformers 5.24's DeepseekV4Attention computes it (eager, no cache).

Stage: shared model code (the trainer's forward, and the engine's cached decode: with per-sequence caches from
dsv4_state.py, `DSV4Attention.forward` hands each sequence's new tokens to its cache, which reuses the pooling,
indexer selection and attention below).

Per layer, with D = head_dim, R = int(D * partial_rotary_factor) rotary dims, W = sliding_window:
- One key-value vector per token, kv = RMSNorm(kv_proj(x)) [D], used as key AND value by every query head.
  Queries: q_b_proj(q_resid) per head, RMS-normalised without a weight, q_resid = q_a_norm(q_a_proj(x)).
- RoPE rotates the LAST R dims of each vector as interleaved pairs (x0, x1), (x2, x3), ...; sliding-only layers
  use the "main" frequencies (rope_theta, never scaled), CSA/HCA layers the "compress" ones (compress_rope_theta
  with its own scaling). Since values carry RoPE too, the output's rotary dims are rotated back by -position.
- Keys a query t sees: tokens s with t - W < s <= t, then compressed entries (below), then a per-head learned
  "sink" logit with no value (softmax mass that goes nowhere).
- HCA (heavily compressed attention): entry w summarises tokens [w*m, (w+1)*m) of the sequence (m = its rate):
  per channel, a softmax over the m tokens of gate_proj(x) + position_bias weights kv_proj(x); then RMSNorm and
  RoPE at position w*m. Query t sees entry w when the block is complete: w < (pos_t + 1) // m.
- CSA (compressed sparse attention): as HCA with rate m, but each entry spans 2m tokens: kv_proj / gate_proj give
  two halves per token, the second half of block w and the first half of block w-1 (absent for w = 0) are pooled
  together. A lightning indexer (its own compressor at index_head_dim, queries from q_resid) scores the entries;
  query t sees only its index_topk best complete entries.
- Output: heads split into o_groups groups, each projected by its own block of o_a_proj to o_lora_rank, then
  o_b_proj mixes the groups to hidden_size.

Invariants:
- Nothing crosses a sequence boundary: with cu_seqlens each packed sequence is compressed, indexed and attended
  on its own, its blocks counted from its own first token (a trailing partial block makes no entry).
- The indexer runs under no_grad: its top-k is not differentiable, and transformers gives its weights no gradient.
  Its top-k is torch.topk over each query's row of all the sequence's entries (the future at -inf), laid out as
  transformers lays it, so ties break the same way on the same device.
- Attention is computed eagerly in the activation dtype ([heads, T, W-window + entries] logits per sequence); the
  `backend` kernel of CausalLM is not used (no SDPA kernel has a per-head sink).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RMSNorm


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight (the statistic in float32, applied in x's dtype)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last 2 * cos.shape[-1] dims of x as interleaved pairs; cos/sin [..., R/2] broadcast against
    x[..., :R/2] (callers add the head axis). Rotated in float32, returned in x's dtype."""
    r = 2 * cos.shape[-1]
    keep, tail = x[..., :-r], x[..., -r:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    c, s = cos.float(), sin.float()
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([keep, rotated.to(x.dtype)], dim=-1)


@dataclass(frozen=True)
class Rope:
    """Inverse frequencies [R/2] (float32) and the cos/sin scale of one RoPE kind."""

    inv_freq: torch.Tensor
    scaling: float

    def on(self, device: torch.device) -> Rope:
        """This RoPE with its frequencies on `device` (moved once per forward, not per layer)."""
        return self if self.inv_freq.device == device else Rope(self.inv_freq.to(device), self.scaling)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (any shape, int) -> cos, sin [..., R/2] in `dtype` (transformers rounds them to it too)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


@dataclass(frozen=True)
class AttnDims:
    """The sizes one attention layer is built from (the family module fills it from the config)."""

    hidden: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    eps: float
    kind: str  # "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    rate: int  # compression rate of the kind (0 for sliding)
    index_heads: int
    index_head_dim: int
    index_topk: int


class Pooling(nn.Module):
    """Pools blocks of `rate` tokens into entries of width `dim` (module docstring: HCA, or CSA's two-halves
    overlap when `overlap`). HF names `kv_proj`, `gate_proj`, `position_bias`, `kv_norm`."""

    custom_init = True

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = RMSNorm(dim, eps, weight_in_fp32=True)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.position_bias)  # as transformers' _init_weights (CausalLM's loop drew it at random)

    def pool(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [L, hidden] of one sequence -> entries [L // rate, dim], normed and rotated (position w * rate)."""
        rate, dim = self.rate, self.dim
        n = x.shape[0] // rate
        if n == 0:  # shorter than one block: no entry yet
            return x.new_zeros(0, dim)
        kv = self.kv_proj(x[: n * rate]).view(n, rate, -1)
        gate = self.gate_proj(x[: n * rate]).view(n, rate, -1) + self.position_bias
        return self.combine(kv, gate, None, 0, rope)

    def combine(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        prev: tuple[torch.Tensor, torch.Tensor] | None,
        first: int,
        rope: Rope,
    ) -> torch.Tensor:
        """Entries first .. first + n - 1 from their blocks' kv / gate rows [n, rate, width] (gate with
        position_bias added); `prev` = (kv, gate) first halves [rate, dim] of block first - 1 (overlap only; None
        for block 0). The full forward pools every block at once, a cached decode the blocks that just completed."""
        rate, dim, n = self.rate, self.dim, kv.shape[0]
        if self.overlap:
            # Slots [0, rate): the first halves of the previous block (none before block 0: weight 0 via -inf);
            # slots [rate, 2 * rate): this block's second halves.
            if prev is None:
                head_kv, head_gate = kv.new_zeros(1, rate, dim), gate.new_full((1, rate, dim), float("-inf"))
            else:
                head_kv, head_gate = prev[0][None], prev[1][None]
            prev_kv = torch.cat([head_kv, kv[:-1, :, :dim]])
            prev_gate = torch.cat([head_gate, gate[:-1, :, :dim]])
            kv = torch.cat([prev_kv, kv[..., dim:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., dim:]], dim=1)
        # Per channel, a softmax over the block's slots (float32, as transformers) weights the values.
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        cos, sin = rope((torch.arange(n, device=kv.device) + first) * rate, kv.dtype)
        return rotate_tail(self.kv_norm(pooled), cos, sin)


class Compressor(Pooling):
    """An HCA layer's `compressor` (and the base of CSA's)."""

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        return self.pool(x, rope)


class IndexScorer(nn.Module):
    """Holds the indexer's per-head query weights (HF name `scorer.weights_proj`)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Pooling):
    """CSA's lightning indexer: which compressed entries each query attends to. HF names under
    `compressor.indexer.`: its own pooling's four (at index_head_dim, overlapping), `q_b_proj`,
    `scorer.weights_proj`."""

    def __init__(self, d: AttnDims) -> None:
        super().__init__(d.hidden, d.index_head_dim, d.rate, overlap=True, eps=d.eps)
        self.heads, self.topk = d.index_heads, d.index_topk
        self.q_b_proj = nn.Linear(d.q_lora_rank, d.index_heads * self.dim, bias=False)
        self.scorer = IndexScorer(d.hidden, d.index_heads)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [L, hidden], q_resid [L, q_lora_rank], pos [L] of one sequence -> bool [L, N]: entry s is attended
        by query t (complete, and among t's index_topk best)."""
        return self.select(x, q_resid, pos, self.pool(x, rope), rope)

    @torch.no_grad()
    def select(
        self, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, rope: Rope
    ) -> torch.Tensor:
        """As forward, scoring the indexer entries `keys` [N, index_head_dim] given (a cached decode passes the
        entries so far: k = min(index_topk, N) still picks every visible entry when fewer than k are, and the same
        index_topk best when more are, as the full forward's row with its future at -inf does)."""
        n = keys.shape[0]
        q = self.q_b_proj(q_resid).view(-1, self.heads, self.dim)
        cos, sin = rope(pos, x.dtype)
        q = rotate_tail(q, cos[:, None], sin[:, None])
        dots = F.relu(torch.einsum("lhd,nd->lhn", q.float(), keys.float())) * self.dim**-0.5
        w = self.scorer.weights_proj(x).float() * self.heads**-0.5
        scores = (dots * w[..., None]).sum(dim=1)  # [L, N]
        complete = torch.arange(n, device=x.device)[None, :] < ((pos + 1) // self.rate)[:, None]
        scores = scores.masked_fill(~complete, float("-inf"))
        top = scores.topk(min(self.topk, n), dim=-1).indices
        chosen = torch.zeros_like(complete).scatter_(1, top, True)
        return chosen & complete


class GroupedLinear(nn.Module):
    """o_a_proj: block-diagonal projection, group g's input [in_per_group] -> [rank] with rows g*rank..(g+1)*rank
    of `weight` [groups * rank, in_per_group] (transformers' DeepseekV4GroupedLinear layout)."""

    def __init__(self, in_per_group: int, groups: int, rank: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * rank, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., groups, in_per_group] -> [..., groups * rank]."""
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("...gi,gri->...gr", x, w).flatten(-2)


class CSACompressor(Compressor):
    """CSA's compressor (overlapping blocks) with its lightning indexer (`compressor.indexer.*`)."""

    def __init__(self, d: AttnDims) -> None:
        super().__init__(d.hidden, d.head_dim, d.rate, overlap=True, eps=d.eps)
        self.indexer = Indexer(d)


def sequence_spans(b: int, t: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence: each row whole, or the packed sequences of the one row."""
    if cu_seqlens is None:
        return [(r, 0, t) for r in range(b)]
    cu = [int(v) for v in cu_seqlens.tolist()]
    return [(0, s, e) for s, e in zip(cu[:-1], cu[1:], strict=True) if e > s]


class SequenceCache(Protocol):
    """What one packed sequence's cache of one layer does (dsv4_state.LayerCache): attend its new tokens over what
    it holds plus them, then keep what later tokens need."""

    def attend(
        self,
        attn: DSV4Attention,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        pos: torch.Tensor,
        rope: Rope,
    ) -> torch.Tensor: ...


class DSV4Attention(nn.Module):
    """`self_attn` of one DeepSeek-V4 layer (module docstring). HF names: `q_a_proj`, `q_a_norm`, `q_b_proj`,
    `kv_proj`, `kv_norm`, `o_a_proj`, `o_b_proj`, `sinks`, and `compressor.*` in CSA / HCA layers."""

    custom_init = True

    def __init__(self, d: AttnDims) -> None:
        super().__init__()
        self.d = d
        self.q_a_proj = nn.Linear(d.hidden, d.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(d.q_lora_rank, d.eps, weight_in_fp32=True)
        self.q_b_proj = nn.Linear(d.q_lora_rank, d.heads * d.head_dim, bias=False)
        self.kv_proj = nn.Linear(d.hidden, d.head_dim, bias=False)
        self.kv_norm = RMSNorm(d.head_dim, d.eps, weight_in_fp32=True)
        self.o_a_proj = GroupedLinear(d.heads * d.head_dim // d.o_groups, d.o_groups, d.o_lora_rank)
        self.o_b_proj = nn.Linear(d.o_groups * d.o_lora_rank, d.hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(d.heads))
        self.compressor: Compressor | None = None
        if d.kind == "compressed_sparse_attention":
            self.compressor = CSACompressor(d)
        elif d.kind == "heavily_compressed_attention":
            self.compressor = Compressor(d.hidden, d.head_dim, d.rate, overlap=False, eps=d.eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.sinks)  # transformers' init; CausalLM's loop set this 1-D parameter to 1

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        rope: Rope,
        cu_seqlens: torch.Tensor | None,
        caches: Sequence[SequenceCache] | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden], pos [B, T] -> [B, T, hidden]; `rope` is the layer kind's (main or compress).
        `caches`: one per non-empty packed sequence (B == 1), whose tokens continue what it has seen
        (dsv4_state.py); None: every sequence from its first token."""
        b, t, _ = x.shape
        d = self.d
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = rms(self.q_b_proj(q_resid).view(b, t, d.heads, d.head_dim), d.eps)
        cos, sin = rope(pos, x.dtype)
        q = rotate_tail(q, cos[:, :, None], sin[:, :, None])
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)), cos, sin)
        spans = sequence_spans(b, t, cu_seqlens)
        if caches is not None and len(caches) != len(spans):
            raise ValueError(f"{len(caches)} caches for {len(spans)} non-empty sequences")
        rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
        for i, (r, s, e) in enumerate(spans):
            args = (x[r, s:e], q_resid[r, s:e], q[r, s:e], kv[r, s:e], pos[r, s:e], rope)
            rows[r].append(self._sequence(*args) if caches is None else caches[i].attend(self, *args))
        out = torch.stack([torch.cat(parts) for parts in rows])  # [B, T, heads, D]
        out = rotate_tail(out, cos[:, :, None], -sin[:, :, None])  # values carried RoPE: undo it at the query
        out = self.o_a_proj(out.reshape(b, t, d.o_groups, -1))
        return self.o_b_proj(out)

    def _sequence(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        pos: torch.Tensor,
        rope: Rope,
    ) -> torch.Tensor:
        """One sequence: q [L, heads, D], kv [L, D] -> attention output [L, heads, D]."""
        length = x.shape[0]
        idx = torch.arange(length, device=x.device)
        ago = idx[:, None] - idx[None, :]
        allowed = (ago >= 0) & (ago < self.d.window)
        keys = kv
        if self.compressor is not None:
            entries = self.compressor(x, rope)
            if isinstance(self.compressor, CSACompressor):
                seen = self.compressor.indexer(x, q_resid, pos, rope)
            else:
                n = entries.shape[0]
                seen = torch.arange(n, device=x.device)[None, :] < ((pos + 1) // self.d.rate)[:, None]
            keys = torch.cat([kv, entries])
            allowed = torch.cat([allowed, seen], dim=1)
        return self.attend(q, keys, allowed)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [L, heads, D] over keys [S, D] (keys and values both) where allowed [L, S], plus the sink -> [L, heads,
        D]. The full forward passes every token of the sequence, a cached decode its window and entries."""
        logits = torch.einsum("lhd,sd->hls", q, keys) * self.d.head_dim**-0.5
        logits = logits.masked_fill(~allowed, float("-inf"))
        sink = self.sinks.to(logits.dtype)[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hls,sd->lhd", probs, keys)
