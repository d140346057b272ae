"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5 (their "linear_attention" layers), over the gated delta
rule of deltanet.py. Issue 29: the families' decoder layers take it where `layer_types` says linear_attention.

Stage: shared model code (the trainer's packed forward; the engine's prefill and decode on per-sequence state). The
rule runs in `scan_kernels`' Triton kernels on a GPU when no gradient is asked for, else in deltanet.py's torch forms.

Per token: projections give q, k (n_k heads of d_k), v and the output gate z (n_v heads of d_v), and per value head
``b`` and ``a``; q | k | v pass a depthwise causal convolution of width W then SiLU; ``beta = sigmoid(b)``, the
log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``; the rule's output is RMS-normed per head, times SiLU(z)
(the gated norm: float32 inside, weight applied in the input dtype), and ``out_proj`` maps it back.

Parameter names are the HF ones under ``linear_attn.``: ``conv1d.weight`` [C, 1, W] (C = 2 n_k d_k + n_v d_v, channels
q | k | v), ``dt_bias``, ``A_log`` [n_v], ``norm.weight`` [d_v], ``out_proj.weight``, and the input projections in
one of two layouts:
- Qwen3-Next (``fused=True``): ``in_proj_qkvz`` [2 n_k d_k + 2 n_v d_v, H] and ``in_proj_ba`` [2 n_v, H], their rows
  grouped by key head: for each key head, its q, k, then the v and z of its n_v / n_k value heads (and b, a).
- Qwen3.5 (``fused=False``): ``in_proj_qkv`` (q | k | v, each over all heads), ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``.

State (:class:`LinearState`): per sequence, the convolution's last W - 1 inputs and the rule's [n_v, d_k, d_v]
matrix; a sequence starts from zeros, so a packed row (``lengths``) runs sequence by sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import scan_kernels
from .deltanet import causal_conv


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaNetDims:
    """The layer's sizes (HF config keys ``linear_*``, ``hidden_size``, ``rms_norm_eps``)."""

    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    eps: float = 1e-6
    fused: bool = True  # Qwen3-Next's in_proj_qkvz / in_proj_ba; False: Qwen3.5's four projections
    conv_act: str = "silu"  # after the short convolution: the config's hidden_act, as transformers applies it

    def __post_init__(self) -> None:
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.value_heads}) must be a multiple of linear_num_key_heads "
                f"({self.key_heads})"
            )
        if self.conv_width < 1:
            raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.conv_width}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, fused: bool) -> DeltaNetDims:
        return cls(
            hidden=cfg["hidden_size"],
            key_heads=cfg["linear_num_key_heads"],
            value_heads=cfg["linear_num_value_heads"],
            key_dim=cfg["linear_key_head_dim"],
            value_dim=cfg["linear_value_head_dim"],
            conv_width=cfg["linear_conv_kernel_dim"],
            eps=cfg.get("rms_norm_eps", 1e-6),
            fused=fused,
            conv_act=cfg.get("hidden_act", "silu"),
        )

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(slots=True)
class LinearState:
    """Per sequence: ``conv`` [N, C, W - 1] (the convolution's last inputs), ``rule`` [N, n_v, d_k, d_v] (float32)."""

    conv: torch.Tensor
    rule: torch.Tensor

    def select(self, rows: Sequence[int] | torch.Tensor) -> LinearState:
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.conv.device)
        return LinearState(self.conv.index_select(0, idx), self.rule.index_select(0, idx))


def run_packed(module: nn.Module, h: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """A recurrent mixer (Gated DeltaNet, Mamba-2) over each sequence from a zero state: the rows of h [B, T, H], or
    the sequences that ``cu_seqlens`` packs into its one row (empty ones skipped)."""
    if cu_seqlens is None:
        return module(h)[0]
    lengths = [n for n in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist() if n > 0]
    return module(h, lengths=lengths)[0]


Mix = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], tuple[torch.Tensor, LinearState]]

# (first packed position of each sequence of the call, its length, the device): plain values, so a forward that
# no hook asks pays no kernel for it (a decode step runs every recurrent layer on every sequence)
_CALL_ROWS: ContextVar[tuple[list[int], int, torch.device] | None] = ContextVar("miles_call_rows", default=None)


def call_rows() -> torch.Tensor | None:
    """While `run_sequences` runs one group of a packed row's sequences: the packed position (int64, on the input's
    device) of each row of that call's flattened [g * n] tokens, in their order; None otherwise. A hook that
    addresses packed positions (the engine's per-request LoRA adapters, engine/lora.py) maps through it."""
    call = _CALL_ROWS.get()
    if call is None:
        return None
    firsts, n, device = call
    return torch.tensor([p for s in firsts for p in range(s, s + n)], dtype=torch.int64, device=device)


