"""The fingerprint of `sync.wire.checksum` as Triton kernels (stage: sync; pure).

Same value as `checksum.fingerprint`'s torch path, bit for bit (tests check it on the GPU and in Triton's
interpreter on the CPU). The work is laid out by position in the chunk, not by address: the multipliers m_l[j]
depend on a word's index j in its chunk alone, so a program owns one block of `BLOCK` positions j, makes their two
lanes' multipliers once with splitmix64 in registers, and then walks a list of chunks (of any of the tensors),
loading the block of words at those positions in each, multiplying, summing, and adding each chunk's two sums,
times that chunk's fold power P_l^(C-1-c), to its tensor's lanes atomically (wrap-around addition: any order, same
bits). Per word that leaves a load, two 64-bit products and their sums: the splitmix64 rounds (four 64-bit
products and the shifts, ~70 of the ~80 instructions per word of a kernel that made them per word) are paid once
per program, not per word, so the pass runs at the speed of the memory rather than of the integer units.

The chunks of a launch (every tensor's, from one base pointer plus per-tensor offsets) are listed longest first,
so the chunks that reach position block b are a prefix of the list (its length per block is a table); the programs
of block b split that prefix in `split` equal parts (enough programs to fill the GPU, each with enough chunks to pay
for its multipliers). One weight sync of a 7B model is ~300 tensors in one launch (per-tensor launches cost more
than reading the bytes). `copy_lanes_many` also copies each source into its destination (the same words: casts
stay with torch, whose rounding is the contract) while it hashes what it wrote: a direct weight write and its
checksums in one pass over the bytes. Whole blocks load without a mask, 16 bytes at a time where every tensor is
16-byte aligned (`ALIGN`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 2048  # positions (words) per program; a power of two, at most the chunk (which it then divides)
WARPS = 4  # warps per program
ROWS = 1  # chunks per step of a program (their loads in flight together)
PREFETCH = True  # each step's loads issued before the previous step's sums
PROGRAMS = 8192  # about how many programs a large launch is spread over (each position block's chunks split so)
MIN_CHUNKS = 4  # ... but no program gets fewer chunks than this (each makes its block's multipliers once)
_ENTRY = tl.constexpr(5)  # per chunk: source offset, destination offset, words, tensor, fold power index


@triton.jit
def _splitmix64(x):
    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _lane_sums_by_position(
    src_ptr,
    dst_ptr,
    entry_ptr,
    whole_ptr,
    reach_ptr,
    pow_ptr,
    out_ptr,
    split,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
    ALIGN: tl.constexpr,
    COPY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # this program's block of positions in a chunk
    part = tl.program_id(1).to(tl.int64)
    whole = tl.load(whole_ptr + b)  # chunks (the first listed) holding all these positions
    reach = tl.load(reach_ptr + b)  # chunks holding some of them (the next ones end inside the block)
    j = b * BLOCK + tl.arange(0, BLOCK)
    ju = j.to(tl.uint64)
    m0 = (_splitmix64(ju) | 1)[None, :]
    m1 = (_splitmix64(ju + 4294967296) | 1)[None, :]
    rows = tl.arange(0, ROWS).to(tl.int64)
    # whole blocks, ROWS chunks at a time: unmasked along the row, so loads and stores can be vectors; with
    # PREFETCH the next step's loads are issued before this step's sums (its data in flight meanwhile)
    first = whole * part // split
    last = whole * (part + 1) // split
    if PREFETCH:
        ok = first + rows < last
        src_off = tl.multiple_of(tl.load(entry_ptr + _ENTRY * (first + rows), mask=ok, other=0), ALIGN)
        y = tl.load(src_ptr + src_off[:, None] + j[None, :], mask=ok[:, None], other=0)
        for e0 in range(first, last, ROWS):
            e = e0 + rows
            ok = e < last
            ahead = e + ROWS < last
            src_off = tl.multiple_of(tl.load(entry_ptr + _ENTRY * (e + ROWS), mask=ahead, other=0), ALIGN)
            y_next = tl.load(src_ptr + src_off[:, None] + j[None, :], mask=ahead[:, None], other=0)
            if COPY:
                dst_off = tl.multiple_of(tl.load(entry_ptr + _ENTRY * e + 1, mask=ok, other=0), ALIGN)
                tl.store(dst_ptr + dst_off[:, None] + j[None, :], y, mask=ok[:, None])
            x = y.to(tl.uint64, bitcast=True)
            _add_lanes(entry_ptr, pow_ptr, out_ptr, e, ok, tl.sum(x * m0, axis=1), tl.sum(x * m1, axis=1))
            y = y_next
    else:
        for e0 in range(first, last, ROWS):
            e = e0 + rows
            ok = e < last
            src_off = tl.multiple_of(tl.load(entry_ptr + _ENTRY * e, mask=ok, other=0), ALIGN)
            y = tl.load(src_ptr + src_off[:, None] + j[None, :], mask=ok[:, None], other=0)
            if COPY:
                dst_off = tl.multiple_of(tl.load(entry_ptr + _ENTRY * e + 1, mask=ok, other=0), ALIGN)
                tl.store(dst_ptr + dst_off[:, None] + j[None, :], y, mask=ok[:, None])
            x = y.to(tl.uint64, bitcast=True)
            _add_lanes(entry_ptr, pow_ptr, out_ptr, e, ok, tl.sum(x * m0, axis=1), tl.sum(x * m1, axis=1))
    # chunks that end inside the block: masked by position, one at a time (a few per block)
    first = whole + (reach - whole) * part // split
    last = whole + (reach - whole) * (part + 1) // split
    for f in range(first, last):
        n = tl.load(entry_ptr + _ENTRY * f + 2)
        keep = j < n
        z = tl.load(src_ptr + tl.load(entry_ptr + _ENTRY * f) + j, mask=keep, other=0)
        if COPY:
            tl.store(dst_ptr + tl.load(entry_ptr + _ENTRY * f + 1) + j, z, mask=keep)
        xz = z.to(tl.uint64, bitcast=True)[None, :]
        one = f + tl.zeros([1], dtype=tl.int64)
        _add_lanes(entry_ptr, pow_ptr, out_ptr, one, one >= 0, tl.sum(xz * m0, axis=1), tl.sum(xz * m1, axis=1))


@triton.jit
def _add_lanes(entry_ptr, pow_ptr, out_ptr, e, ok, s0, s1):
    """Add the chunk sums `s0`, `s1` of entries `e` (where `ok`), times their fold powers, to their tensors' lanes."""
    i = tl.load(entry_ptr + _ENTRY * e + 3, mask=ok, other=0)
    k = tl.load(entry_ptr + _ENTRY * e + 4, mask=ok, other=0)
    p0 = tl.load(pow_ptr + 2 * k, mask=ok, other=0).to(tl.uint64, bitcast=True)
    p1 = tl.load(pow_ptr + 2 * k + 1, mask=ok, other=0).to(tl.uint64, bitcast=True)
    tl.atomic_add(out_ptr + 2 * i, (s0 * p0).to(tl.int64, bitcast=True), mask=ok, sem="relaxed")
    tl.atomic_add(out_ptr + 2 * i + 1, (s1 * p1).to(tl.int64, bitcast=True), mask=ok, sem="relaxed")


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


