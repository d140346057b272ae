"""The fingerprint of `sync.checksum` as one Triton kernel pass over a CUDA tensor (stage: sync; pure).

Same value as `checksum.fingerprint`'s torch path, bit for bit (a GPU test checks it): each program takes `BLOCK`
words of one chunk, makes the two lanes' multipliers from the word's index in its chunk with splitmix64 in
registers (the torch path reads them from a table: 16 bytes per word, 8x the bytes of a bf16 weight), and writes
its two wrap-around sums; torch adds the blocks of each chunk and folds the chunks with the lanes' multipliers.
One read of the tensor (the torch path, with its table and int64 temporaries, measured ~22 GB/s on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # divides checksum.CHUNK, so no program straddles two chunks


@triton.jit
def _splitmix64(x):
    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _lane_sums(w_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
    j = offs % CHUNK
    m0 = _splitmix64(j.to(tl.uint64)) | 1
    m1 = _splitmix64((j + 4294967296).to(tl.uint64)) | 1
    s0 = tl.sum(x * m0, axis=0)
    s1 = tl.sum(x * m1, axis=0)
    tl.store(out_ptr + 2 * pid, s0.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * pid + 1, s1.to(tl.int64, bitcast=True))


def chunk_sums(w: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-chunk lane sums, int64 [num_chunks, 2], of the flat integer tensor `w` (CUDA)."""
    n = w.numel()
    per_chunk = chunk // BLOCK
    blocks = triton.cdiv(n, BLOCK)
    chunks = triton.cdiv(n, chunk)
    partial = torch.zeros(chunks * per_chunk, 2, dtype=torch.int64, device=w.device)
    _lane_sums[(blocks,)](w, partial, n, CHUNK=chunk, BLOCK=BLOCK)
    return partial.view(chunks, per_chunk, 2).sum(dim=1)
