"""DeepSeek sparse attention (DSA) of DeepSeek-V3.2 and GLM-5: the lightning indexer and top-k sparse attention,
as transformers 5.24 computes them (DeepseekV32Indexer, GlmMoeDsaIndexer, the eager mask they fold in).

Stage: shared model code (the trainer's forward by default; the engine substitutes its cached versions).

The indexer, per token: queries `wq_b(q_resid)` [index_n_heads, index_head_dim] from MLA's compressed query
`q_resid = q_a_layernorm(q_a_proj(x))`, one key `LayerNorm(wk(x))` [index_head_dim], head weights
`weights_proj(x) * index_n_heads^-0.5`. The first `qk_rope_head_dim` dims of queries and key are rotated (rope part
FIRST, unlike MLA's [nope | rope]): interleaved pairs in GLM-5, halves in DeepSeek-V3.2. The score of query s for
key t is sum_h w[s, h] * relu(q[s, h] . k[t] * index_head_dim^-0.5), in float32; query s attends only to the
`index_topk` highest-scoring keys t <= s (all of them while s < index_topk). The indexer runs under no_grad:
the top-k choice is not differentiable and transformers computes no gradient for its weights; they are loaded,
saved and synced, and train only through the indexer loss (`indexer_kl`, `train.indexer_loss_coef`).

Indexer loss (DeepSeek-V3.2's report, section 2.1; megatron-core's `compute_dsa_indexer_loss` computes the same):
per query row, the KL divergence from the main attention's distribution (softmax per head, summed over heads,
L1-normalized; a target, no gradient) to softmax of the indexer's scores, over the causal keys ("dense", the
report's warm-up stage) or over the selected keys only ("sparse", its sparse training stage). Its inputs are
detached from the main model (the hidden state and compressed query): only the indexer learns from it.

GLM-5.2's IndexShare: a "shared" layer has no indexer and reuses the top-k of the last "full" layer before it.

Exactness: the selection is torch.topk over each query's row of scores with the future masked, the row laid out
as transformers lays it (the whole sequence, future entries below every score), so equal scores (e.g. the exact
zeros that relu makes when every head's dot product is negative) are broken the same way as the reference on the
same device.
Known gap (measured; tests/test_engine_dsa.py pins it): torch.topk breaks such ties in a way that depends on the
row's length, so under exact ties a position's selection, and every later token's log-prob, can differ between a
forward over S tokens and one over S + k: the reference is then not prefix-consistent, and no cache (nor the
trainer's one forward over a whole sample) can agree with a token-by-token recompute. With 2 indexer heads (the
tiny glm_moe_dsa preset) 13% of layer 0's selections change with the length and log-probs differ by nats; with 8
heads 0.4% of the scores are still exact zeros and ties on the boundary occur; with 32 (GLM-5's count) none was
seen. A tie rule that does not depend on the length (a stable sort: equal scores in key order) removes it, at the
price of parity with transformers on ties.

Selection (`Selection`): one int tensor [B, S, k] per group of equally long rows: per packed sequence with
`cu_seqlens` (B = 1, S = that sequence's length), else one group for the whole batch; k = min(index_topk, S);
entries index keys within the row's own sequence and may name masked (future) keys, which attention ignores, or
be -1 (no key: a replayed record's padding).

Indexer replay (`replay_selection`, `CausalLM.forward(index_replay=...)`): the trainer attends to the keys a rollout
engine selected instead of its own choice, per token and indexer layer, as R3 does for MoE routing.
A backend's `dsa_select` lays its Selection out its own way (the engine's: engine/latent_attention.py): the model
only hands it on, to the same backend's attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import check_cu_seqlens, no_cudnn_sdpa
from .config import ModelConfig
from .rope import apply_rotary

Selection = list[torch.Tensor]


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE on x [B, H, T, D] (output: rotated evens, then odds), cos/sin [B, T, D]."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Indexer(nn.Module):
    """The lightning indexer of one DSA layer; parameter names are the HF ones (`self_attn.indexer.*`)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert config.q_lora_rank is not None  # ModelConfig refuses DSA without it
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.rope_dim = config.index_n_heads, config.index_head_dim, config.head_dim
        self.index_topk = config.index_topk
        self.interleave = config.indexer_rope_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, head_dim]: rotate the leading rope part, pass the rest."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rot = _rope_pairs(rot, cos, sin) if self.interleave else apply_rotary(rot, cos, sin)
        return torch.cat([rot, rest], dim=-1)

    @torch.no_grad()
    def project(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries [B, T, H, D], keys [B, T, D], head weights [B, T, H]), all float32, rotated at these positions."""
        return self.project_with_grad(x, q_resid, cos, sin)

    def project_with_grad(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`project` with autograd (the indexer loss; the caller detaches x and q_resid from the main model)."""
        b, t, _ = x.shape
        q = self.wq_b(q_resid).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q = self._rotate(q, cos, sin).transpose(1, 2)
        k = self._rotate(self.k_norm(self.wk(x)).unsqueeze(1), cos, sin).squeeze(1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5)
        return q.float(), k.float(), w


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores [B, S, T] of queries q [B, S, H, D] against keys k [B, T, D] with head weights w [B, S, H] (float32;
    the same op order as transformers' indexer)."""
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * scale)  # [B, S, H, T]
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)


