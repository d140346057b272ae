"""Batch-invariant primitives for zero-KL mode (stage: shared model code; issue 12; docs/lora.md, "Zero-KL mode").
`batch_invariant.make_batch_invariant` wires them into a model; the engine (`EngineConfig.batch_invariant`) and the
trainer (`FSDPTrainer(zero_kl=True)`) use them.

The problem: a GEMM or a reduction kernel picks its algorithm (blocking, vector path, split of the reduction) from
the shapes of the call, so the same token row computed in a batch of 1 (the engine's decode step) and in a batch
of 4096 (the trainer's packed forward) can differ in the last bits (measured with torch's CPU `mm`: rows of a
1-7-row product differ from the same rows of a 300-row product by up to 4e-5; from 16 rows on they agree here,
which is luck of the library, not a contract).

The rule every function here follows: the kernels run on fixed-shape row tiles, `row_tile(width)` rows at a time
(the last tile padded with zeros), so every call a row takes part in has the same shape whatever the batch, and a
row's result depends on that row alone (GEMMs and row reductions do not mix rows). The tile height depends only on
the row width, so the engine and the trainer pick the same one. The cost: the padding, and one kernel call per
tile instead of one per batch.

Kernels (`MILES_INVARIANT_KERNELS`, read at each call; every process of a run inherits it, so the engine and the
trainer pick alike): "torch" runs the fixed-shape torch tiles above on any device; "triton" runs `linear`,
`rms_norm`, `log_softmax` and `packed_attention` on CUDA tensors as one launch of `models/triton_invariant.py`'s
kernels each, and the elementwise tiles (`elementwise`) as one call (a CUDA elementwise kernel computes every
element by the same instructions wherever it sits); "auto", the default, is "triton" on CUDA tensors where Triton is
installed and "torch" elsewhere. Whether a call takes the Triton path depends on the setting, the device and the
shapes alone, never on the batch. Checked on CPU in Triton's interpreter (tests/test_invariant_triton_dispatch.py)
and on an H100 (2026-12-07: tests/test_zero_kl_gpu.py's bitwise and RL-run cases under "triton", mismatch 0.0;
bench_zero_kl.py: engine 3.6x and trainer 2.1x the normal mode's cost at Qwen3-0.6B shapes, where the torch tiles
did not finish within 200 s).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .attention import no_cudnn_sdpa

__all__ = [
    "KEY_CHUNK",
    "QUERY_TILE",
    "KERNELS_ENV",
    "act_mul",
    "attention",
    "elementwise",
    "linear",
    "log_softmax",
    "packed_attention",
    "rms_norm",
    "row_tile",
    "silu_mul",
    "tiled",
    "token_log_softmax",
]

MAX_TILE_ELEMENTS = 1 << 15  # one tile stays inside one parallel chunk of torch's CPU elementwise loops
MAX_TILE_ROWS = 64
QUERY_TILE = 16  # attention: queries per tile
KEY_CHUNK = 64  # attention: keys per chunk
KERNELS_ENV = "MILES_INVARIANT_KERNELS"


def kernels() -> str:
    """The kernels setting: "auto" (unset: Triton on CUDA tensors where Triton is installed), "torch" or "triton"
    (module docstring)."""
    value = os.environ.get(KERNELS_ENV, "auto")
    if value not in ("auto", "torch", "triton"):
        raise ValueError(f"{KERNELS_ENV}={value!r}: use 'auto', 'torch' or 'triton'")
    return value


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _uses_triton(t: torch.Tensor) -> bool:
    """Whether an op on `t` runs its Triton kernel: "auto" on a CUDA tensor with Triton installed; "triton" on a
    CUDA tensor, or on any tensor under Triton's interpreter (TRITON_INTERPRET=1, which the CPU tests use)."""
    setting = kernels()
    if setting == "auto":
        return t.is_cuda and _have_triton()
    return setting == "triton" and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _triton(t: torch.Tensor) -> Any:
    """`triton_invariant` when an op on `t` runs its Triton kernel (`_uses_triton`), else None."""
    if not _uses_triton(t):
        return None
    from miles_hpc.models import triton_invariant

    return triton_invariant


