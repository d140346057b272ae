"""Inkling's token mixing: short causal convolutions with a residual, and attention with per-query relative logits
(sliding-window and global layers), as transformers 5.24's InklingShortConvolution / InklingAttention compute them.

Stage: shared model code (the trainer's packed forward; the engine's incremental decode, which passes each
sequence's `LayerState` (inkling_state.py) so that new tokens continue a cached past).

Invariants:
- Nothing crosses a packed-sequence boundary: `Segments` carries each sequence's token range, the convolutions
  treat every sequence start as zero history, attention and the relative logits run per sequence.
- The convolutions compute in float32 (whatever the weights' dtype) and cast back, as transformers keeps them.
- Relative logits: query i of a layer with extent E gets bias `r_i . proj[:, i - j]` on key j when 0 <= i - j < E,
  else 0 (`r_i` = the query's `r_proj` state per head). A sliding layer's window and extent are both
  `sliding_window_size`; a global layer's extent is `rel_extent`, its window unbounded.
- Log scaling (global layers with `log_scaling_n_floor`): q and the relative bias of a query at position p are
  multiplied (in float32) by 1 + alpha * log(max((p + 1) / n_floor, 1)), p from `position_ids`.
- Scores are q . k / head_dim (q, k RMS-normed per head) plus the bias; softmax over the allowed keys.
- With caches (decode), a sequence's new rows are the tokens after its cached past: the convolutions read the
  cached last inputs instead of zeros, the queries attend to the cached keys too, at their true distances, and
  the forward appends to the caches; every value equals the one-shot forward's (up to summation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import no_cudnn_sdpa
from .config import ModelConfig
from .inkling_state import LayerState
from .layers import RMSNorm

# Query rows per attention step: bounds the dense relative-bias tensor (see InklingAttention._attend).
ATTENTION_CHUNK = 1024


@dataclass(frozen=True, slots=True)
class Segments:
    """Where the sequences of a forward lie: `bounds` (start, end) token ranges along T (one, the whole row, when
    nothing is packed), `within` [T] each token's index inside its sequence (None when nothing is packed),
    `positions` [B, T] the position ids (the log scaling reads them)."""

    bounds: tuple[tuple[int, int], ...]
    within: torch.Tensor | None
    positions: torch.Tensor

    @classmethod
    def build(cls, t: int, cu_seqlens: torch.Tensor | None, positions: torch.Tensor) -> Segments:
        if cu_seqlens is None:
            return cls(((0, t),), None, positions)
        cu = [int(c) for c in cu_seqlens.tolist()]  # a host tensor (CausalLM.forward): no device sync
        bounds = tuple((s, e) for s, e in zip(cu, cu[1:]) if e > s)
        lengths = torch.tensor([e - s for s, e in bounds], device=positions.device)
        starts = torch.tensor([s for s, _ in bounds], device=positions.device)
        within = torch.arange(t, device=positions.device) - torch.repeat_interleave(starts, lengths, output_size=t)
        return cls(bounds, within, positions)


class ShortConvolution(nn.Module):
    """x + (depthwise causal convolution of x), no bias, no activation, in float32. HF name `conv1d.weight`
    [C, 1, K] (tap K - 1 is the current token). Decode state: the last K - 1 inputs of the sequence."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(channels, channels, width, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, seg: Segments) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C] in x's dtype."""
        return self._taps(x, seg.within)

    def resume(
        self, x: torch.Tensor, bounds: tuple[tuple[int, int], ...], caches: list[LayerState], name: str
    ) -> torch.Tensor:
        """x [1, T, C] holds the new rows of the sequences at `bounds`, caches[i].conv[name] the last K - 1 inputs
        before sequence i (absent: zeros, as a sequence's start reads). Returns [1, T, C] and stores each
        sequence's last K - 1 inputs back. Each sequence goes through as [its history; its rows] laid end to end
        in one unpacked row: a kept row's taps reach K - 1 back at most, so never past its own history."""
        keep = self.conv1d.weight.shape[-1] - 1
        pieces, rows, at = [], [], 0
        for (s, e), cache in zip(bounds, caches, strict=True):
            past = cache.conv.get(name)
            if past is None:
                past = x.new_zeros(keep, x.shape[-1])
            seq = torch.cat([past, x[0, s:e]])
            # `- keep`, not `-keep` (keep may be 0); a copy, so the state does not pin the whole of `seq`.
            cache.conv[name] = seq[seq.shape[0] - keep :].detach().clone()
            pieces.append(seq)
            rows.append(torch.arange(at + keep, at + seq.shape[0], device=x.device))
            at += seq.shape[0]
        out = self._taps(torch.cat(pieces)[None], None)
        return out[:, torch.cat(rows)]

    def _taps(self, x: torch.Tensor, within: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, C] -> x + conv(x) in x's dtype; `within` [T] (None: one sequence per row) zeroes the taps
        reaching before a packed sequence's start."""
        h = x.float()
        w = self.conv1d.weight.float()[:, 0]  # [C, K]
        width, t = w.shape[1], h.shape[1]
        out: torch.Tensor | None = None
        # Sum the taps oldest first (as conv1d does); a tap reaching before its sequence's start reads zeros.
        for lag in range(width - 1, -1, -1):
            shifted = h if lag == 0 else F.pad(h, (0, 0, lag, 0))[:, :t]
            if lag and within is not None:
                shifted = shifted * (within >= lag).to(h.dtype)[None, :, None]
            term = shifted * w[:, width - 1 - lag]
            out = term if out is None else out + term
        assert out is not None
        return (h + out).to(x.dtype)


