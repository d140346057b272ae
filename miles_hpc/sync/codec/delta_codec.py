"""Weight-delta codec of the "delta" sync strategy: which rollout-dtype values changed since the last publish, and how.

Stage: sync (pure: imports only `sync.wire.checksum` and `sync.codec.bitcodes`, which import nothing of ours, so the engine
may import this too).
Invariants: `decode(old, encode(old, new))` has exactly the bits of `new` (NaN payloads, infinities, -0.0 and
subnormals included) or raises `DeltaError`; `decode` verifies `tensor_checksum` of its result; a payload is never
larger than the raw tensor plus the framing ("full" is sent instead). Element-wise work is vectorised torch on the
tensors' device, plus three Triton kernels on CUDA that lay the classes out without a sort (`delta_kernels.py`; the
CPU sorts, and a GPU test checks both make the same payload); Python loops run only over context classes (at most
`max_classes`) and code sections. Code many tensors as one payload (their concatenation) where per-call costs
matter: a GPU call costs ~10 ms of fixed overhead (device waits, launches), whatever the size.

Model. A 2-byte (bfloat16, float16) or 4-byte (float32) pattern u maps to the order-preserving integer
    key(u) = u XOR (sign bit of u set ? 0xFFFF : 0x8000)        (0xFFFFFFFF / 0x80000000 for 32-bit patterns),
a bijection under which -0.0 and +0.0 are neighbours and NaNs sit at both ends. The "ulp difference" of an element
is d = key(new) - key(old), nonzero exactly where the bits differ. After a small AdamW step ~1-3% of bf16 values
change, mostly by d = +-1. The smaller |w|, the finer its ulp and the likelier a step changes it; the decoder knows
`old`, so elements are split into context classes by the exponent field of `old` and each class is coded on its own
(this beats the order-0 entropy of the update). The classes, contiguous exponent ranges, are chosen by dynamic
programming over per-exponent histograms, minimising the estimated coded size plus a per-class header cost.

Codes (their building blocks live in `bitcodes.py`). One MSB-first bit stream; per class, in ascending exponent
order:
  1. positions: the ranks, among the class's elements in flat index order, of the changed ones, as a *set*;
  2. signs: one bit per changed element (1: d < 0), in the same order;
  3. escapes: the ranks, among the class's changed elements, of those with |d| > 1, as a *set*;
  4. magnitudes: |d| - 2 of each escape, Rice-coded.
A *set* of s ranks out of n is coded as its complement when s > n / 2 ("inverted"), then as gaps r_i - r_{i-1} - 1
(r_{-1} = -1) in Rice codes, within a few percent of the entropy of geometric gaps. A Rice code with parameter k
splits v into q = v >> k and k low bits, in separate sections so that both decode without a sequential scan: a
*unary section* (q zeros then a one per value: its ones are the value boundaries), the k-bit remainders, then W-bit
raw values of the escaped ones (q >= 32 is written as 32 zeros and a one, no remainder; W = bit length of n for gaps,
the dtype width for magnitudes). k minimises the exact coded length.

Counts (`DeltaPayload.counts`): [C, low_1 .. low_{C-1}] (class c covers exponent fields [low_c, low_{c+1}), low_0 =
0), then per class: positions (inverted, s, k, unary bits, escaped), escapes (inverted, s, k, unary bits, escaped),
magnitudes (k, unary bits, escaped). With the escaped counts every section's length is known before any bit is
read, so the decoder reads the whole stream without waiting for the device (one wait at the end for its checks).
The body is the bit stream, zero-padded to whole bytes.

Framing (`to_bytes`; integers are unsigned LEB128 varints unless sized):
    b"MHWD" | u8 version=3 | u8 kind (0 same, 1 delta, 2 full) | u8 dtype (1 bfloat16, 2 float16, 3 float32)
    | varint ndim | varint dim * ndim | u8 checksum length | checksum digest bytes
    | varint len(counts) | varint count * len(counts) | varint len(body) | body | u32 LE CRC-32 of all before it
"full" bodies are the little-endian bytes of `new`; "same" bodies are empty.
"""

from __future__ import annotations

import itertools
import math
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from miles_hpc.sync.codec import bitcodes as bc
from miles_hpc.sync.codec.bitcodes import DeltaError
from miles_hpc.sync.wire.checksum import tensor_checksum