def run_sequences(
    mix: Mix, x: torch.Tensor, lengths: Sequence[int] | None, state: LinearState | None
) -> tuple[torch.Tensor, LinearState]:
    """A recurrent mixer's forward over sequences (Gated DeltaNet's, Mamba-2's): ``mix(x [N, T, H], conv, rule)``
    on rows continuing from ``state`` (None: zeros), or, with ``lengths``, on each sequence of one packed row
    [1, T, H] from its own row of ``state`` (or zeros), never from the previous sequence's. Sequences of one length
    run as the rows of one call (a group's samples, an engine step's decode tokens): each row is its own sequence."""
    if lengths is None:
        return mix(x, None if state is None else state.conv, None if state is None else state.rule)
    if x.shape[0] != 1 or sum(lengths) != x.shape[1]:
        raise ValueError(f"a packed row [1, T] of sequences summing to T: got {tuple(x.shape[:2])}, {list(lengths)}")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    outs: list[torch.Tensor] = [x] * len(lengths)  # placeholders, each replaced by its sequence's rows below
    convs, rules = list(outs), list(outs)
    for n, idx in by_length.items():
        rows = torch.cat([x[:, starts[i] : starts[i] + n] for i in idx])  # [g, n, H]
        init = None if state is None else state.select(idx)
        token = _CALL_ROWS.set(([starts[i] for i in idx], n, x.device))
        try:
            o, end = mix(rows, None if init is None else init.conv, None if init is None else init.rule)
        finally:
            _CALL_ROWS.reset(token)
        for j, i in enumerate(idx):
            outs[i], convs[i], rules[i] = o[j : j + 1], end.conv[j : j + 1], end.rule[j : j + 1]
    return torch.cat(outs, dim=1), LinearState(torch.cat(convs), torch.cat(rules))


class GatedRMSNorm(nn.Module):
    """RMS-norm over the last dim, times the weight (in the input dtype), times SiLU(gate) (float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    def __init__(self, dims: DeltaNetDims) -> None:
        super().__init__()
        d = self.dims = dims
        key_all, value_all = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        if d.fused:
            self.in_proj_qkvz = nn.Linear(d.hidden, 2 * key_all + 2 * value_all, bias=False)
            self.in_proj_ba = nn.Linear(d.hidden, 2 * d.value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(d.hidden, 2 * key_all + value_all, bias=False)
            self.in_proj_z = nn.Linear(d.hidden, value_all, bias=False)
            self.in_proj_b = nn.Linear(d.hidden, d.value_heads, bias=False)
            self.in_proj_a = nn.Linear(d.hidden, d.value_heads, bias=False)
        self.conv1d = nn.Conv1d(d.conv_channels, d.conv_channels, d.conv_width, groups=d.conv_channels, bias=False)
        from .layers import ACTIVATIONS  # here: layers imports the config module, which imports this one

        self.conv_act = ACTIVATIONS[d.conv_act]
        self.dt_bias = nn.Parameter(torch.ones(d.value_heads))
        self.A_log = nn.Parameter(torch.zeros(d.value_heads))
        self.norm = GatedRMSNorm(d.value_dim, d.eps)
        self.out_proj = nn.Linear(value_all, d.hidden, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A = exp(A_log) uniform in [0.01, 16] (transformers' Qwen3-Next initialisation: most heads decay within a
        token or two), dt_bias 1."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
            self.dt_bias.fill_(1.0)
        self.norm.reset_parameters()

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q | k | v flat [B, T, C], z [B, T, n_v, d_v], b, a [B, T, n_v]) in either layout."""
        d, (bsz, t) = self.dims, x.shape[:2]
        r = d.value_heads // d.key_heads
        if not d.fused:
            z = self.in_proj_z(x).view(bsz, t, d.value_heads, d.value_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x).view(bsz, t, d.key_heads, 2 * d.key_dim + 2 * r * d.value_dim)
        q, k, v, z = qkvz.split([d.key_dim, d.key_dim, r * d.value_dim, r * d.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, t, d.key_heads, 2 * r).split([r, r], dim=-1)
        flat = torch.cat([q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)], dim=-1)
        z = z.reshape(bsz, t, d.value_heads, d.value_dim)
        return flat, z, b.reshape(bsz, t, d.value_heads), a.reshape(bsz, t, d.value_heads)

    def _mix(
        self, x: torch.Tensor, conv: torch.Tensor | None, rule: torch.Tensor | None
    ) -> tuple[torch.Tensor, LinearState]:
        """Sequences [N, T, H], each continuing from its state rows (None: from zeros)."""
        d, (n, t) = self.dims, x.shape[:2]
        flat, z, b, a = self._project(x)
        mixed, conv_out = causal_conv(flat, self.conv1d.weight[:, 0, :], conv, act=self.conv_act)
        key_all = d.key_heads * d.key_dim
        q, k, v = mixed.split([key_all, key_all, d.value_heads * d.value_dim], dim=-1)
        q = q.reshape(n, t, d.key_heads, d.key_dim)
        k = k.reshape(n, t, d.key_heads, d.key_dim)
        v = v.reshape(n, t, d.value_heads, d.value_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        # decode: one step, no chunk padding; scan_kernels runs Triton on a GPU when no gradient is asked for
        rule_fn = scan_kernels.gated_delta_recurrent if t == 1 else scan_kernels.gated_delta_chunked
        o, rule_out = rule_fn(q, k, v, g, b.sigmoid(), rule)
        o = self.norm(o, z).reshape(n, t, -1)
        return self.out_proj(o), LinearState(conv_out, rule_out)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per sequence: the convolution's (channels, W - 1) and the delta rule's (n_v, d_k, d_v)."""
        d = self.dims
        return (d.conv_channels, d.conv_width - 1), (d.value_heads, d.key_dim, d.value_dim)

    def forward(
        self, x: torch.Tensor, lengths: Sequence[int] | None = None, state: LinearState | None = None
    ) -> tuple[torch.Tensor, LinearState]:
        """``x`` [N, T, H]: N sequences of T tokens, each continuing from its row of ``state`` (None: from the
        start); or, with ``lengths``, one packed row [1, T, H] of sequences starting from zeros (``state`` then has
        one row per sequence, or is None). Returns the output like ``x`` and every sequence's state after it."""
        return run_sequences(self._mix, x, lengths, state)
