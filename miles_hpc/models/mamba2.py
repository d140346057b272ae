"""The Mamba-2 mixer of Nemotron-H (its "M" layers): the state-space scan in a chunked form (training, prefill) and a
recurrent one (decode), and the layer around it. Issue 29: the family's blocks take it where the pattern says M.

Stage: shared model code (the trainer's packed forward; the engine's prefill and decode on per-sequence state). The
scan runs in `scan_kernels`' Triton kernels on a GPU when no gradient is asked for, else in the torch forms here.

Per head h (P = head_dim channels, N = ssm_state_size), state ``S`` [P, N]; token t with input ``x_t`` [P], the
group's ``B_t``, ``C_t`` [N] (heads share them in n_groups groups), step ``dt_t = max(softplus(dt_raw + dt_bias),
time_step_min)`` and ``A = -exp(A_log)``:

    S <- exp(dt_t A) S + dt_t x_t B_t^T,        y_t = S C_t + D x_t

Chunked form: inside a chunk with cumulative log-decay ``G_i = sum_{j<=i} dt_j A`` and start state ``S0``,
``y_i = exp(G_i) S0 C_i + sum_{j<=i} exp(G_i - G_j) (C_i . B_j) dt_j x_j + D x_i`` and the state passed on is
``exp(G_C) S0 + sum_j exp(G_C - G_j) dt_j x_j B_j^T``. The scan runs in float32.

The step's floor applies in both forms (transformers' decode path omits it; its prefill and training paths, which
the trainer's log-probs come from, apply it: the engine must decode what the trainer scores).

The layer: ``in_proj`` gives the output gate z [I] (I = heads x P), x | B | C [I + 2 G N] and dt [heads]; x | B | C
pass the depthwise causal convolution (with bias) and SiLU; the scan's ``y`` times SiLU(z) is RMS-normed in groups
of I / G channels, times the weight; ``out_proj`` maps it back. HF names under ``mixer.``: ``in_proj``, ``conv1d``
(``weight`` [C, 1, W], ``bias``), ``dt_bias``, ``A_log``, ``D`` [heads], ``norm.weight`` [I], ``out_proj``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import scan_kernels
from .deltanet import causal_conv
from .linear_attn import LinearState, run_sequences

CHUNK = 128  # Nemotron-H's default mamba chunk size


@dataclass(frozen=True, kw_only=True, slots=True)
class Mamba2Dims:
    """The mixer's sizes (HF config keys of nemotron_h)."""

    hidden: int
    heads: int
    head_dim: int
    state: int
    groups: int
    conv_width: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 1e-3  # time_step_min: the floor of each step
    eps: float = 1e-5
    chunk: int = CHUNK  # chunk_size of the chunked scan (the result is the same up to float32 rounding)

    def __post_init__(self) -> None:
        if self.heads % self.groups:
            raise ValueError(f"mamba_num_heads ({self.heads}) must be a multiple of n_groups ({self.groups})")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Mamba2Dims:
        return cls(
            hidden=cfg["hidden_size"],
            heads=cfg["mamba_num_heads"],
            head_dim=cfg["mamba_head_dim"],
            state=cfg["ssm_state_size"],
            groups=cfg["n_groups"],
            conv_width=cfg["conv_kernel"],
            conv_bias=cfg.get("use_conv_bias", True),
            proj_bias=cfg.get("use_bias", False),
            dt_min=cfg.get("time_step_min", 1e-3),
            eps=cfg.get("layer_norm_epsilon", 1e-5),
            chunk=cfg.get("chunk_size", CHUNK),
        )

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state


