"""Bit-level codes of the weight-delta codec (stage: sync; pure torch/numpy, imports nothing of ours).

`delta_codec.py` states the format; this module holds its building blocks: an MSB-first bit stream built from
vectorised sections (`BitWriter`, `BitReader`), Rice codes with an escape for outliers (`rice_plans` then
`put_rice_planned`, `get_rice`), sets of ranks coded as Rice-coded gaps (`set_gaps`, `get_set`), and LEB128 varints
(`varints`, `Cursor`).

Invariants: every writer returns the counts its reader needs (they travel in the payload's `counts`, not in the bit
stream: with the escape counts they give every section's length), so each section decodes with vectorised ops,
never a sequential scan, and without waiting for the device; every reader raises `DeltaError` at once on counts
that do not fit, adds what only the bits can show to a `Checks` (read once by the caller) and clamps every index
it derives from the bits until then, so a corrupt stream raises `DeltaError`, never IndexError, a device fault or a
silent wrong value; every shift stays below 64 bits (`MAX_CODED_BITS`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "MAX_CODED_BITS",
    "Q_CAP",
    "BitReader",
    "BitWriter",
    "Checks",
    "Cursor",
    "DeltaError",
    "complement",
    "get_rice",
    "get_set",
    "put_rice_planned",
    "rice_plans",
    "set_gaps",
    "set_width",
    "varints",
]

Q_CAP = 32  # Rice quotients >= this are escaped to raw bits: one outlier gap costs ~W bits, not gap >> k
MAX_CODED_BITS = 62  # k and W stay below this, so every shift fits int64


class DeltaError(ValueError):
    """A payload that cannot be applied: corrupt, truncated, of another tensor, or made against another base."""


# ---------------------------------------------------------------- sets and Rice codes
def set_gaps(ranks: torch.Tensor, n: int) -> tuple[bool, torch.Tensor]:
    """A set of sorted distinct `ranks` in [0, n) as (inverted, gaps): the complement when it holds more than
    half of [0, n), then r_i - r_{i-1} - 1 with r_{-1} = -1. Written as [inverted, size] in the counts and the
    gaps' Rice code (`put_rice_planned`, width `set_width(n)`)."""
    inverted = 2 * ranks.numel() > n
    if inverted:
        ranks = complement(ranks, n)
    return inverted, torch.diff(ranks.long(), prepend=ranks.new_full((1,), -1).long()) - 1


def set_width(n: int) -> int:
    """Raw width of an escaped gap in a set out of n."""
    return max(1, n.bit_length())


def get_set(r: BitReader, c: Cursor, n: int, checks: Checks) -> torch.Tensor:
    """The ranks of a set coded as `set_gaps` describes (their number is known from the counts alone: no device
    wait)."""
    inverted, size = c.next(), c.next()
    if inverted > 1 or size > n:
        raise DeltaError(f"corrupt delta counts: set of {size} out of {n} (inverted={inverted})")
    ranks = torch.cumsum(get_rice(r, c, size, set_width(n), checks) + 1, 0) - 1
    if size:
        checks.add(ranks[-1] >= n, f"corrupt delta: a rank beyond {n}")
        ranks = ranks.clamp(max=n - 1)  # (memory-safe until the checks are read)
    if not inverted:
        return ranks
    keep = torch.ones(n, dtype=torch.bool, device=ranks.device)
    keep[ranks] = False
    checks.add(keep.sum() != n - size, f"corrupt delta: an inverted set of {size} out of {n} repeats a rank")
    return torch.nonzero_static(keep, size=n - size, fill_value=0).flatten()


def complement(ranks: torch.Tensor, n: int) -> torch.Tensor:
    keep = torch.ones(n, dtype=torch.bool, device=ranks.device)
    keep[ranks] = False
    return torch.nonzero(keep).flatten()


