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
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
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


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """An int64 view of a contiguous tensor holding a whole number of 8-byte-aligned words (a launch's base)."""
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return t.reshape(-1).view(torch.uint8).view(torch.int64)


def plan(
    sizes: Sequence[int],
    src_offs: Sequence[int],
    dst_offs: Sequence[int],
    chunk: int,
    block: int,
    rows: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A launch's chunk list for tensors of `sizes` words (all non-empty) at these word offsets: int64 entries
    [E, 5] (source offset, destination offset, words, output row (`rows[i]`, default i), fold power index),
    longest chunk first; per block b of positions ([b * block, (b + 1) * block)), how many entries hold all of it
    (whole) and some of it (reach); and the split (programs per position block)."""
    n = np.asarray(sizes, dtype=np.int64)
    chunks = -(-n // chunk)
    tensor = np.repeat(np.arange(len(n), dtype=np.int64), chunks)
    c = np.arange(int(chunks.sum()), dtype=np.int64) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    words = np.minimum(chunk, n[tensor] - c * chunk)
    order = np.argsort(-words, kind="stable")
    row = tensor if rows is None else np.asarray(rows, dtype=np.int64)[tensor]
    entries = np.stack(
        [
            np.asarray(src_offs, dtype=np.int64)[tensor] + c * chunk,
            np.asarray(dst_offs, dtype=np.int64)[tensor] + c * chunk,
            words,
            row,
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


def lanes_into(
    out: torch.Tensor,
    rows: Sequence[int],
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor] | None,
    chunk: int,
    powers: torch.Tensor,
) -> bool:
    """Add the lanes of each source's bytes (read as words) to ``out[rows[i]]`` (int64 [n, 2] on the sources'
    device, zeros to start; the rows distinct), in one launch; with `dsts`, first copy each source's bytes into
    its destination (same number of bytes). Tensors of any dtype, each contiguous, non-empty, starting 8-byte
    aligned and a whole number of words (`checksum.whole_words`): the kernel reads them in place from one base
    pointer, so the host work per tensor is a pointer and a size (no views). False, with nothing launched or
    written, when some tensor is not so, or `chunk` is not a multiple of the block; `powers` is int64
    [>= max chunks, 2] with row k = (P_0^k, P_1^k)."""
    if not srcs:
        return True
    if not all(t.is_contiguous() for t in srcs) or (dsts is not None and not all(t.is_contiguous() for t in dsts)):
        return False
    sp = [t.data_ptr() for t in srcs]
    nbytes = [t.nbytes for t in srcs]
    if dsts is not None and [t.nbytes for t in dsts] != nbytes:
        return False
    dp = None if dsts is None else [t.data_ptr() for t in dsts]
    return launch(out, rows, srcs, sp, nbytes, dsts, dp, chunk, powers)


@dataclass(frozen=True, slots=True)
class _Plan:
    """A launch's table on the device (entries, then whole, then reach) and its grid."""

    table: torch.Tensor
    whole: torch.Tensor
    reach: torch.Tensor
    grid: tuple[int, int]
    split: int


_plans: OrderedDict[tuple[Any, ...], _Plan] = OrderedDict()
PLANS = 64  # launches whose tables are kept on their device (a direct write repeats the same few every push)
_plans_lock = threading.Lock()


def launch(
    out: torch.Tensor,
    rows: Sequence[int],
    srcs: Sequence[torch.Tensor],
    sp: Sequence[int],
    nbytes: Sequence[int],
    dsts: Sequence[torch.Tensor] | None,
    dp: Sequence[int] | None,
    chunk: int,
    powers: torch.Tensor,
) -> bool:
    """`lanes_into` for callers that read the pointers (`sp`, `dp`) and sizes themselves and checked that every
    tensor is contiguous (and, with `dsts`, that each destination has its source's size). The launch's table is
    a function of the pointers, sizes and rows alone: it is kept on the device (`PLANS` of them, per stream), so
    a launch repeated with the same tensors (every push of a direct write, every verify of an engine) costs no
    planning and no copy to the device."""
    if not srcs:
        return True
    block = min(BLOCK, chunk)
    dp = sp if dp is None else dp
    if chunk % block or any(p % 8 for p in sp) or any(p % 8 for p in dp) or any(n % 8 or not n for n in nbytes):
        return False
    s0 = min(range(len(sp)), key=sp.__getitem__)
    d0 = min(range(len(dp)), key=dp.__getitem__)
    device = srcs[0].device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, chunk, block, ROWS, PROGRAMS, MIN_CHUNKS, tuple(sp), tuple(dp), tuple(nbytes), tuple(rows))
    with _plans_lock:
        p = _plans.get(key)
        if p is not None:
            _plans.move_to_end(key)
    if p is None:
        src_base, dst_base = sp[s0], dp[d0]
        entries, whole, reach, split = plan(
            [n // 8 for n in nbytes],
            [(a - src_base) // 8 for a in sp],
            [(a - dst_base) // 8 for a in dp],
            chunk,
            block,
            rows,
        )
        host = torch.from_numpy(np.concatenate([entries.reshape(-1), whole, reach]))
        # from pinned memory: a copy from pageable memory waits for the stream (the batches of a direct write,
        # each one launch, would run one after the other with the host's work between them)
        table = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
        p = _Plan(table, table[entries.size :], table[entries.size + len(whole) :], (len(reach), split), split)
        with _plans_lock:
            _plans[key] = p
            while len(_plans) > PLANS:
                _plans.popitem(last=False)
    aligned = all(a % 16 == 0 for a in sp) and all(a % 16 == 0 for a in dp)
    src_words = _as_words(srcs[s0])
    dst_words = src_words if dsts is None else _as_words(dsts[d0])
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # launch where they live
        _lane_sums_by_position[p.grid](
            src_words,
            dst_words,
            p.table,
            p.whole,
            p.reach,
            powers,
            out,
            p.split,
            BLOCK=block,
            ROWS=ROWS,
            PREFETCH=PREFETCH,
            ALIGN=2 if aligned else 1,
            COPY=dsts is not None,
            num_warps=WARPS,
        )
    return True


def lanes_many(words: Sequence[torch.Tensor], chunk: int, powers: torch.Tensor) -> torch.Tensor | None:
    """The lanes, int64 [len(words), 2], of flat int64 word tensors (`checksum.words`) on one device, in one launch
    (`lanes_into`); None when some is not 8-byte aligned."""
    return _many(words, None, chunk, powers)


def copy_lanes_many(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], chunk: int, powers: torch.Tensor
) -> torch.Tensor | None:
    """Copy each flat int64 word tensor of `srcs` into its destination (flat int64 words too: views of the
    tensors being written) and return the lanes of what was written; None (nothing written) when some is not
    8-byte aligned."""
    return _many(srcs, dsts, chunk, powers)


def _many(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor] | None, chunk: int, powers: torch.Tensor
) -> torch.Tensor | None:
    out = torch.zeros(len(srcs), 2, dtype=torch.int64, device=srcs[0].device if srcs else None)
    live = [i for i, t in enumerate(srcs) if t.numel()]
    pick = [srcs[i] for i in live]
    ok = lanes_into(out, live, pick, None if dsts is None else [dsts[i] for i in live], chunk, powers)
    return out if ok else None


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