def plan(
    sizes: Sequence[int], src_offs: Sequence[int], dst_offs: Sequence[int], chunk: int, block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A launch's chunk list for tensors of `sizes` words (all non-empty) at these word offsets: int64 entries
    [E, 5] (source offset, destination offset, words, tensor, fold power index), longest chunk first; per block b
    of positions ([b * block, (b + 1) * block)), how many entries hold all of it (whole) and some of it (reach);
    and the split (programs per position block)."""
    n = np.asarray(sizes, dtype=np.int64)
    chunks = -(-n // chunk)
    tensor = np.repeat(np.arange(len(n), dtype=np.int64), chunks)
    c = np.arange(int(chunks.sum()), dtype=np.int64) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    words = np.minimum(chunk, n[tensor] - c * chunk)
    order = np.argsort(-words, kind="stable")
    entries = np.stack(
        [
            np.asarray(src_offs, dtype=np.int64)[tensor] + c * chunk,
            np.asarray(dst_offs, dtype=np.int64)[tensor] + c * chunk,
            words,
            tensor,
            chunks[tensor] - 1 - c,
        ],
        axis=1,
    )[order]
    starts = np.arange(-(-int(words.max()) // block), dtype=np.int64) * block
    desc = -entries[:, 2]  # ascending
    whole = np.searchsorted(desc, -(starts + block), side="right")  # words >= (b + 1) * block
    reach = np.searchsorted(desc, -starts, side="left")  # words > b * block
    split = max(1, min(-(-PROGRAMS // len(starts)), int(reach[0]) // (MIN_CHUNKS * ROWS) or 1))
    return np.ascontiguousarray(entries), whole, reach, split


def _launch(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor] | None, chunk: int, powers: torch.Tensor
) -> torch.Tensor | None:
    device = srcs[0].device
    live = [i for i, t in enumerate(srcs) if t.numel()]
    if not live:
        return torch.zeros(len(srcs), 2, dtype=torch.int64, device=device)
    block = min(BLOCK, chunk)
    if chunk % block:
        return None
    src = _base([srcs[i] for i in live])
    dst = _base([dsts[i] for i in live]) if dsts is not None else src
    if src is None or dst is None:
        return None
    entries, whole, reach, split = plan([srcs[i].numel() for i in live], src[1], dst[1], chunk, block)
    host = torch.from_numpy(np.concatenate([entries.reshape(-1), whole, reach]))
    # from pinned memory: a copy from pageable memory waits for the stream (the batches of a direct write, each
    # one launch, would run one after the other with the host's work between them instead of overlapping it)
    table = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    sums = torch.zeros(len(live), 2, dtype=torch.int64, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # launch where they live
        _lane_sums_by_position[(len(reach), split)](
            src[0],
            dst[0],
            table,
            table[entries.size :],
            table[entries.size + len(whole) :],
            powers,
            sums,
            split,
            BLOCK=block,
            ROWS=ROWS,
            PREFETCH=PREFETCH,
            ALIGN=2 if src[2] and dst[2] else 1,
            COPY=dsts is not None,
            num_warps=WARPS,
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
    """`_lane_sums_by_position` compiled ahead of time for CUDA compute capability `arch` (x10, e.g. 90), no GPU
    needed (Triton's bundled ptxas): its `asm` holds the PTX and the cubin (tests check it compiles;
    sass_count.py counts its instructions)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = ("src_ptr", "dst_ptr", "entry_ptr", "whole_ptr", "reach_ptr", "pow_ptr", "out_ptr")
    signature = {
        **dict.fromkeys(pointers, "*i64"),
        "split": "i32",
        **dict.fromkeys(("BLOCK", "ROWS", "PREFETCH", "ALIGN", "COPY"), "constexpr"),
    }
    constants = {"BLOCK": BLOCK, "ROWS": ROWS, "PREFETCH": PREFETCH, "ALIGN": 2 if aligned else 1, "COPY": copy}
    source = ASTSource(
        fn=_lane_sums_by_position,
        signature=signature,
        constexprs=constants,
        attrs={(i,): [["tt.divisibility", 16]] for i in range(len(pointers))},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": WARPS})
