"""A skinny GEMM for decode steps: y [M, N] = x [M, K] @ W [N, K]^T with M (the decode batch) small.

Stage: engine (candidate for `DecodeForward`'s projections; `benchmarks/bench_decode_gemm.py` times it against
cuBLAS at the decode shapes). Imported only where Triton is installed; `torch.nn.functional.linear` is the reference.

At decode batch sizes a projection is bound by reading W once: program (n block, m block, k split) walks its share
of K in BLOCK_K steps and accumulates in float32. With one split it writes y; with several, each split writes a
float32 partial [SPLIT_K, M, N] and `_reduce_kernel` sums them in split order (deterministic, no atomics).

Invariants: K divisible by SPLIT_K * BLOCK_K (the wrapper checks); accumulation in float32; rows of y depend on
their own row of x only (no cross-row reduction), but the k order is the kernel's own, not cuBLAS's. NVIDIA only:
its default stages and tiles overflow an AMD CU's LDS (64 KB on gfx942), so CI's compile check builds it for
sm90/sm80 only (tests/triton_compile.py, NOT_BUILT_FOR).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(
    X,
    W,
    Y,
    P,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    K_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k0 = pid_k * K_SPLIT
    x_ptr = X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        x = tl.load(x_ptr, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptr, mask=mask_n[:, None], other=0.0)
        if IEEE:  # float32 inputs: no TF32
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(P + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _reduce_kernel(P, Y, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(P + m * N + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + (s * M + m) * N + offs, mask=mask, other=0.0)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 1,
    block_m: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (rows of x and w contiguous)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"skinny_linear needs x [M, K], w [N, K] with contiguous rows; got {x.shape}, {w.shape}")
    if k % (split_k * block_k):
        raise ValueError(f"K={k} is not a multiple of split_k * block_k = {split_k * block_k}")
    bm = block_m or max(16, min(64, triton.next_power_of_2(m)))
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    p = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, bm), split_k)
    _skinny_kernel[grid](
        x,
        w,
        y,
        p,
        m,
        n,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        K_SPLIT=k // split_k,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        IEEE=x.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(m, triton.cdiv(n, block))](p, y, m, n, y.stride(0), SPLIT_K=split_k, BLOCK=block, num_warps=4)
    return y