def _heads(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, groups, N] -> [B, heads, T, N] (each group serves heads / groups consecutive heads), float32."""
    return bc.float().repeat_interleave(heads // bc.shape[2], dim=2).transpose(1, 2)


def ssd_recurrent(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: ``x`` [B, T, heads, P], ``dt`` [B, T, heads] (the step, floored), ``a`` [heads] (A),
    ``b``, ``c`` [B, T, groups, N]; state [B, heads, P, N] (None: zeros). Returns (y without the D term, state)."""
    heads = x.shape[2]
    xs, dts = x.float().transpose(1, 2), dt.float().transpose(1, 2)  # [B, h, T, P], [B, h, T]
    bs, cs = _heads(b, heads), _heads(c, heads)
    s = state.float() if state is not None else xs.new_zeros(*xs.shape[:2], xs.shape[-1], bs.shape[-1])
    out = []
    for t in range(xs.shape[2]):
        decay = (dts[:, :, t] * a.float()).exp()[..., None, None]
        s = decay * s + (dts[:, :, t, None] * xs[:, :, t])[..., None] * bs[:, :, t, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", s, cs[:, :, t]))
    y = torch.stack(out, dim=2) if out else xs.new_zeros(xs.shape)
    return y.transpose(1, 2), s


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same scan a chunk at a time (module docstring); same arguments and results as :func:`ssd_recurrent`."""
    heads, length = x.shape[2], x.shape[1]
    xs, dts = x.float().transpose(1, 2), dt.float().transpose(1, 2)
    bs, cs = _heads(b, heads), _heads(c, heads)
    s = state.float() if state is not None else xs.new_zeros(*xs.shape[:2], xs.shape[-1], bs.shape[-1])
    pad = (-length) % chunk
    if pad:  # padded tokens: step 0 (no decay, no write), outputs dropped
        xs, bs, cs = (F.pad(t, (0, 0, 0, pad)) for t in (xs, bs, cs))
        dts = F.pad(dts, (0, pad))
    n = xs.shape[2] // chunk
    xs, bs, cs = (t.reshape(*t.shape[:2], n, chunk, t.shape[-1]) for t in (xs, bs, cs))
    dts = dts.reshape(*dts.shape[:2], n, chunk)
    cum = (dts * a.float()[None, :, None, None]).cumsum(-1)  # G_i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=xs.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    written = dts[..., None] * xs  # dt_j x_j
    scores = decay * (cs @ bs.transpose(-1, -2))  # exp(G_i - G_j) C_i . B_j
    to_end = (cum[..., -1:] - cum).exp()[..., None]
    outs = []
    for k in range(n):
        y = cum[:, :, k, :, None].exp() * (cs[:, :, k] @ s.transpose(-1, -2)) + scores[:, :, k] @ written[:, :, k]
        outs.append(y)
        s = (
            cum[:, :, k, -1, None, None].exp() * s
            + (to_end[:, :, k] * written[:, :, k]).transpose(-1, -2) @ bs[:, :, k]
        )
    y = torch.cat(outs, dim=2)[:, :, :length]
    return y.transpose(1, 2), s


class GroupedGatedNorm(nn.Module):
    """y x SiLU(z) (float32), RMS-normed in groups of ``group`` channels, times the weight (in the input dtype)."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Mamba2Mixer(nn.Module):
    def __init__(self, dims: Mamba2Dims) -> None:
        super().__init__()
        d = self.dims = dims
        self.in_proj = nn.Linear(d.hidden, d.inner + d.conv_channels + d.heads, bias=d.proj_bias)
        self.conv1d = nn.Conv1d(d.conv_channels, d.conv_channels, d.conv_width, groups=d.conv_channels,
                                bias=d.conv_bias)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(d.heads))
        self.A_log = nn.Parameter(torch.zeros(d.heads))
        self.D = nn.Parameter(torch.ones(d.heads))
        self.norm = GroupedGatedNorm(d.inner, d.inner // d.groups, d.eps)
        self.out_proj = nn.Linear(d.inner, d.hidden, bias=d.proj_bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A = 1..heads (S4D-real), D and dt_bias 1 (Nemotron-H's initialisation)."""
        with torch.no_grad():
            self.A_log.copy_(torch.arange(1, self.dims.heads + 1, dtype=torch.float32).log())
            self.D.fill_(1.0)
            self.dt_bias.fill_(1.0)
        self.norm.reset_parameters()

    def _mix(
        self, x: torch.Tensor, conv: torch.Tensor | None, scan: torch.Tensor | None
    ) -> tuple[torch.Tensor, LinearState]:
        d, (n, t) = self.dims, x.shape[:2]
        z, xbc, dt_raw = self.in_proj(x).split([d.inner, d.conv_channels, d.heads], dim=-1)
        xbc, conv_out = causal_conv(xbc, self.conv1d.weight[:, 0, :], conv, self.conv1d.bias)
        xs, b, c = xbc.split([d.inner, d.groups * d.state, d.groups * d.state], dim=-1)
        xs = xs.reshape(n, t, d.heads, d.head_dim)
        b, c = b.reshape(n, t, d.groups, d.state), c.reshape(n, t, d.groups, d.state)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float()).clamp(min=d.dt_min)
        a = -self.A_log.float().exp()
        if t == 1:  # decode: one step, no chunk padding (scan_kernels: Triton on a GPU when no gradient is asked)
            y, scan_out = scan_kernels.ssd_recurrent(xs, dt, a, b, c, scan)
        else:
            y, scan_out = scan_kernels.ssd_chunked(xs, dt, a, b, c, scan, chunk=d.chunk)
        y = y + self.D.float()[:, None] * xs.float()
        y = self.norm(y.reshape(n, t, d.inner), z)  # float32 in, as transformers: cast after the weight
        return self.out_proj(y.to(x.dtype)), LinearState(conv_out, scan_out)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per sequence: the convolution's (channels, W - 1) and the scan's (heads, head_dim, state)."""
        d = self.dims
        return (d.conv_channels, d.conv_width - 1), (d.heads, d.head_dim, d.state)

    def forward(
        self, x: torch.Tensor, lengths: Sequence[int] | None = None, state: LinearState | None = None
    ) -> tuple[torch.Tensor, LinearState]:
        """As `linear_attn.GatedDeltaNet.forward`: sequences [N, T, H] continuing from ``state`` rows, or one packed
        row with ``lengths`` (each sequence from zeros); the state's ``rule`` is the scan's [N, heads, P, N_state]."""
        return run_sequences(self._mix, x, lengths, state)