__all__ = ["DeltaError", "DeltaPayload", "decode", "encode", "encode_full", "from_bytes", "to_bytes", "warm_kernels"]

Kind = Literal["same", "delta", "full"]
_KINDS: tuple[Kind, ...] = ("same", "delta", "full")
MAGIC = b"MHWD"
VERSION = 3  # 3: escape counts in the counts; 2: ranks within a class in flat index order (1: by exponent first)
_CLASS_HEADER_BITS = 96.0  # the DP's price of one more class: ~10 varints of counts
_PARTITION_SAMPLE = 1 << 22  # elements whose exponents estimate the class sizes for the partition


@dataclass(frozen=True, slots=True)
class _Spec:
    dtype: torch.dtype
    bits: torch.dtype  # the same-width signed integer view
    width: int  # bits per value
    exp_shift: int  # exponent field = (bits >> exp_shift) & (n_exp - 1)
    n_exp: int
    code: int  # dtype byte of the framing


_SPECS: dict[str, _Spec] = {
    "bfloat16": _Spec(torch.bfloat16, torch.int16, 16, 7, 256, 1),
    "float16": _Spec(torch.float16, torch.int16, 16, 10, 32, 2),
    "float32": _Spec(torch.float32, torch.int32, 32, 23, 256, 3),
}
_BY_CODE = {s.code: name for name, s in _SPECS.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaPayload:
    """One tensor's update: "same" (no change), "delta" (coded changes) or "full" (raw bytes of the new tensor)."""

    kind: Kind
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    data: bytes  # "delta": the coded bit stream; "full": little-endian bytes of the new tensor; "same": empty
    counts: tuple[int, ...] = ()  # "delta" only: class bounds and per-class code parameters (module docstring)
    checksum: str  # `tensor_checksum` of the new tensor; `decode` verifies its result against it

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise DeltaError(f"unknown payload kind {self.kind!r}; expected one of {_KINDS}")
        if self.dtype not in _SPECS:
            raise DeltaError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(_SPECS)}")
        if any(not isinstance(s, int) or s < 0 for s in self.shape):
            raise DeltaError(f"bad shape {self.shape!r}")
        if any(not isinstance(c, int) or c < 0 for c in self.counts):
            raise DeltaError("counts must be non-negative ints")
        try:
            bytes.fromhex(self.checksum)
        except ValueError:
            raise DeltaError(f"checksum {self.checksum!r} is not hex") from None

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the new tensor itself (what a full send carries)."""
        return math.prod(self.shape) * _SPECS[self.dtype].width // 8


# ---------------------------------------------------------------- public API
def encode(old: torch.Tensor, new: torch.Tensor, *, max_classes: int = 8) -> DeltaPayload:
    """Code `new` against `old` (same shape and dtype, any device); `max_classes` bounds the context classes."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise DeltaError(f"old {old.dtype} {tuple(old.shape)} and new {new.dtype} {tuple(new.shape)} differ")
    name = str(new.dtype).removeprefix("torch.")
    if name not in _SPECS:
        raise DeltaError(f"unsupported dtype {name!r}; supported: {', '.join(_SPECS)}")
    spec = _SPECS[name]
    head = {"dtype": name, "shape": tuple(new.shape), "checksum": tensor_checksum(new)}
    ob, nb = _flat_bits(old, spec), _flat_bits(new, spec)
    idx = torch.nonzero(ob != nb).flatten()
    if idx.numel() == 0:
        return DeltaPayload(kind="same", data=b"", **head)
    coded = _encode_changes(ob, nb, idx, spec, max_classes)
    if coded is None or len(coded[0]) + len(bc.varints(coded[1])) >= nb.numel() * spec.width // 8:
        return DeltaPayload(kind="full", data=_raw_bytes(nb), **head)
    return DeltaPayload(kind="delta", data=coded[0], counts=coded[1], **head)


