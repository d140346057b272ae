"""Fused routed experts for the engine's MoE layers: two Triton grouped GEMMs over the (token, slot) pairs sorted by
expert, with no host synchronisation.

Stage: engine (`install` swaps the forward of a model's `moe.Experts` on CUDA; the trainer keeps
`moe.grouped_mix`, the reference). Imported only where Triton is installed.

`grouped_mix` reads the expert counts on the host (one sync per layer) and launches ~5 kernels per expert that got
tokens: at decode, with 128 experts and 8 per token, thousands of launches per step. Here:
- `align` (torch, on the device): the N*k pairs sorted by expert, each expert's group padded to BLOCK_M rows, in a
  buffer of the worst-case size N*k + E*(BLOCK_M - 1), so no shape depends on the routing; `block_expert[b]` is the
  expert of block b, or -1 past the last one;
- `_gate_up_kernel`: program (block, column tile of the expert width) gathers its block's token rows of x, multiplies
  by the expert's gate and up rows (float32 accumulation), and writes act(gate) * up for each pair;
- `_down_kernel`: program (block, column tile of the hidden width) multiplies those rows by the expert's down
  projection and scales each by its routing weight;
- the pairs' outputs are summed over the k slots per token in float32 (`grouped_mix`'s combine: no atomics, the
  same order whatever the batch).
Activations: SiLU (SwiGLU experts: Qwen3-MoE, DeepSeek-V3, GLM-4.5, Qwen3-Next); others keep `grouped_mix`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from miles_hpc.models.moe import Experts

__all__ = ["align", "fused_experts", "install"]


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [N*k + E*(block_m-1)]: pair index (token * k + slot) per row, -1 for padding, grouped by expert in
    expert order, each group padded to a multiple of block_m; block_expert [rows / block_m]: each block's expert,
    -1 for blocks past the last group). Device ops only."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    rows = n + num_experts * (block_m - 1)
    rows = -(-rows // block_m) * block_m
    # not torch.bincount: on CUDA it reads the largest id on the host (a sync); integer adds are exact in any order
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position among the sorted pairs
    dest = (ends - padded)[e_sorted] + torch.arange(n, device=flat.device) - first[e_sorted]
    pairs = torch.full((rows,), -1, dtype=torch.int64, device=flat.device)
    pairs[dest] = order
    starts = torch.arange(0, rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return pairs, block_expert


@triton.jit
def _gate_up_kernel(
    X,
    W,
    PAIRS,
    BLOCK_EXPERT,
    OUT,
    hidden,
    inter,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(BLOCK_EXPERT + b)
    if e < 0:
        return
    pairs = tl.load(PAIRS + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs >= 0
    tok = tl.where(valid, pairs // TOP_K, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    w_base = W + e.to(tl.int64) * 2 * inter * hidden
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < hidden
        x = tl.load(
            X + tok[:, None].to(tl.int64) * hidden + kk[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0
        )
        wmask = mask_n[:, None] & mask_k[None, :]
        wg = tl.load(w_base + offs_n[:, None].to(tl.int64) * hidden + kk[None, :], mask=wmask, other=0.0)
        wu = tl.load(w_base + (inter + offs_n[:, None]).to(tl.int64) * hidden + kk[None, :], mask=wmask, other=0.0)
        if IEEE:
            acc_g += tl.dot(x, tl.trans(wg), input_precision="ieee")
            acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
        else:
            acc_g += tl.dot(x, tl.trans(wg))
            acc_u += tl.dot(x, tl.trans(wu))
    # Rounded as grouped_mix rounds: each projection to the activations' dtype, then silu(gate) * up.
    g = acc_g.to(OUT.dtype.element_ty).to(tl.float32)
    u = acc_u.to(OUT.dtype.element_ty).to(tl.float32)
    h = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32) * u
    out = OUT + pairs[:, None].to(tl.int64) * inter + offs_n[None, :]
    tl.store(out, h.to(OUT.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    H,
    W,
    PAIRS,
    BLOCK_EXPERT,
    WEIGHTS,
    OUT,
    hidden,
    inter,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(BLOCK_EXPERT + b)
    if e < 0:
        return
    pairs = tl.load(PAIRS + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs >= 0
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    w_base = W + e.to(tl.int64) * hidden * inter
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < inter
        h = tl.load(H + rows[:, None] * inter + kk[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_base + offs_n[:, None].to(tl.int64) * inter + kk[None, :], mask=wmask, other=0.0)
        if IEEE:
            acc += tl.dot(h, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(w))
    wt = tl.load(WEIGHTS + rows, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(OUT.dtype.element_ty).to(tl.float32) * wt[:, None]
    tl.store(
        OUT + rows[:, None] * hidden + offs_n[None, :],
        y.to(OUT.dtype.element_ty),
        mask=valid[:, None] & mask_n[None, :],
    )


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """x [N, H], gate_up [E, 2I, H], down [E, H, I], ids/weights [N, k] -> sum_j weights[:, j] *
    down_e(silu(gate_e(x)) * up_e(x)) for e = ids[:, j], [N, H] in x's dtype (`Experts.forward` with SiLU)."""
    n_tok, k = ids.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    if x.shape != (n_tok, hidden) or down.shape != (e, hidden, inter):
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    pairs, block_expert = align(ids, e, block_m)
    h = torch.empty((n_tok * k, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((n_tok * k, hidden), dtype=x.dtype, device=x.device)  # every pair's row is written once
    w = weights.reshape(-1).to(x.dtype).contiguous()
    ieee = x.dtype == torch.float32
    nb = block_expert.numel()
    blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    _gate_up_kernel[(nb, triton.cdiv(inter, block_n))](
        x, gate_up, pairs, block_expert, h, hidden, inter, TOP_K=k, **blocks
    )
    _down_kernel[(nb, triton.cdiv(hidden, block_n))](h, down, pairs, block_expert, w, y, hidden, inter, **blocks)
    return y.view(n_tok, k, hidden).sum(dim=1).to(x.dtype)


def install(model: nn.Module) -> int:
    """Swap the forward of each SiLU `Experts` in `model` for `fused_experts` (inference only: no backward);
    returns how many were swapped."""
    n = 0
    for m in model.modules():
        if isinstance(m, Experts) and m.act is F.silu:
            m.forward = _fused_forward(m)  # type: ignore[method-assign]
            n += 1
    return n


def _fused_forward(m: Experts):  # noqa: ANN202
    def forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, m.gate_up_proj, m.down_proj, ids, weights)

    return forward
