"""The fingerprint of `sync.checksum` as one Triton kernel pass over a CUDA tensor (stage: sync; pure).

Same value as `checksum.fingerprint`'s torch path, bit for bit (a GPU test checks it): each program takes `BLOCK`
words of one chunk, reads both lanes' multiplier factors from the two small tables (`T` repeats every `SUB` words
and stays in cache; `U` changes every `SUB` words), multiplies in 32 bits, and writes its two sums; torch adds
the blocks of each chunk and folds the chunks with the lanes' multipliers. One read of the tensor, and per word
per lane two 32-bit multiplies and a 64-bit add (version 1 of the fingerprint made each multiplier with splitmix64
and multiplied in 64 bits: compute-bound at ~560 GB/s on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # divides checksum.CHUNK (no program straddles two chunks) and is a multiple of checksum.SUB


@triton.jit
def _lane_sums(w_ptr, t_ptr, u_ptr, out_ptr, n, MASK: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = (tl.load(w_ptr + offs, mask=valid, other=0).to(tl.int64) & MASK).to(tl.uint32)
    j = offs % CHUNK
    i = j % SUB
    b = j // SUB
    nu = CHUNK // SUB
    t0 = tl.load(t_ptr + i).to(tl.uint32, bitcast=True)
    t1 = tl.load(t_ptr + SUB + i).to(tl.uint32, bitcast=True)
    u0 = tl.load(u_ptr + b).to(tl.uint32, bitcast=True)
    u1 = tl.load(u_ptr + nu + b).to(tl.uint32, bitcast=True)
    s0 = tl.sum((x * (t0 * u0)).to(tl.uint64), axis=0)
    s1 = tl.sum((x * (t1 * u1)).to(tl.uint64), axis=0)
    tl.store(out_ptr + 2 * pid, s0.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * pid + 1, s1.to(tl.int64, bitcast=True))


def chunk_sums(w: torch.Tensor, chunk: int, t_table: torch.Tensor, u_table: torch.Tensor) -> torch.Tensor:
    """Per-chunk lane sums, int64 [num_chunks, 2], of the flat integer tensor `w` (CUDA); `t_table` int32
    [2, SUB] and `u_table` int32 [2, chunk // SUB] hold the factors' bit patterns (`checksum.factor_tables`)."""
    n = w.numel()
    sub = t_table.shape[1]
    per_chunk = chunk // BLOCK
    blocks = triton.cdiv(n, BLOCK)
    chunks = triton.cdiv(n, chunk)
    partial = torch.zeros(chunks * per_chunk, 2, dtype=torch.int64, device=w.device)
    mask = (1 << (8 * w.element_size())) - 1
    _lane_sums[(blocks,)](w, t_table, u_table, partial, n, MASK=mask, CHUNK=chunk, SUB=sub, BLOCK=BLOCK)
    return partial.view(chunks, per_chunk, 2).sum(dim=1)
