"""Triton paged-attention decode kernel: one query token per sequence against its paged K/V, no gather.

Stage: engine (`PagedAttention` calls `paged_decode` for the decode rows of a step; `DecodeForward` for whole
decode batches, inside CUDA graphs). Imported only where Triton is installed (the GPU machines); `reference`
in `decode_ops.py` is the torch formula it is tested against.

Layout: the cache of one layer viewed as [num_slots, kv_heads, head_dim] (`KVCache.flat`); token p of sequence i at
slot `block_tables[i, p // block_size] * block_size + p % block_size`; sequence i attends its first
`context_lens[i]` tokens (>= 1).

Kernel (split-K "flash decoding"): program (i, kv head, split) loads the query heads of that kv head (GQA group,
padded to 16 rows for `tl.dot`), walks its share of the context in tiles of BLOCK_N tokens (page ids from the
block table, then one 2-D load of K and of V), and keeps an online softmax in float32 (exp2 domain). With one
split it writes the output; with several it writes (partial output, log-sum-exp) and a second kernel combines
them. The grid depends only on the batch size and the split count, never on context lengths, so a launch is
replayable from a CUDA graph while the lengths change; an empty split (short context) writes lse = -inf.

Invariants: no host sync; reads only slots < context_lens of each row; accumulates in float32; float32 inputs use
IEEE `tl.dot` (no TF32), so a float32 engine matches the torch path closely.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


# Strides that differ between the graph path and the eager path (or step to step) are not specialised on, so both
# paths share the kernels compiled during graph capture instead of JIT-compiling mid-run.
# Long: one kernel (its loop state lives in registers; the formatter gives each of its arguments a line).
@triton.jit(do_not_specialize=["stride_qb", "stride_qh", "stride_tb"])
def _decode_stage1(
    Q,
    K,
    V,
    Tables,
    Lens,
    Out,
    MidO,
    MidLse,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    ctx = tl.load(Lens + b)
    per_split = tl.cdiv(ctx, SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = Tables + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        slot = page * PAGE + offs_n % PAGE
        kt = tl.load(
            K + slot[None, :] * stride_kt + kh * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
        v = tl.load(
            V + slot[:, None] * stride_vt + kh * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # p rounded as flash attention does
        m_i = m_new

    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if SPLITS == 1:
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(Out.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        # MidO [B, Hq, SPLITS, BLOCK_D], MidLse [B, Hq, SPLITS], both contiguous.
        row = (b * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split
        tl.store(MidO + row[:, None] * BLOCK_D + offs_d[None, :], o, mask=mask_h[:, None])
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(MidLse + row, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO,
    MidLse,
    Out,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (b * NUM_HEADS + h) * SPLITS + offs_s
    lse = tl.load(MidLse + row)  # split 0 is never empty (context >= 1), so the max is finite
    o = tl.load(MidO + row[:, None] * BLOCK_D + offs_d[None, :])
    w = tl.exp2(lse - tl.max(lse, 0))
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits of the context per (sequence, kv head): enough programs for one per SM, at most 16 (on an H200,
    batch 64 x 8 kv heads unsplit ran at 85% of copy bandwidth, split in two at 50%). A function of the batch size
    alone, so a captured graph keeps a valid split count as contexts grow."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-sms // max(1, batch * kv_heads))
    return min(16, triton.next_power_of_2(max(1, want)))


def tuned_tiles(batch: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) by batch size, from graph-replayed timings on an H200 at context 512
    (`benchmarks/bench_decode_attn.py`, Qwen3-0.6B heads): batch 256 ran at 98% of copy bandwidth with 32-token
    tiles and 2 warps (91% with the default 64 / 4 / 2), batch 64 at 87% with 64 / 2 / 3 (84%); at batch <= 16
    the knobs moved it by less than the spread. Other tiles sum the softmax in another order: bfloat16 outputs
    differ from the default tiles' by rounding (`EngineConfig.tuned_attention_tiles` opts in)."""
    if batch >= 128:
        return 32, 2, 2
    if batch >= 32:
        return 64, 2, 3
    return 64, 4, 2


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one query per row: q [N, Hq, D] (last dim contiguous), caches [slots, Hkv, D],
    block_tables int32 [N, >= max blocks], context_lens int32 [N] (>= 1) -> [N, Hq, D] in q's dtype.
    `num_splits`, `block_n`, `num_warps`, `num_stages` are tuning knobs (defaults: `default_splits`, 64, 4, 2;
    `tuned_tiles` gives faster tiles by batch size, which change the bfloat16 rounding)."""
    n, hq, d = q.shape
    block_n, num_warps, num_stages = (a or b for a, b in zip((block_n, num_warps, num_stages), (64, 4, 2)))
    hkv = k_cache.shape[1]
    if hq % hkv or q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("paged_decode needs Hq % Hkv == 0 and a contiguous head dim")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    group = hq // hkv
    splits = num_splits or default_splits(n, hkv, q.device)
    block_d = triton.next_power_of_2(d)
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    if splits > 1:
        mid_o = torch.empty((n, hq, splits, block_d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((n, hq, splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    _decode_stage1[(n, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        mid_o,
        mid_lse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        PAGE=block_size,
        BLOCK_N=block_n,
        SPLITS=splits,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _decode_stage2[(n, hq)](
            mid_o,
            mid_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=hq,
            HEAD_DIM=d,
            BLOCK_D=block_d,
            SPLITS=splits,
            num_warps=4,
        )
    return out