def encode_full(new: torch.Tensor, checksum: str | None = None) -> DeltaPayload:
    """A "full" payload of `new` (no base needed: `decode` checks only the shape and dtype of its `old`).
    `checksum`: `tensor_checksum(new)` when the caller already has it (it is not recomputed)."""
    name = str(new.dtype).removeprefix("torch.")
    if name not in _SPECS:
        raise DeltaError(f"unsupported dtype {name!r}; supported: {', '.join(_SPECS)}")
    nb = _flat_bits(new, _SPECS[name])
    return DeltaPayload(
        kind="full", dtype=name, shape=tuple(new.shape), data=_raw_bytes(nb), checksum=checksum or tensor_checksum(new)
    )


def decode(old: torch.Tensor, payload: DeltaPayload, *, verify: bool = True) -> torch.Tensor:
    """The new tensor (on `old`'s device), bit-exact; `DeltaError` on any mismatch, malformed stream or bad checksum
    (`verify=False`: the caller checks the result itself, e.g. a group's tensors one by one against theirs)."""
    spec = _SPECS[payload.dtype]
    if old.dtype != spec.dtype or tuple(old.shape) != payload.shape:
        raise DeltaError(f"payload is for {payload.dtype} {payload.shape}, but old is {old.dtype} {tuple(old.shape)}")
    ob = _flat_bits(old, spec)
    if payload.kind == "same":
        if payload.data or payload.counts:
            raise DeltaError("a 'same' payload carries no data")
        out_bits = ob.clone()
    elif payload.kind == "full":
        out_bits = _from_raw(payload.data, spec, ob.numel(), old.device)
    else:
        out_bits = _decode_changes(ob, payload.data, payload.counts, spec)
    out = out_bits.view(spec.dtype).reshape(payload.shape)
    if not verify:
        return out
    got = tensor_checksum(out)
    if got != payload.checksum:
        raise DeltaError(
            f"checksum mismatch after applying a {payload.kind!r} payload: got {got}, expected {payload.checksum} "
            "(corrupt payload, or `old` is not the tensor the delta was made against)"
        )
    return out


def warm_kernels(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, max_classes: int = 8) -> None:
    """Compile the CUDA kernels for every class count up to `max_classes` now (a no-op elsewhere), so that the
    first updates (and benchmarks) do not pay Triton's compile time."""
    spec = _SPECS[str(dtype).removeprefix("torch.")]
    probe = torch.zeros(4096, dtype=spec.bits, device=device)
    kern = _kernels(probe)
    if kern is None:
        return
    for c in range(4, max_classes + 4, 4):
        lows = kern.padded_lows(list(range(1, c)), spec.n_exp, probe.device)
        kern.class_ranks(probe, probe + 1, lows, spec.width, spec.exp_shift, spec.n_exp)
        _, cnt = kern.class_sizes(probe, lows, spec.exp_shift, spec.n_exp)
        kern.apply_dense(
            probe,
            lows,
            cnt,
            torch.zeros(probe.numel(), dtype=torch.int32 if spec.width == 16 else torch.int64, device=probe.device),
            spec.width,
            spec.exp_shift,
            spec.n_exp,
        )


def to_bytes(payload: DeltaPayload) -> bytes:
    """Self-describing framing of a payload for files and the wire (module docstring)."""
    digest = bytes.fromhex(payload.checksum)
    head = bytearray(MAGIC)
    head += bytes([VERSION, _KINDS.index(payload.kind), _SPECS[payload.dtype].code])
    head += bc.varints((len(payload.shape), *payload.shape))
    head += bytes([len(digest)]) + digest
    head += bc.varints((len(payload.counts), *payload.counts, len(payload.data)))
    frame = bytes(head) + payload.data
    return frame + zlib.crc32(frame).to_bytes(4, "little")