def row_tile(width: int) -> int:
    """Rows per tile for rows of `width` elements: a power of two, at most 64, and tile elements within
    MAX_TILE_ELEMENTS where possible (at least 1 row)."""
    rows = MAX_TILE_ROWS
    while rows > 1 and rows * width > MAX_TILE_ELEMENTS:
        rows //= 2
    return rows


def tiled(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *params: torch.Tensor,
    width: int | None = None,
    fast: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """`fn(tile, *params)` over the rows of `x` (any leading dims, last dim = a row) in fixed-shape tiles of
    `row_tile(width or x's row width)` rows; `fn` must map a [rows, width] tile to [rows, ...] row by row. With
    `fast`, the forward is `fast(x, *params)` instead (one batch-invariant launch, same result up to rounding).

    Differentiable w.r.t. `x` and `params` (the tensors `fn` reads besides the tile: weights, biases), the cheap way:
    the forward runs without recording a graph, the backward recomputes `fn` on all rows at once (one call, the
    usual kernels) and differentiates that. Only the forward's bits must not depend on the batch; the gradient is
    the same function's, up to rounding."""
    return _RowTiled.apply(fn, fast, width, x, *params)


def _tiles(fn: Callable[..., torch.Tensor], x: torch.Tensor, params: tuple[torch.Tensor, ...], width: int | None):
    lead, w = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, w)
    n = rows.shape[0]
    if n == 0:
        out = fn(rows, *params)
        return out.reshape(*lead, *out.shape[1:])
    r = row_tile(width or w)
    pad = (-n) % r
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, w)])
    out = torch.cat([fn(rows[i : i + r], *params) for i in range(0, rows.shape[0], r)])[:n]
    return out.reshape(*lead, *out.shape[1:])


class _RowTiled(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        fast: Callable[..., torch.Tensor] | None,
        width: int | None,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x, *params)
        return fast(x, *params) if fast is not None else _tiles(fn, x, params, width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip((x, *params), needs)]
            rows = inputs[0].reshape(-1, x.shape[-1])
            out = ctx.fn(rows, *inputs[1:])
            wanted = [t for t in inputs if t.requires_grad]
            got = iter(torch.autograd.grad(out, wanted, grad.reshape(out.shape)) if wanted else ())
        return (None, None, None, *(next(got) if need else None for need in needs))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with every GEMM of shape [row_tile(in), in] x [in, out] (or one Triton GEMM: `_triton`).
    Differentiable: the backward is F.linear's own (two GEMMs on all rows at once, nothing recomputed)."""
    tri = _triton(x)
    forward = tri.linear if tri is not None else _tiled_linear
    return _Linear.apply(forward, x, weight, bias)


