"""The fingerprint of `sync.wire.checksum` as Triton kernels (stage: sync; pure).

Same value as `checksum.fingerprint`'s torch path, bit for bit (tests check it on the GPU and in Triton's
interpreter on the CPU). Each program takes `BLOCK` words of one chunk of one tensor, makes the two lanes'
multipliers from the word's index in its chunk with splitmix64 in registers (the torch path reads them from a table:
16 bytes per 8-byte word), multiplies its two wrap-around sums by its chunk's fold power
P_l^(C-1-c) and adds them to its tensor's lanes atomically (wrap-around addition: any order, same bits).

Many tensors go in one launch (`lanes_many`): their words are addressed from one base pointer (the lowest address
of the group) plus a per-tensor offset, and a program finds its tensor by binary search over the tensors' first
block numbers. One weight sync of a 7B model is ~300 tensors; five launches per tensor (buffer, kernel, chunk sum,
fold, lane sum) cost more than reading the bytes. `copy_lanes_many` also copies each source into its
destination (the same words: casts stay with torch, whose rounding is the contract) while it hashes what it wrote:
a direct weight write and its checksums in one pass over the bytes. Whole blocks load without a mask, 16 bytes at
a time where every tensor is 16-byte aligned (`ALIGN`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 2048  # words (16 KiB) per program; divides checksum.CHUNK, so no program straddles two chunks
_META = tl.constexpr(5)  # per tensor: source offset, destination offset, words, first block, chunks


@triton.jit
def _splitmix64(x):
    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _many_lane_sums(
    src_ptr,
    dst_ptr,
    meta_ptr,
    first_ptr,
    pow_ptr,
    out_ptr,
    T,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
    ALIGN: tl.constexpr,
    COPY: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0  # the tensor: the last i with first[i] <= pid (first[T] = all blocks, first[0] = 0)
    hi = lo + T
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = tl.load(first_ptr + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    i = lo
    src_off = tl.multiple_of(tl.load(meta_ptr + _META * i), ALIGN)
    n = tl.load(meta_ptr + _META * i + 2)
    chunks = tl.load(meta_ptr + _META * i + 4)
    local = pid - tl.load(first_ptr + i)
    idx = local * BLOCK + tl.arange(0, BLOCK)
    if (local + 1) * BLOCK <= n:  # a whole block (all but a tensor's last): unmasked, so loads can be vectors
        y = tl.load(src_ptr + src_off + idx)
        if COPY:
            tl.store(dst_ptr + tl.multiple_of(tl.load(meta_ptr + _META * i + 1), ALIGN) + idx, y)
    else:
        mask = idx < n
        y = tl.load(src_ptr + src_off + idx, mask=mask, other=0)
        if COPY:
            tl.store(dst_ptr + tl.multiple_of(tl.load(meta_ptr + _META * i + 1), ALIGN) + idx, y, mask=mask)
    x = y.to(tl.uint64, bitcast=True)
    j = (idx % CHUNK).to(tl.uint64)
    s0 = tl.sum(x * (_splitmix64(j) | 1), axis=0)
    s1 = tl.sum(x * (_splitmix64(j + 4294967296) | 1), axis=0)
    k = chunks - 1 - (local * BLOCK) // CHUNK  # this chunk's fold power
    p0 = tl.load(pow_ptr + 2 * k).to(tl.uint64, bitcast=True)
    p1 = tl.load(pow_ptr + 2 * k + 1).to(tl.uint64, bitcast=True)
    tl.atomic_add(out_ptr + 2 * i, (s0 * p0).to(tl.int64, bitcast=True))
    tl.atomic_add(out_ptr + 2 * i + 1, (s1 * p1).to(tl.int64, bitcast=True))


def _base(ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int], bool] | None:
    """The lowest-addressed tensor, every tensor's element offset from it, and whether all are 16-byte aligned;
    None when some offset is not a whole number of elements (then no common base exists)."""
    base = min(ts, key=lambda t: t.data_ptr())
    size = base.element_size()
    gaps = [t.data_ptr() - base.data_ptr() for t in ts]
    if any(g % size for g in gaps):
        return None
    aligned = base.data_ptr() % 16 == 0 and all(g % 16 == 0 for g in gaps)
    return base, [g // size for g in gaps], aligned


def _launch(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor] | None, chunk: int, powers: torch.Tensor
) -> torch.Tensor | None:
    device = srcs[0].device
    live = [i for i, t in enumerate(srcs) if t.numel()]
    if not live:
        return torch.zeros(len(srcs), 2, dtype=torch.int64, device=device)
    src = _base([srcs[i] for i in live])
    dst = _base([dsts[i] for i in live]) if dsts is not None else src
    if src is None or dst is None:
        return None
    meta, first, blocks = [], [], 0
    for i, s_off, d_off in zip(live, src[1], dst[1]):
        n = srcs[i].numel()
        meta += [s_off, d_off, n, blocks, triton.cdiv(n, chunk)]
        first.append(blocks)
        blocks += triton.cdiv(n, BLOCK)
    table = torch.tensor(meta + first + [blocks], dtype=torch.int64).to(device, non_blocking=True)
    sums = torch.zeros(len(live), 2, dtype=torch.int64, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # launch where they live
        _many_lane_sums[(blocks,)](
            src[0],
            dst[0],
            table,
            table[len(meta) :],
            powers,
            sums,
            len(live),
            CHUNK=chunk,
            BLOCK=BLOCK,
            STEPS=max(1, len(live).bit_length()),
            ALIGN=2 if src[2] and dst[2] else 1,
            COPY=dsts is not None,
        )
    if len(live) == len(srcs):
        return sums
    out = torch.zeros(len(srcs), 2, dtype=torch.int64, device=device)
    out[torch.tensor(live, device=device)] = sums
    return out


def lanes_many(words: Sequence[torch.Tensor], chunk: int, powers: torch.Tensor) -> torch.Tensor | None:
    """The lanes, int64 [len(words), 2], of flat int64 word tensors (`checksum.words`) on one device, in one launch;
    `powers` is int64 [>= max chunks, 2] with row k = (P_0^k, P_1^k). None when they share no base pointer."""
    return _launch(words, None, chunk, powers)


def copy_lanes_many(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], chunk: int, powers: torch.Tensor
) -> torch.Tensor | None:
    """Copy each flat int64 word tensor of `srcs` into its destination (flat int64 words too: views of the
    tensors being written) and return the lanes of what was written; None (nothing written) when the tensors
    share no base pointer."""
    return _launch(srcs, dsts, chunk, powers)


def compile_for(arch: int, copy: bool, aligned: bool) -> Any:
    """`_many_lane_sums` compiled ahead of time for CUDA compute capability `arch` (x10, e.g. 90), no GPU needed
    (Triton's bundled ptxas): its `asm` holds the PTX and the cubin (tests check it compiles; sass_count.py counts
    its instructions)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = ("src_ptr", "dst_ptr", "meta_ptr", "first_ptr", "pow_ptr", "out_ptr")
    signature = {
        **dict.fromkeys(pointers, "*i64"),
        "T": "i32",
        **dict.fromkeys(("CHUNK", "BLOCK", "STEPS", "ALIGN", "COPY"), "constexpr"),
    }
    constants = {"CHUNK": 1 << 22, "BLOCK": BLOCK, "STEPS": 9, "ALIGN": 2 if aligned else 1, "COPY": copy}
    source = ASTSource(
        fn=_many_lane_sums,
        signature=signature,
        constexprs=constants,
        attrs={(i,): [["tt.divisibility", 16]] for i in range(len(pointers))},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))
