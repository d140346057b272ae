"""DeepSeek-V4's per-sequence decode cache: what each layer's attention keeps so that a sequence's next tokens
are computed from it instead of from the sequence's first token (dsv4_attention.py explains the layer's math).

Stage: shared model code, used by the engine (`DSV4Backbone.new_state`, `run(..., states=...)`); the trainer's
full forward never builds one.

Per layer (D = head_dim, W = sliding_window, m = the kind's compression rate, I = index_head_dim):
- Every layer: `window`, the last W - 1 key-value vectors [<= W - 1, D] after kv_norm and RoPE: a query at p sees
  tokens p - W < s <= p, itself being new.
- HCA: `entries`, a `BlockBuffer` of width D: the entries so far [N, D] (N = length // m, normed and rotated as
  the full forward makes them) and the kv_proj / gate_proj + position_bias rows [length % m, D] of the partial
  block (the bias is the token's slot in its block, length % m, known when it arrives).
- CSA: `entries` as HCA but the rows are 2D wide, plus the first halves [m, D] (kv and gate) of the last complete
  block, which the next entry pools with its second halves (the overlap); `index`, the same for the indexer's own
  pooling at width I.
Nothing else crosses a call: mHC mixing, routers (hash ids come from the token) and experts are per token.

Invariants:
- After a call, every cache of a sequence has seen exactly `DSV4State.length` tokens; entry w exists once block w
  is complete, and is visible to a query at p when w < (p + 1) // m, as in the full forward.
- The indexer scores the entries so far with k = min(index_topk, N): a query with fewer than k visible entries
  picks them all, one with more picks its index_topk best, the full forward's valid picks (Indexer.select).
- Buffers are views of nothing: each update keeps fresh tensors, so `nbytes` is what the cache pins; the window
  never holds more than W - 1 rows, pending rows fewer than m. `state_bytes` says it from the config alone (the
  planner's rollout cache, planner/measure.py), a function of the length only, however the tokens came in calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .dsv4_attention import CSACompressor, DSV4Attention, Pooling, Rope

if TYPE_CHECKING:
    from .config import ModelConfig


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class BlockBuffer:
    """One pooling's running state (module docstring): entries, the partial block's rows, the overlap halves."""

    entries: torch.Tensor | None = None  # [N, dim]
    kv_rows: torch.Tensor | None = None  # [length % rate, width]
    gate_rows: torch.Tensor | None = None  # [length % rate, width], position_bias added
    prev: tuple[torch.Tensor, torch.Tensor] | None = None  # overlap: last complete block's first halves [rate, dim]

    def extend(self, pool: Pooling, x: torch.Tensor, start: int, rope: Rope) -> torch.Tensor:
        """Take x [L, hidden], the tokens at start .. start + L - 1; pool every block they complete -> all the
        entries so far [N, dim]."""
        rate, dim = pool.rate, pool.dim
        slots = torch.arange(start, start + x.shape[0], device=x.device) % rate
        kv, gate = pool.kv_proj(x), pool.gate_proj(x) + pool.position_bias[slots]
        if self.kv_rows is not None and self.gate_rows is not None:
            kv, gate = torch.cat([self.kv_rows, kv]), torch.cat([self.gate_rows, gate])
        entries = self.entries if self.entries is not None else x.new_zeros(0, dim)
        n = kv.shape[0] // rate  # the pending rows start at a block boundary: every earlier block is an entry
        if n:
            blocks_kv, blocks_gate = kv[: n * rate].view(n, rate, -1), gate[: n * rate].view(n, rate, -1)
            new = pool.combine(blocks_kv, blocks_gate, self.prev, entries.shape[0], rope)
            entries = torch.cat([entries, new])
            if pool.overlap:
                self.prev = (blocks_kv[-1, :, :dim].clone(), blocks_gate[-1, :, :dim].clone())
        self.entries = entries
        # Fresh copies: a slice would pin the whole chunk's projections.
        self.kv_rows, self.gate_rows = kv[n * rate :].clone(), gate[n * rate :].clone()
        return entries

    def nbytes(self) -> int:
        return _bytes(self.entries, self.kv_rows, self.gate_rows, *(self.prev or ()))


@dataclass
class LayerCache:
    """One layer's cache of one sequence (module docstring); `attend` is dsv4_attention.SequenceCache."""

    length: int = 0
    window: torch.Tensor | None = None  # [<= W - 1, D]
    entries: BlockBuffer | None = None  # CSA / HCA
    index: BlockBuffer | None = None  # CSA

    def attend(
        self,
        attn: DSV4Attention,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        pos: torch.Tensor,
        rope: Rope,
    ) -> torch.Tensor:
        """The new tokens x [L, hidden] (q [L, heads, D], kv [L, D], pos [L] = length + arange(L)) attend over
        the window, themselves and the entries; then the cache keeps what the next tokens need -> [L, heads, D]."""
        d, start, length = attn.d, self.length, x.shape[0]
        held = self.window if self.window is not None else kv.new_zeros(0, kv.shape[-1])
        tokens = torch.cat([held, kv])
        keys = tokens
        key_pos = torch.arange(start - held.shape[0], start + length, device=x.device)
        ago = pos[:, None] - key_pos[None, :]
        allowed = (ago >= 0) & (ago < d.window)
        comp = attn.compressor
        if comp is not None:
            if self.entries is None:
                self.entries = BlockBuffer()
            entries = self.entries.extend(comp, x, start, rope)
            if isinstance(comp, CSACompressor):
                if self.index is None:
                    self.index = BlockBuffer()
                index_keys = self.index.extend(comp.indexer, x, start, rope)
                seen = comp.indexer.select(x, q_resid, pos, index_keys, rope)
            else:
                n = entries.shape[0]
                seen = torch.arange(n, device=x.device)[None, :] < ((pos + 1) // d.rate)[:, None]
            keys = torch.cat([keys, entries])
            allowed = torch.cat([allowed, seen], dim=1)
        out = attn.attend(q, keys, allowed)
        # The next query, at start + length, sees back to start + length - (W - 1).
        self.window = tokens[max(tokens.shape[0] - (d.window - 1), 0) :].clone()
        self.length = start + length
        return out

    def nbytes(self) -> int:
        parts = (self.entries, self.index)
        return _bytes(self.window) + sum(p.nbytes() for p in parts if p is not None)


@dataclass
class DSV4State:
    """One sequence's cache across the layers: `length` tokens seen; `run(..., states=...)` extends it."""

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0

    def nbytes(self) -> int:
        """Bytes of the tensors held (windows, entries, partial blocks, overlap halves)."""
        return sum(layer.nbytes() for layer in self.layers)


def state_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """`DSV4State.nbytes()` of a sequence of `tokens` tokens whose tensors hold `dtype_bytes` per element (the
    model's dtype: every one of them is computed in it): per layer the window, and per compressed layer its
    pooling's `BlockBuffer` (a CSA layer's indexer's too) as `LayerCache.attend` leaves them."""
    s = cfg.spec
    elements = 0
    for kind in s.layer_types:
        elements += min(tokens, max(s.sliding_window - 1, 0)) * cfg.head_dim
        rate = s.compress_rate(kind)
        if rate:
            overlap = kind == "compressed_sparse_attention"
            for dim in (cfg.head_dim, s.index_head_dim) if overlap else (cfg.head_dim,):
                elements += _buffer_elements(tokens, rate, dim, overlap)
    return elements * dtype_bytes


def _buffer_elements(tokens: int, rate: int, dim: int, overlap: bool) -> int:
    """A `BlockBuffer` after `tokens` tokens: the entries [N, dim], the kv and gate rows of the partial block
    [tokens % rate, width] and, overlapping, the first halves [rate, dim] of the last complete block (kv, gate)."""
    n, rest = divmod(tokens, rate)
    width = 2 * dim if overlap else dim
    return n * dim + 2 * rest * width + (2 * rate * dim if overlap and n else 0)