def rice_plans(vs: list[torch.Tensor], widths: list[int]) -> list[tuple[int, int, int]]:
    """(k, unary bits, escapes) of the cheapest Rice code of each of `vs` (non-negative), k searched around log2 of
    the mean (the exact coded length is unimodal in k): two device waits for all of them, not two per vector."""
    plans = [(0, 0, 0)] * len(vs)
    live = [i for i, v in enumerate(vs) if v.numel()]
    if not live:
        return plans
    sums = torch.stack([vs[i].sum(dtype=torch.int64) for i in live]).tolist()  # exact: any device, any order
    candidates, rows = [], []
    for i, total in zip(live, sums):
        # floor(log2(max(mean * ln 2, 1))) from correctly rounded operations (frexp is exact): the same on every CPU
        guess = max(0, math.frexp(max(total / vs[i].numel() * 0.6931471805599453, 1.0))[1] - 1)
        ks = list(range(max(0, guess - 2), min(guess + 3, MAX_CODED_BITS)))
        candidates.append(ks)
        for k in ks:
            q = vs[i] >> k
            esc = q >= Q_CAP
            rows.append(
                torch.stack(
                    [
                        torch.where(esc, Q_CAP + 1 + widths[i], q + 1 + k).sum(),
                        torch.where(esc, Q_CAP, q).sum(),
                        esc.sum(),
                    ]
                )
            )
    values = torch.stack(rows).tolist()
    at = 0
    for i, ks in zip(live, candidates):
        block = values[at : at + len(ks)]
        at += len(ks)
        j = min(range(len(ks)), key=lambda j: (block[j][0], j))  # least bits; the smaller k on a tie
        plans[i] = (ks[j], int(block[j][1]) + vs[i].numel(), int(block[j][2]))
    return plans


def put_rice_planned(w: BitWriter, v: torch.Tensor, width: int, plan: tuple[int, int, int]) -> list[int]:
    """Rice-code `v` with its plan from `rice_plans` (no device wait): [k, unary bits, escapes]."""
    k, qbits, n_esc = plan
    if v.numel() == 0:
        return [0, 0, 0]
    q = v >> k
    esc = q >= Q_CAP
    w.unary(torch.where(esc, Q_CAP, q), qbits)
    if n_esc:  # the kept values, then the escaped ones, each in order: a stable sort, not a boolean index's wait
        order = torch.argsort(esc.to(torch.uint8), stable=True)
        w.fixed(v[order[: v.numel() - n_esc]] & ((1 << k) - 1), k)
        w.fixed(v[order[v.numel() - n_esc :]], width)
    else:
        w.fixed(v & ((1 << k) - 1), k)
    return [k, qbits, n_esc]


def get_rice(r: BitReader, c: Cursor, n: int, width: int, checks: Checks) -> torch.Tensor:
    """The n values `put_rice_planned` wrote. The counts give every section's length ([k, unary bits, escapes]), so this
    reads without a device wait; what only the bits can show is added to `checks`, read once by the caller."""
    k, qbits, n_esc = c.next(), c.next(), c.next()
    if k > MAX_CODED_BITS or qbits < n or (n == 0 and qbits) or n_esc > n or width > MAX_CODED_BITS:
        raise DeltaError(f"corrupt delta counts: Rice k={k}, {qbits} unary bits, {n_esc} escapes for {n} values")
    unary, rem, raw = r.take(qbits), r.fixed(n - n_esc, k), r.fixed(n_esc, width)
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=r.device)
    ends = torch.nonzero_static(unary, size=n, fill_value=qbits - 1).flatten()  # the ones end the codes
    checks.add(unary.sum() != n, f"corrupt delta: a unary section of {qbits} bits does not hold {n} codes")
    checks.add(ends[-1] != qbits - 1, f"corrupt delta: bits after the last of {n} unary codes")
    q = (torch.diff(ends, prepend=ends.new_full((1,), -1)) - 1).clamp(min=0)
    esc = q >= Q_CAP
    checks.add(q.max() > Q_CAP, "corrupt delta: Rice quotient above the escape cap")
    checks.add(esc.sum() != n_esc, f"corrupt delta: {n_esc} escapes announced, the unary codes differ")
    v = q.clamp(max=Q_CAP) << k
    if n > n_esc:  # the kept values take the remainders in order, the escaped ones the raw values
        v = v | rem[(torch.cumsum(~esc, 0) - 1).clamp(0, n - n_esc - 1)]
    if n_esc:
        v = torch.where(esc, raw[(torch.cumsum(esc, 0) - 1).clamp(0, n_esc - 1)], v)
    return v