class RelativeLogits(nn.Module):
    """HF `rel_logits_proj`: `proj` [d_rel, extent], one bias profile over backward distance per relative-state
    dimension; a query's relative state [H, d_rel] mixes them into its per-head bias by distance."""

    def __init__(self, d_rel: int, extent: int) -> None:
        super().__init__()
        self.extent = extent
        self.proj = nn.Parameter(torch.empty(d_rel, extent))

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        """r [B, T, H, d_rel] -> per-distance logits [B, H, T, extent]."""
        return (r @ self.proj).transpose(1, 2)


def distance_bias(
    rel: torch.Tensor, q0: int, k0: int, k1: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q0 .. q0 + tq - 1 of one sequence against its keys k0 .. k1 - 1: rel [B, H, tq, E] -> (bias
    [B, H, tq, k1 - k0] (0 beyond the extent), blocked [tq, k1 - k0] (keys after the query or outside the window))."""
    tq, extent = rel.shape[2], rel.shape[3]
    dist = torch.arange(q0, q0 + tq, device=rel.device)[:, None] - torch.arange(k0, k1, device=rel.device)[None, :]
    bias = rel.gather(-1, dist.clamp(0, extent - 1).expand(*rel.shape[:2], *dist.shape))
    bias = bias.masked_fill(dist >= extent, 0.0)
    blocked = dist < 0 if window is None else (dist < 0) | (dist >= window)
    return bias, blocked


class InklingAttention(nn.Module):
    """HF `self_attn` of one layer: q/k/v/r/o projections, `k_sconv`, `v_sconv`, per-head `q_norm`, `k_norm`,
    `rel_logits_proj`. The layer's layout is the sliding one (swa_* heads) or the global one (common keys).

    A decode step caches per layer (`LayerState`): k (after k_sconv and k_norm) and v (after v_sconv) of each past
    token, only the last `window - 1` of them in a sliding layer, every one in a global layer; the last K - 1 raw
    k_proj and v_proj outputs (the convolutions' state); nothing for the relative logits (they depend only on the
    query's own r_proj state and the distances)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        s = config.spec
        self.layer_idx = layer_idx
        self.sliding = s.layer_types[layer_idx] == "hybrid_sliding"
        if self.sliding:
            heads, kv_heads, d = s.swa_num_attention_heads, s.swa_num_key_value_heads, s.swa_head_dim
        else:
            heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        self.window: int | None = s.sliding_window_size if self.sliding else None
        self.log_floor: int | None = None if self.sliding else s.log_scaling_n_floor
        self.log_alpha: float = s.log_scaling_alpha
        self.scale = 1.0 / d  # q and k are RMS-normed per head
        self.chunk = ATTENTION_CHUNK
        h = config.hidden_size
        self.q_proj = nn.Linear(h, heads * d, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.r_proj = nn.Linear(h, heads * s.d_rel, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        self.k_sconv = ShortConvolution(kv_heads * d, s.conv_kernel_size)
        self.v_sconv = ShortConvolution(kv_heads * d, s.conv_kernel_size)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rel_logits_proj = RelativeLogits(s.d_rel, s.sliding_window_size if self.sliding else s.rel_extent)

    def forward(self, x: torch.Tensor, seg: Segments, caches: list[LayerState] | None = None) -> torch.Tensor:
        """x [B, T, hidden] (normed) -> [B, T, hidden]. With `caches` (B == 1, one per sequence of seg.bounds, and
        seg.positions the absolute positions), the rows continue the cached sequences, which are extended."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k_in, v_in = self.k_proj(x), self.v_proj(x)
        if caches is None:
            k_in, v_in = self.k_sconv(k_in, seg), self.v_sconv(v_in, seg)
        else:
            k_in = self.k_sconv.resume(k_in, seg.bounds, caches, "k")
            v_in = self.v_sconv.resume(v_in, seg.bounds, caches, "v")
        k = self.k_norm(k_in.view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v_in.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        rel = self.rel_logits_proj(self.r_proj(x).view(b, t, self.num_heads, -1))
        tau = self.log_scale(seg.positions) if self.log_floor is not None else None
        parts = []
        for i, (s, e) in enumerate(seg.bounds):
            ks, vs, past = k[:, :, s:e], v[:, :, s:e], 0
            if caches is not None:
                ks, vs, past = self._extend(caches[i], ks, vs)
            scale = None if tau is None else tau[:, s:e]
            parts.append(self._attend(q[:, :, s:e], ks, vs, rel[:, :, s:e], scale, past))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def log_scale(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, T] float32 factor of each query (module docstring)."""
        assert self.log_floor is not None
        ratio = (positions.float() + 1.0) / self.log_floor
        return 1.0 + self.log_alpha * torch.log(ratio.clamp(min=1.0))

    def _extend(self, cache: LayerState, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One sequence's new k, v [1, Hkv, n, D] -> (its cached and new keys, values [1, Hkv, past + n, D], past);
        the cache keeps all of them (global layer) or the last window - 1 (sliding: no later query sees older)."""
        past = 0 if cache.k is None else cache.k.shape[2]
        if cache.k is not None and cache.v is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        start = 0 if self.window is None else max(0, k.shape[2] - (self.window - 1))
        # The concatenation is a tensor of its own; anything else (a slice of the packed k, a trimmed tail) is
        # copied, so the state pins only what it reports in nbytes().
        whole = past > 0 and start == 0
        cache.k = (k if whole else k[:, :, start:].clone()).detach()
        cache.v = (v if whole else v[:, :, start:].clone()).detach()
        return k, v, past

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rel: torch.Tensor,
        tau: torch.Tensor | None,
        past: int = 0,
    ) -> torch.Tensor:
        """One sequence (or unpacked rows): q [B, H, t, D], k/v [B, Hkv, past + t, D] (the first `past` keys are
        cached ones, before the queries' tokens), rel [B, H, t, E] -> [B, H, t, D]. Queries go `chunk` rows at a
        time against the keys they may see (a sliding layer's window, a global layer's prefix), so the dense bias
        is [B, H, chunk, <= chunk + window] or [B, H, chunk, past + t], not [.., t, t]."""
        if tau is not None:  # float32, then back: transformers scales q and the bias (below) this way
            q = (q.float() * tau[:, None, :, None]).to(q.dtype)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # query head h reads kv head h // groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        t, outs = q.shape[2], []
        for q0 in range(0, t, self.chunk):
            q1 = min(q0 + self.chunk, t)
            # Key indices count from the first cached key: query row r sits at key index past + r.
            k0 = 0 if self.window is None else max(0, past + q0 - self.window + 1)
            k1 = past + q1
            bias, blocked = distance_bias(rel[:, :, q0:q1], past + q0, k0, k1, self.window)
            if tau is not None:
                bias = (bias.float() * tau[:, None, q0:q1, None]).to(bias.dtype)
            bias = bias.masked_fill(blocked, float("-inf"))
            with no_cudnn_sdpa():
                outs.append(
                    F.scaled_dot_product_attention(
                        q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=bias, scale=self.scale
                    )
                )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