def from_bytes(b: bytes) -> DeltaPayload:
    """Parse `to_bytes` output; `DeltaError` names what is wrong with corrupt or truncated input."""
    b = bytes(b)
    if len(b) < len(MAGIC) + 3:
        raise DeltaError(f"truncated delta payload: {len(b)} bytes")
    if b[:4] != MAGIC:
        raise DeltaError(f"not a delta payload: magic {b[:4]!r}, expected {MAGIC!r}")
    if b[4] != VERSION:
        raise DeltaError(f"unsupported delta payload version {b[4]} (this reader knows {VERSION})")
    if b[5] >= len(_KINDS) or b[6] not in _BY_CODE:
        raise DeltaError(f"corrupt delta payload header: kind byte {b[5]}, dtype byte {b[6]}")
    cur = bc.Cursor(b, 7)
    ndim = cur.varint()
    if ndim > 64:
        raise DeltaError(f"corrupt delta payload header: {ndim} dimensions")
    shape = tuple(cur.varint() for _ in range(ndim))
    digest = cur.take(cur.take(1)[0])
    n_counts = cur.varint()
    if n_counts > len(b):
        raise DeltaError(f"corrupt delta payload header: {n_counts} counts in {len(b)} bytes")
    counts = tuple(cur.varint() for _ in range(n_counts))
    body = cur.take(cur.varint())
    if len(b) - cur.pos < 4:
        raise DeltaError(f"truncated delta payload: {len(b) - cur.pos} of the 4 CRC bytes after the body")
    if len(b) - cur.pos > 4:
        raise DeltaError(f"delta payload has {len(b) - cur.pos - 4} bytes after its body, expected none")
    if zlib.crc32(b[: cur.pos]) != int.from_bytes(b[cur.pos :], "little"):
        raise DeltaError("delta payload CRC-32 mismatch: the bytes are corrupt")
    payload = DeltaPayload(
        kind=_KINDS[b[5]], dtype=_BY_CODE[b[6]], shape=shape, data=body, counts=counts, checksum=digest.hex()
    )
    if payload.kind == "full" and len(body) != payload.raw_nbytes:
        raise DeltaError(f"'full' payload has {len(body)} bytes, shape {shape} needs {payload.raw_nbytes}")
    return payload