def _tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _tiles(torch.nn.functional.linear, x, (weight,) if bias is None else (weight, bias), None)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        forward: Callable[..., torch.Tensor],
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return forward(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        _, need_x, need_w, need_b = ctx.needs_input_grad
        gx = grad.matmul(weight) if need_x else None
        gw = rows.t().matmul(x.reshape(-1, x.shape[-1])) if need_w else None
        gb = rows.sum(0) if need_b else None
        return None, gx, gw, gb


def _rms_norm_rows(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t32 = t.float()
    return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as `models.layers.RMSNorm` computes it (float32 statistics, cast back), on fixed-shape tiles."""
    tri = _triton(x)
    fast = (lambda t, w: tri.rms_norm(t, w, eps)) if tri is not None else None
    return tiled(lambda t, w: _rms_norm_rows(t, w, eps), x, weight, fast=fast)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` on fixed-shape tiles (transcendental elementwise kernels may take another vector
    path at a tensor's tail, so a row's position must not depend on the batch either)."""
    return act_mul(torch.nn.functional.silu, gate, up)


def act_mul(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`act(gate) * up` on fixed-shape tiles of [gate | up] rows."""
    if _untiled(gate):
        return act(gate) * up
    w = gate.shape[-1]
    return tiled(lambda t: act(t[:, :w]) * t[:, w:], torch.cat([gate, up], dim=-1), width=2 * w)


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an `fn` that maps each row on its own (elementwise work: RoPE's cos/sin): on fixed-shape tiles,
    or one call where CUDA's elementwise kernels decide (the "triton" setting on a CUDA tensor)."""
    return fn(x) if _untiled(x) else tiled(fn, x)


def _untiled(t: torch.Tensor) -> bool:
    return t.is_cuda and _uses_triton(t)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the last dim, on fixed-shape tiles (the log-probs both sides report)."""
    tri = _triton(logits)
    fast = tri.log_softmax if tri is not None else None
    return tiled(lambda t: torch.log_softmax(t.float(), dim=-1), logits, fast=fast)


TOKEN_CHUNK_ELEMENTS = 1 << 26  # `token_log_softmax` on the tiles: float32 elements per chunk of rows (256 MiB)


def token_log_softmax(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[i, target[i]]` for each row i of logits [N, V]: float32 [N] with `log_softmax`'s bits,
    without a float32 [N, V] tensor (one Triton pass per row; on the tiles, chunks of whole tiles). Forward only:
    train/logprobs.py differentiates it."""
    tri = _triton(logits)
    if tri is not None:
        return tri.token_log_softmax(logits, target)
    n, width = logits.shape
    tile = row_tile(width)
    step = max(tile, TOKEN_CHUNK_ELEMENTS // max(width, 1) // tile * tile)
    parts = [
        _tiles(lambda t: torch.log_softmax(t.float(), dim=-1), logits[a : a + step], (), None)
        .gather(1, target[a : a + step, None])
        .squeeze(1)
        for a in range(0, n, step)
    ]
    return torch.cat(parts) if parts else logits.new_empty(0, dtype=torch.float32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ONE sequence's queries, each over the keys at positions <= its own, computed the same way
    whether the queries come one at a time (a decode step over the KV cache), as a chunk after a cached prefix, or
    as the whole sequence (the trainer).

    q [Hq, Nq, D] at absolute `positions` [Nq]; k [Hkv, Nk, D], v [Hkv, Nk, Dv] for positions 0..Nk-1 (Nk > every
    query position; Hq a multiple of Hkv). In float32: for each tile of QUERY_TILE queries and each chunk of KEY_CHUNK
    keys, scores [Hq, tile, chunk] by one fixed-shape batched GEMM; the row maximum over all chunks (order-free);
    then, chunk by chunk in key order, exp(scores - max) summed into the denominator and multiplied into the output
    by fixed-shape GEMMs. Chunks past a tile's last position add exact zeros, so they are skipped, and a row's result
    does not depend on how many keys or queries the call holds. Returns [Hq, Nq, Dv] in q's dtype.

    Differentiable the cheap way, as `tiled`: the backward recomputes plain masked softmax attention (one SDPA) and
    differentiates that."""
    return _Attention.apply(q, k, v, positions, scale)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, positions)
        ctx.scale = scale
        return _attention(q, k, v, positions, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, positions = ctx.saved_tensors
        return (*_sdpa_grads(q, k, v, positions, ctx.scale, grad, ctx.needs_input_grad[:3]), None, None)


def _sdpa_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    grad: torch.Tensor,
    needs: Sequence[bool],
) -> list[torch.Tensor | None]:
    """The gradients of one sequence's causal attention w.r.t. q, k, v (those `needs` asks for), by plain masked
    softmax attention (one SDPA) recomputed and differentiated."""
    with torch.enable_grad():
        qi, ki, vi = (t.detach().requires_grad_(need) for t, need in zip((q, k, v), needs))
        mask = torch.arange(k.shape[1], device=k.device)[None, :] <= positions[:, None]  # [Nq, Nk]
        out = torch.nn.functional.scaled_dot_product_attention(
            qi[None], ki[None], vi[None], attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
        )[0]
        wanted = [t for t in (qi, ki, vi) if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype)) if wanted else ())
    return [next(got) if need else None for need in needs]


Layout = tuple[Sequence[int], Sequence[int], Sequence[int]]  # (starts, cu_q, cu_k): `packed_attention`


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: Sequence[int],
    cu_q: Sequence[int],
    cu_k: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """`attention` of several sequences packed along the token dim: q [Hq, Tq, D] with sequence i's queries at
    columns cu_q[i]..cu_q[i+1]-1, at consecutive positions from starts[i]; k [Hkv, Tk, D] and v [Hkv, Tk, Dv] with
    its keys at positions 0.. at columns cu_k[i]..cu_k[i+1]-1 (disjoint spans). Returns [Hq, Tq, Dv], each
    sequence's columns exactly as `attention` of that sequence alone gives them: the engine (a step's sequences)
    and the trainer (a packed row) both call this. One Triton launch in all (`_triton`, power-of-two head dims),
    else `attention` per sequence; the layout is host integers, so neither path waits on the device for it."""
    layout = (tuple(starts), tuple(cu_q), tuple(cu_k))
    d, dv = q.shape[-1], v.shape[-1]
    if _triton(q) is None or d & (d - 1) or dv & (dv - 1):
        parts = [
            attention(q[:, a:b], k[:, c:e], v[:, c:e], torch.arange(p, p + b - a, device=q.device), scale)
            for p, a, b, c, e in _spans(layout)
            if b > a
        ]
        return torch.cat(parts, dim=1) if parts else q.new_empty(q.shape[0], 0, dv)
    return _PackedAttention.apply(q, k, v, layout, scale)


def _spans(layout: Layout) -> list[tuple[int, int, int, int, int]]:
    """(first position, query columns a..b, key columns c..e) of each sequence."""
    starts, cu_q, cu_k = layout
    return [(p, cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]) for i, p in enumerate(starts)]


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, scale: float) -> Any:
        ctx.save_for_backward(q, k, v)
        ctx.layout, ctx.scale = layout, scale
        tri = _triton(q)
        out = tri.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), *layout, scale)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        spans = [s for s in _spans(ctx.layout) if s[2] > s[1]]
        if len(spans) > 1 and all(p == 0 and b - a == e - c for p, a, b, c, e in spans):
            return (*_padded_grads(q, k, v, spans, ctx.scale, grad, needs), None, None)
        grads = [torch.zeros_like(t) if need else None for t, need in zip((q, k, v), needs)]
        for p, a, b, c, e in _spans(ctx.layout):
            if b == a:
                continue
            pos = torch.arange(p, p + b - a, device=q.device)
            got = _sdpa_grads(q[:, a:b], k[:, c:e], v[:, c:e], pos, ctx.scale, grad[:, a:b], needs)
            for g, piece, span in zip(grads, got, ((a, b), (c, e), (c, e))):
                if g is not None and piece is not None:
                    g[:, span[0] : span[1]] += piece
        return (*grads, None, None)


def _padded_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: list[tuple[int, int, int, int, int]],
    scale: float,
    grad: torch.Tensor,
    needs: Sequence[bool],
) -> list[torch.Tensor | None]:
    """`_sdpa_grads` of whole sequences (the trainer's layout: each from position 0, queries and keys alike) in one
    call instead of one per sequence: the sequences right-padded to the longest into a batch and one causal SDPA
    differentiated. A real query sees only keys at or before it, never the padding after its sequence; padding
    queries get a zero upstream gradient, so the padded keys' gradients are zero, and only real rows are kept."""
    longest = max(b - a for _, a, b, _, _ in spans)
    offs = torch.arange(longest)
    lens = torch.tensor([b - a for _, a, b, _, _ in spans])
    real = offs[None, :] < lens[:, None]  # [n, L]
    rows_q = (torch.tensor([a for _, a, _, _, _ in spans])[:, None] + offs).clamp(max=q.shape[1] - 1)
    rows_k = (torch.tensor([c for _, _, _, c, _ in spans])[:, None] + offs).clamp(max=k.shape[1] - 1)
    real, rows_q, rows_k = (t.to(q.device) for t in (real, rows_q, rows_k))
    g = grad[:, rows_q].transpose(0, 1) * real[:, None, :, None]  # [n, Hq, L, Dv], zero on padding rows
    with torch.enable_grad():
        qi = q[:, rows_q].transpose(0, 1).detach().requires_grad_(needs[0])
        ki = k[:, rows_k].transpose(0, 1).detach().requires_grad_(needs[1])
        vi = v[:, rows_k].transpose(0, 1).detach().requires_grad_(needs[2])
        with no_cudnn_sdpa():
            out = torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
            )
        wanted = [t for t in (qi, ki, vi) if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, g.to(out.dtype)) if wanted else ())
    result: list[torch.Tensor | None] = []
    for t, need, rows in zip((q, k, v), needs, (rows_q, rows_k, rows_k)):
        if not need:
            result.append(None)
            continue
        full = torch.zeros_like(t)
        full[:, rows[real]] = next(got).transpose(0, 1)[:, real].to(t.dtype)
        result.append(full)
    return result


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_q: torch.Tensor, scale: float) -> torch.Tensor:
    hq, nq, _ = q.shape
    hkv, nk, dv = v.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into {hkv} key/value heads")
    if nq and int(pos_q.max()) >= nk:
        raise ValueError(f"a query at position {int(pos_q.max())} needs keys up to it; {nk} given")
    rep = hq // hkv
    kpad = (-nk) % KEY_CHUNK  # zero keys and values past the end: masked, and 0 * v stays 0 (no garbage)
    k32 = torch.nn.functional.pad(k.float(), (0, 0, 0, kpad)).repeat_interleave(rep, dim=0)
    v32 = torch.nn.functional.pad(v.float(), (0, 0, 0, kpad)).repeat_interleave(rep, dim=0)
    qpad = (-nq) % QUERY_TILE
    q32 = torch.nn.functional.pad(q.float(), (0, 0, 0, qpad))
    pos = torch.nn.functional.pad(pos_q, (0, qpad), value=-1)  # padding queries see nothing
    outs = []
    for t in range(0, nq + qpad, QUERY_TILE):
        qt, pt = q32[:, t : t + QUERY_TILE], pos[t : t + QUERY_TILE]
        last = int(pt.max())
        chunks = range(0, max(last + 1, 1), KEY_CHUNK)
        scores = []
        for c in chunks:
            s = torch.bmm(qt, k32[:, c : c + KEY_CHUNK].transpose(1, 2)) * scale
            keys = torch.arange(c, c + KEY_CHUNK, device=q.device)
            scores.append(s.masked_fill(keys[None, None, :] > pt[None, :, None], float("-inf")))
        m = torch.stack([s.amax(-1) for s in scores]).amax(0)  # [Hq, tile]
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # padding rows: all masked
        denom = torch.zeros_like(m)
        acc = q32.new_zeros(hq, QUERY_TILE, dv)
        for c, s in zip(chunks, scores):
            e = torch.exp(s - m[..., None])
            denom = denom + e.sum(-1)
            acc = acc + torch.bmm(e, v32[:, c : c + KEY_CHUNK])
        outs.append(acc / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None])
    return torch.cat(outs, dim=1)[:, :nq].to(q.dtype)