def causal_topk(scores: torch.Tensor, topk: int, offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Top-k key indices [B, S, min(topk, T)] of scores [B, S, T] whose query s sits at position offset + s and
    sees keys t <= offset + s (the rest are masked below every score first, as the reference masks them).
    `offset`: one for every row, or an int tensor [B] of per-row offsets (the engine's batched decode rows, whose
    rows are padded past their own keys)."""
    s, t = scores.shape[-2:]
    q_pos = torch.arange(s, device=scores.device)[:, None]
    if isinstance(offset, torch.Tensor):
        q_pos = q_pos[None] + offset.to(device=scores.device)[:, None, None]  # [B, S, 1]
    else:
        q_pos = q_pos + offset
    future = torch.arange(t, device=scores.device) > q_pos
    masked = scores.masked_fill(future, float("-inf"))
    return masked.topk(min(topk, t), dim=-1).indices.to(torch.int32)


SCORE_ROWS = 256
"""Queries scored at once by `topk_in_chunks`: the float32 scores of a chunk are [rows, index_n_heads, T]."""


def topk_in_chunks(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float, topk: int, offset: int = 0
) -> torch.Tensor:
    """`causal_topk(index_scores(q, k, w, scale), topk, offset)` for SCORE_ROWS queries at a time: the same indices
    (each row's scores, masking and top-k are its own, computed by the same batched products) with the float32
    temporary bounded by the chunk (a whole 32k-token sequence at 32 indexer heads would be 137 GB)."""
    s = q.shape[1]
    if s <= SCORE_ROWS:
        return causal_topk(index_scores(q, k, w, scale), topk, offset)
    parts = [
        causal_topk(index_scores(q[:, r : r + SCORE_ROWS], k, w[:, r : r + SCORE_ROWS], scale), topk, offset + r)
        for r in range(0, s, SCORE_ROWS)
    ]
    return torch.cat(parts, dim=1)


@torch.no_grad()
def select_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, topk: int, scale: float, bounds: Sequence[int] | None
) -> Selection:
    """Default (uncached) selection: each packed sequence (bounds) or the whole batch scored on its own."""
    if bounds is None:
        return [topk_in_chunks(q, k, w, scale, topk)]
    return [topk_in_chunks(q[:, s:e], k[:, s:e], w[:, s:e], scale, topk) for s, e in zip(bounds, bounds[1:]) if e > s]


def selection_mask(indices: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean [B, 1, S, T] attention mask: causal and among the selected keys (-1 entries select nothing)."""
    b, s, _ = indices.shape
    idx = indices.long()
    idx = torch.where(idx < 0, length, idx)  # padding goes to a column that is dropped
    chosen = torch.zeros(b, s, length + 1, dtype=torch.bool, device=indices.device)
    chosen.scatter_(-1, idx, True)
    chosen = chosen[..., :length]
    causal = torch.ones(s, length, dtype=torch.bool, device=indices.device).tril(length - s)
    return (chosen & causal).unsqueeze(1)


@torch.no_grad()
def replay_selection(
    live: Selection, replay: torch.Tensor, bounds: Sequence[int] | None
) -> tuple[Selection, torch.Tensor]:
    """Indexer replay: `replay` [B, T, K] holds, per token, the key positions (within its sequence, -1 padding) a
    rollout engine selected for it; a row with any entry replaces the live choice, a row of only -1 (no record)
    keeps it. Returns the selection (rows padded to one width with -1) and int64 [3]: rows with a record, of those
    the ones whose live choice is the same set of keys, all rows."""
    spans = [(0, replay.shape[1])] if bounds is None else [(s, e) for s, e in zip(bounds, bounds[1:]) if e > s]
    stats = torch.zeros(3, dtype=torch.long, device=replay.device)
    out: Selection = []
    for (s, e), sel in zip(spans, live, strict=True):
        rows = replay[:, s:e].to(device=sel.device, dtype=torch.long)
        q_pos = torch.arange(e - s, device=sel.device)[:, None]
        if bool(((rows > q_pos) | (rows < -1)).any()):
            raise ValueError(f"index_replay: a record names keys after its own token or below -1 (tokens {s}..{e})")
        width = max(rows.shape[-1], sel.shape[-1])
        live_rows = torch.where(sel.long() <= q_pos, sel.long(), -1)  # the masked (future) picks are no keys
        live_rows = F.pad(live_rows, (0, width - sel.shape[-1]), value=-1)
        rows = F.pad(rows, (0, width - rows.shape[-1]), value=-1)
        has = (rows >= 0).any(-1)
        same = (live_rows.sort(-1).values == rows.sort(-1).values).all(-1)
        stats += torch.stack([has.sum(), (same & has).sum(), torch.tensor(has.numel(), device=has.device)])
        out.append(torch.where(has[..., None], rows, live_rows))
    return out, stats


def indexer_kl(
    iq: torch.Tensor,
    ik: torch.Tensor,
    iw: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    index_scale: float,
    attn_scale: float,
    bounds: Sequence[int] | None,
    selection: Selection | None,
) -> torch.Tensor:
    """Sum over query rows of KL(attention target || softmax(indexer scores)) (module docstring): iq [B, T, H_i, D_i],
    ik [B, T, D_i], iw [B, T, H_i] the indexer's (with grad), q [B, H, T, Dqk], k [B, H, T, Dqk] the attention's
    (no grad taken); `selection` given: "sparse" (over each query's selected keys), None: "dense" (causal keys).
    SCORE_ROWS queries at a time per packed sequence (bounds), so the float32 temporaries stay [rows, heads, T]."""
    spans = [(0, iq.shape[1])] if bounds is None else [(s, e) for s, e in zip(bounds, bounds[1:]) if e > s]
    sels = [None] * len(spans) if selection is None else selection
    total = iq.new_zeros(())
    for (s, e), sel in zip(spans, sels, strict=True):
        qi, ki, wi, qa, ka = iq[:, s:e], ik[:, s:e], iw[:, s:e], q[:, :, s:e].detach(), k[:, :, s:e].detach()
        for r in range(0, e - s, SCORE_ROWS):
            rows = slice(r, min(r + SCORE_ROWS, e - s))
            q_pos = torch.arange(rows.start, rows.stop, device=iq.device)[:, None]
            allowed = (torch.arange(e - s, device=iq.device) <= q_pos)[None, None]  # causal [1, 1, n, T]
            if sel is not None:  # and selected (selection_mask's own causal part takes the rows as the last ones)
                allowed = allowed & selection_mask(sel[:, rows], e - s)
            with torch.no_grad():
                logits = torch.matmul(qa[:, :, rows].float(), ka.float().transpose(-1, -2)) * attn_scale
                probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1).sum(1)  # [B, n, T]
                target = probs / probs.sum(-1, keepdim=True)
            scores = index_scores(qi[:, rows], ki, wi[:, rows], index_scale)  # [B, n, T]
            keep = allowed[:, 0].expand_as(scores)
            log_q = scores.masked_fill(~keep, float("-inf")).log_softmax(-1).masked_fill(~keep, 0.0)
            total = total + (torch.xlogy(target, target) - target * log_q).sum()
    return total


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    bounds: Sequence[int] | None,
    selection: Selection,
) -> torch.Tensor:
    """Default (uncached) DSA attention: q, k [B, H, T, Dqk], v [B, H, T, Dv] -> [B, H, T, Dv], each query over its
    selected keys only."""
    with no_cudnn_sdpa():
        if bounds is None:
            mask = selection_mask(selection[0], k.shape[2])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        spans = [(s, e) for s, e in zip(bounds, bounds[1:]) if e > s]
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], attn_mask=selection_mask(sel, e - s), scale=scale
            )
            for (s, e), sel in zip(spans, selection, strict=True)
        ]
    return torch.cat(parts, dim=2)


def host_bounds(cu_seqlens: torch.Tensor | None, batch: int, length: int) -> list[int] | None:
    """cu_seqlens as a host list (the model hands layers a CPU copy: no device sync here)."""
    return None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, batch, length)


def backend_hook(backend: Any, name: str) -> Any:
    """The engine's cached version of a DSA step (`dsa_select` or `dsa_attention`), or None for the defaults."""
    return getattr(backend, name, None)


__all__ = [
    "Indexer",
    "Selection",
    "backend_hook",
    "causal_topk",
    "host_bounds",
    "index_scores",
    "indexer_kl",
    "replay_selection",
    "select_topk",
    "selection_mask",
    "topk_in_chunks",
    "sparse_attention",
]