# ---------------------------------------------------------------- delta coding
def _encode_changes(
    ob: torch.Tensor, nb: torch.Tensor, idx: torch.Tensor, spec: _Spec, max_classes: int
) -> tuple[bytes, tuple[int, ...]] | None:
    """(body, counts) of the changes at flat indices `idx`, or None when the estimate already exceeds raw size."""
    d = _keys(nb[idx], spec) - _keys(ob[idx], spec)
    mag = d.abs()
    exp_chg = _exponents(ob[idx], spec)
    esc = mag > 1

    def hist(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        return torch.bincount(x, weights=w, minlength=spec.n_exp).double()

    # The partition is a choice of the encoder (the decoder reads it from the counts): an estimate from a
    # strided sample of the unchanged elements' exponents is enough, and on large tensors much cheaper.
    stride = max(1, ob.numel() // _PARTITION_SAMPLE)
    n_e = hist(_exponents(ob[::stride], spec)) * stride
    stats = torch.stack([n_e, hist(exp_chg), hist(exp_chg[esc]), hist(exp_chg[esc], (mag[esc] - 2).double())])
    n_e, k_e, x_e, s_e = stats.cpu().numpy()
    lows, est_bits = _partition(n_e, k_e, x_e, s_e, max_classes)
    if est_bits >= ob.numel() * spec.width:
        return None  # dense and wide changes: a full send wins, skip emitting the bits
    n_classes = len(lows) + 1
    counts = [n_classes, *lows]
    w = bc.BitWriter(ob.device)
    if n_classes == 1:  # ranks are flat indices
        n_c, k_c, all_ranks = np.array([ob.numel()]), np.array([idx.numel()]), idx
    elif (kern := _kernels(ob)) is not None:  # class-major ranks and differences without a sort (delta_kernels.py)
        lows_t = kern.padded_lows(lows, spec.n_exp, ob.device)
        all_ranks, d, n_t, k_t = kern.class_ranks(ob, nb, lows_t, spec.width, spec.exp_shift, spec.n_exp)
        n_c, k_c = torch.stack([n_t, k_t])[:, :n_classes].cpu().numpy()
    else:
        # One stable sort by class lays every class out contiguously, each in flat index order: a class's changed
        # ranks are the nonzeros of its slice of the sorted change mask, and a stable sort of the changes by class
        # puts their differences in the same order. (Cost independent of the number of classes.)
        cls = _class_ids(_exponents(ob, spec), lows)
        changed_sorted = (ob != nb)[torch.argsort(cls, stable=True)]
        cls_chg = cls[idx]
        d = d[torch.argsort(cls_chg, stable=True)]
        n_c = torch.bincount(cls, minlength=n_classes).cpu().numpy()
        k_c = torch.bincount(cls_chg, minlength=n_classes).cpu().numpy()
        starts = np.concatenate([[0], np.cumsum(n_c)])
        all_ranks = torch.cat(
            [torch.nonzero(changed_sorted[starts[c] : starts[c + 1]]).flatten() for c in range(n_classes)]
        )
    counts += _emit_classes(w, all_ranks, d, [int(x) for x in n_c], [int(x) for x in k_c], spec)
    return w.getvalue(), tuple(counts)


def _emit_classes(
    w: bc.BitWriter, ranks: torch.Tensor, d: torch.Tensor, n_c: list[int], k_c: list[int], spec: _Spec
) -> list[int]:
    """Write every class's four sections (module docstring) and return their counts. `ranks` and `d` are
    class-major (class c's changes are rows k_0 + .. + k_{c-1} onward, in flat index order). The sections of all
    classes are prepared together, so the whole emission waits for the device three times (escape counts, Rice
    means, Rice costs), not a few times per class and section."""
    device = d.device
    starts = np.concatenate([[0], np.cumsum(k_c)]).astype(np.int64)
    cls = torch.repeat_interleave(
        torch.arange(len(k_c), device=device), torch.tensor(k_c, device=device), output_size=int(starts[-1])
    )
    mag = d.abs()
    big = mag > 1
    x_c = [int(x) for x in torch.bincount(cls, weights=big.double(), minlength=len(k_c)).tolist()]
    x_starts = np.concatenate([[0], np.cumsum(x_c)]).astype(np.int64)
    big_at = torch.nonzero_static(big, size=int(x_starts[-1])).flatten()  # positions among all changes, in order
    in_class = big_at - torch.tensor(starts[:-1], device=device)[cls[big_at]]  # ... among their class's changes
    rank_gaps, esc_gaps = _segment_gaps(ranks, starts), _segment_gaps(in_class, x_starts)
    mags = mag[big_at] - 2
    sections: list[torch.Tensor] = []
    widths: list[int] = []
    heads: list[list[int]] = []
    for c in range(len(k_c)):
        a, b, xa, xb = starts[c], starts[c + 1], x_starts[c], x_starts[c + 1]
        for members, gaps, n in ((ranks[a:b], rank_gaps[a:b], n_c[c]), (in_class[xa:xb], esc_gaps[xa:xb], k_c[c])):
            if 2 * members.numel() > n:  # coded as its complement (rare: most of a class changed)
                _, gaps = bc.set_gaps(members, n)
                heads.append([1, gaps.numel()])
            else:
                heads.append([0, gaps.numel()])
            sections.append(gaps)
            widths.append(bc.set_width(n))
        sections.append(mags[xa:xb])
        widths.append(spec.width)
        heads.append([])
    plans = bc.rice_plans(sections, widths)
    counts: list[int] = []
    for c in range(len(k_c)):
        for j in range(3):
            i = 3 * c + j
            counts += heads[i] + bc.put_rice_planned(w, sections[i], widths[i], plans[i])
            if j == 0:  # signs, after the positions
                w.fixed((d[starts[c] : starts[c + 1]] < 0).to(torch.int64), 1)
    return counts


def _segment_gaps(ranks: torch.Tensor, starts: np.ndarray) -> torch.Tensor:
    """r_i - r_{i-1} - 1 within each segment [starts[s], starts[s+1]) of `ranks`, r_{-1} = -1 at a segment's start."""
    if ranks.numel() == 0:
        return ranks.long()
    prev = torch.roll(ranks.long(), 1)
    firsts = [int(a) for a, b in itertools.pairwise(starts) if b > a]
    prev[torch.tensor(firsts, device=ranks.device)] = -1
    return ranks.long() - prev - 1


def _decode_changes(ob: torch.Tensor, data: bytes, counts: tuple[int, ...], spec: _Spec) -> torch.Tensor:
    c = bc.Cursor(counts, 0)
    n_classes = c.next()
    if not 1 <= n_classes <= spec.n_exp:
        raise DeltaError(f"corrupt delta counts: {n_classes} classes")
    lows = [c.next() for _ in range(n_classes - 1)]
    bounds = [0, *lows, spec.n_exp]
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise DeltaError(f"corrupt delta counts: class bounds {bounds} are not increasing")
    r = bc.BitReader(data, ob.device)
    kern = _kernels(ob) if n_classes > 1 else None
    if kern is not None:
        lows_t = kern.padded_lows(lows, spec.n_exp, ob.device)
        n_c, block_cnt = kern.class_sizes(ob, lows_t, spec.exp_shift, spec.n_exp)
        starts = np.concatenate([[0], np.cumsum(n_c[:n_classes].cpu().numpy())]).astype(np.int64)
    elif n_classes > 1:  # the encoder's layout: classes contiguous after a stable sort by class
        cls = _class_ids(_exponents(ob, spec), lows)
        order = torch.argsort(cls, stable=True)
        sizes = torch.bincount(cls, minlength=n_classes).cpu().numpy()
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    checks = bc.Checks()
    idx_parts, d_parts = [], []
    for k in range(n_classes):
        n_k = ob.numel() if n_classes == 1 else int(starts[k + 1] - starts[k])
        ranks = bc.get_set(r, c, n_k, checks)
        neg = r.fixed(ranks.numel(), 1).bool()
        mag = torch.ones(ranks.numel(), dtype=torch.int64, device=ob.device)
        big = bc.get_set(r, c, ranks.numel(), checks)
        mag[big] = bc.get_rice(r, c, big.numel(), spec.width, checks) + 2
        if n_classes == 1:
            idx_parts.append(ranks)
        elif kern is not None:  # index into the class-major order
            idx_parts.append(ranks + int(starts[k]))
        else:
            idx_parts.append(order[starts[k] : starts[k + 1]][ranks])
        d_parts.append(torch.where(neg, -mag, mag))
    if c.pos != len(counts):
        raise DeltaError(f"corrupt delta counts: {len(counts) - c.pos} unused")
    r.finish(checks)
    idx, d = torch.cat(idx_parts), torch.cat(d_parts)
    if kern is not None:
        dense = torch.zeros(ob.numel(), dtype=torch.int32 if spec.width == 16 else torch.int64, device=ob.device)
        dense[idx] = d.to(dense.dtype)
        out, bad = kern.apply_dense(ob, lows_t, block_cnt, dense, spec.width, spec.exp_shift, spec.n_exp)
        checks.add(bad > 0, _OUTSIDE)
    else:
        key = _keys(ob[idx], spec) + d
        if key.numel():
            checks.add((key.min() < 0) | (key.max() >= 1 << spec.width), _OUTSIDE)
        out = ob.clone()
        out[idx] = _unkeys(key, spec)
    checks.raise_first()  # the one wait: nothing computed above is returned unless the whole stream was valid
    return out


_OUTSIDE = "corrupt delta: a difference moves a value outside its dtype's bit patterns"


def _partition(
    n_e: np.ndarray, k_e: np.ndarray, x_e: np.ndarray, s_e: np.ndarray, max_classes: int
) -> tuple[list[int], float]:
    """Contiguous exponent ranges (their lower bounds, first one omitted) minimising the estimated coded bits.

    Per exponent: n_e elements, k_e changed, x_e escapes (|d| > 1), s_e the sum of their |d| - 2. A class of n
    elements costs n H(k/n) (positions) + k (signs) + k H(x/k) (escapes) + x h(s/x) (magnitudes, h = entropy of a
    geometric law of that mean) + a header. Exact DP over segments of the populated exponents.
    """
    used = np.nonzero(n_e)[0]
    pre = [np.concatenate([[0.0], np.cumsum(a[used])]) for a in (n_e, k_e, x_e, s_e)]
    i, j = np.triu_indices(len(used) + 1, 1)
    n, k, x, s = (p[j] - p[i] for p in pre)
    mu = np.divide(s, x, out=np.zeros_like(s), where=x > 0)
    geo = (1 + mu) * _log2(1 + mu) - mu * _log2(np.where(mu > 0, mu, 1.0))
    cost = np.full((len(used) + 1, len(used) + 1), np.inf)
    cost[i, j] = n * _h2(k, n) + k + k * _h2(x, k) + x * geo + _CLASS_HEADER_BITS
    best = np.full(len(used) + 1, np.inf)
    best[0] = 0.0
    back, totals = [], []
    for _ in range(max(1, max_classes)):
        tot = best[:, None] + cost
        arg = tot.argmin(0)
        best = tot[arg, np.arange(len(used) + 1)]
        back.append(arg)
        totals.append(best[-1])
    m = int(np.argmin(totals))
    starts, end = [], len(used)
    for level in range(m, -1, -1):
        end = int(back[level][end])
        starts.append(end)
    return [int(used[t]) for t in reversed(starts[:-1])], float(totals[m])


def _h2(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Binary entropy (bits) of k/n, 0 where n == 0."""
    p = np.clip(np.divide(k, n, out=np.zeros_like(k), where=n > 0), 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return np.where((p > 1e-300) & (q > 1e-300), -(p * _log2(p) + q * _log2(q)), 0.0)


_LOG2E = 1.4426950408889634  # 1 / ln 2
_SQRT_HALF = 0.7071067811865476
_ATANH_TERMS = [1.0 / k for k in range(23, 0, -2)]  # 1/23, 1/21, ..., 1/1


def _log2(x: np.ndarray) -> np.ndarray:
    """log2 of positive float64 values from correctly rounded operations alone (frexp, +, -, *, /), within a few
    ulps: the same bits on every CPU. np.log2 is not: its SIMD versions differ by instruction set in the last bits,
    and the partition's estimates decide the classes, so the encoder's output would depend on the CPU that ran it.
    x = m 2^e with m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(z), z = (m - 1) / (m + 1), |z| <= 0.172: the odd
    series to z^23 (the next term is under 1e-18)."""
    m, e = np.frexp(x)
    low = m < _SQRT_HALF
    m = np.where(low, 2.0 * m, m)
    z = (m - 1.0) / (m + 1.0)
    z2 = z * z
    acc = np.zeros_like(z)
    for c in _ATANH_TERMS:
        acc = acc * z2 + c
    return (e - low) + 2.0 * z * acc * _LOG2E


# ---------------------------------------------------------------- bit patterns
_kernel_module: object | None = None


def _kernels(t: torch.Tensor) -> Any:
    """`sync.delta_kernels` for CUDA tensors where Triton imports, else None (the sort-based torch path)."""
    global _kernel_module
    if not t.is_cuda:
        return None
    if _kernel_module is None:
        try:
            from miles_hpc.sync.codec import delta_kernels

            _kernel_module = delta_kernels
        except ImportError:
            _kernel_module = False
    return _kernel_module or None


def _flat_bits(t: torch.Tensor, spec: _Spec) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(spec.bits)


def _exponents(bits: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """The exponent field of each pattern, as int16 (the narrowest type bincount and a stable sort take)."""
    return ((bits >> spec.exp_shift) & (spec.n_exp - 1)).to(torch.int16)


def _class_ids(exp: torch.Tensor, lows: list[int]) -> torch.Tensor:
    """Class of each exponent field: how many class lower bounds (`lows`, increasing) are <= it."""
    return torch.bucketize(exp, torch.tensor(lows, dtype=exp.dtype, device=exp.device), out_int32=True, right=True)


def _keys(bits: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Order-preserving int64 keys of bit patterns (module docstring)."""
    top = 1 << (spec.width - 1)
    u = bits.long() & ((1 << spec.width) - 1)
    return u ^ (top + (u >> (spec.width - 1)) * (top - 1))


def _unkeys(key: torch.Tensor, spec: _Spec) -> torch.Tensor:
    top, full = 1 << (spec.width - 1), (1 << spec.width) - 1
    u = key ^ (full - (key >> (spec.width - 1)) * (top - 1))
    return (u - ((u >> (spec.width - 1)) << spec.width)).to(spec.bits)  # into the signed range of the view


def _raw_bytes(bits: torch.Tensor) -> bytes:
    arr = bits.cpu().numpy()
    return (arr.byteswap() if sys.byteorder != "little" else arr).tobytes()


def _from_raw(data: bytes, spec: _Spec, numel: int, device: torch.device) -> torch.Tensor:
    if len(data) != numel * spec.width // 8:
        raise DeltaError(f"'full' payload has {len(data)} bytes, the tensor needs {numel * spec.width // 8}")
    arr = np.frombuffer(data, dtype=np.dtype(f"<i{spec.width // 8}")).astype(f"=i{spec.width // 8}")
    return torch.from_numpy(arr).to(device)