class Checks:
    """Validity conditions of a stream computed on the device and read in one wait (`raise_first`); until then
    every index derived from the stream is clamped, so a corrupt payload raises `DeltaError`, never faults."""

    def __init__(self) -> None:
        self.flags: list[torch.Tensor] = []
        self.messages: list[str] = []

    def add(self, bad: torch.Tensor, message: str) -> None:
        self.flags.append(bad.reshape(()).bool())
        self.messages.append(message)

    def raise_first(self) -> None:
        if self.flags:
            for bad, message in zip(torch.stack(self.flags).tolist(), self.messages):
                if bad:
                    raise DeltaError(message)


# ---------------------------------------------------------------- bits
class BitWriter:
    """MSB-first bit stream built from vectorised sections (0/1 uint8 tensors), packed once at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: list[torch.Tensor] = []

    def fixed(self, v: torch.Tensor, width: int) -> None:
        if width and v.numel():
            shifts = torch.arange(width - 1, -1, -1, device=v.device)
            self.parts.append(((v[:, None] >> shifts) & 1).to(torch.uint8).flatten())

    def unary(self, q: torch.Tensor, total: int | None = None) -> None:
        """q zeros then a one per value; `total` = sum(q) + len(q) when the caller has it (saves a device wait)."""
        total = int(q.sum()) + q.numel() if total is None else total
        bits = torch.zeros(total, dtype=torch.uint8, device=q.device)
        bits[torch.cumsum(q + 1, 0) - 1] = 1
        self.parts.append(bits)

    def getvalue(self) -> bytes:
        bits = torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.uint8, device=self.device)
        bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8).to(torch.int32)
        packed = (bits << torch.arange(7, -1, -1, device=bits.device, dtype=torch.int32)).sum(1).to(torch.uint8)
        if packed.is_cuda:  # through pinned memory: a pageable copy runs at a fraction of the link
            host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            torch.cuda.current_stream(packed.device).synchronize()
            packed = host
        return packed.numpy().tobytes()


class BitReader:
    def __init__(self, data: bytes, device: torch.device) -> None:
        self.device = device
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        raw = raw.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else raw.to(device)
        self.bits = ((raw[:, None] >> torch.arange(7, -1, -1, device=device, dtype=torch.uint8)) & 1).flatten()
        self.pos = 0

    def take(self, n: int) -> torch.Tensor:
        if self.pos + n > self.bits.numel():
            raise DeltaError(f"corrupt delta: body ends at bit {self.bits.numel()}, a section needs {self.pos + n}")
        self.pos += n
        return self.bits[self.pos - n : self.pos]

    def fixed(self, n: int, width: int) -> torch.Tensor:
        if width == 0:
            return torch.zeros(n, dtype=torch.int64, device=self.device)
        b = self.take(n * width).view(n, width).long()
        return (b << torch.arange(width - 1, -1, -1, device=self.device)).sum(1)

    def finish(self, checks: Checks) -> None:
        rest = self.bits[self.pos :]
        if rest.numel() >= 8:
            raise DeltaError(f"corrupt delta: {rest.numel()} bits left after the last section")
        checks.add(rest.any(), "corrupt delta: nonzero padding after the last section")


class Cursor:
    """Reads ints (from counts) or bytes/varints (from a frame), raising DeltaError past the end."""

    def __init__(self, buf: bytes | tuple[int, ...], pos: int) -> None:
        self.buf, self.pos = buf, pos

    def next(self) -> int:
        if self.pos >= len(self.buf):
            raise DeltaError(f"corrupt delta: counts end after {len(self.buf)} values")
        self.pos += 1
        return int(self.buf[self.pos - 1])

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise DeltaError(f"truncated delta payload: needs {self.pos + n} bytes, has {len(self.buf)}")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def varint(self) -> int:
        value = 0
        for shift in range(0, 70, 7):
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
        raise DeltaError("corrupt delta payload header: varint longer than 10 bytes")


def varints(values: tuple[int, ...] | list[int]) -> bytes:
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)
