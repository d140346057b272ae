"""Per-tensor checksums that trainer and engine compute identically, to verify a weight sync end to end.

Stage: sync (pure; imports nothing of ours, so the engine may import it too).

`tensor_checksum(t)` = hex blake2b-128 over: the dtype name (e.g. "bfloat16"), the shape (decimal, comma
separated), and a 128-bit fingerprint of the tensor's bits, computed where the tensor lives (a GPU tensor is never
copied to the host: the earlier definition, blake2b over a CPU copy, hashed ~0.7 GB/s and dominated every sync).

The fingerprint, exact integer arithmetic with wrap-around modulo 2^64, so every device gives the same bits:
- words: the tensor's bytes in row-major order (complex as its float pairs, bool as bytes), zero-padded to a
  multiple of 8, read as little-endian 64-bit signed integers: w_0 .. w_{n-1} (an int64 tensor is its own words);
- two lanes l = 0, 1, each over chunks of `CHUNK` consecutive words: s_c = sum_j w_{cC+j} * m_l[j], where m_l[j] is
  the odd number `splitmix64(j + l * 2^32) | 1`; the lane is the chunks' polynomial f = f * P_l + s_c (from 0);
- the fingerprint is the two lanes as 8-byte little-endian signed integers.
Words of 8 bytes, not one per element, make the GPU pass cheap: the arithmetic per word (two multipliers, two
64-bit products) is shared by 4 bf16 values (per element it made the kernel compute-bound, ~560 GB/s on an H200).
On CUDA with Triton the lanes come from one kernel launch over many tensors (`checksum_kernels.py`), same value,
once `self_check` found the kernels computing the definition on that device (else the torch path, with a warning).
Two tensors with the same dtype, shape and bits share a checksum (views and strided slices hash as their contiguous
copies; the padding is fixed by the shape in the head). It detects what a transfer can get wrong (a changed, lost,
stale or misplaced value): one changed element of b <= 8 bytes at byte o of its word changes the word by
d * 2^(8o) with 0 < |d| < 2^(8b), which is not 0 modulo 2^64 (o + b <= 8), and every multiplier is odd, so the lane
changes. It is not a cryptographic hash, and need not be: nobody forges weights between our own processes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

CHUNK = 1 << 22  # words per chunk: bounds the temporaries ([2, CHUNK] int64 = 64 MiB) on any device
_P = (0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64))  # odd chunk multipliers, as signed int64
_tables: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()
log = logging.getLogger(__name__)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def multipliers(device: torch.device, width: int | None = None) -> torch.Tensor:
    """The two lanes' odd multipliers m_l[j] for j < `width` (default `CHUNK`), int64 [2, >= width] on `device`.
    m_l[j] depends on j alone, so one table per device serves every chunk size: it is cached and rebuilt wider
    when a caller needs more columns (a table cached at a smaller `CHUNK`, as the tests set it, is never used
    for a larger one)."""
    width = CHUNK if width is None else width
    with _lock:
        table = _tables.get(device)
        if table is None or table.shape[1] < width:
            j = np.arange(max(width, CHUNK), dtype=np.uint64)
            lanes = np.stack([_splitmix64(j), _splitmix64(j + np.uint64(1 << 32))]) | np.uint64(1)
            table = torch.from_numpy(lanes.view(np.int64)).to(device)
            _tables[device] = table
        return table


def words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s words (module docstring), a flat int64 tensor: a view of `t` where it is contiguous, 8-byte aligned
    and a whole number of words (what the GPU kernels read and write in place), else a padded copy."""
    t = t.detach()
    if t.numel() == 0:  # (an empty tensor may carry any strides, which a byte view refuses)
        return torch.zeros(0, dtype=torch.int64, device=t.device)
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    b = t.contiguous().view(-1).view(torch.uint8)
    if b.numel() % 8 or b.storage_offset() % 8:
        b = torch.cat([b, b.new_zeros(-b.numel() % 8)])
    return b.view(torch.int64)


def is_view(w: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether the words `w` of `t` are `t`'s own memory (writing them writes `t`)."""
    return w.data_ptr() == t.data_ptr() and w.numel() * 8 == t.numel() * t.element_size()


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> bytes:
    """The 16-byte fingerprint of `t`'s bits (module docstring), computed on `t`'s device; one host read."""
    return _to_bytes(lanes_of([t])[0].cpu())


def _to_bytes(lanes: torch.Tensor) -> bytes:
    return np.asarray(lanes.tolist(), dtype="<i8").tobytes()


def whole_words(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is its own words (contiguous, starting 8-byte aligned, a whole number of words): the
    kernels then read (and write) it in place, from its pointer and size alone."""
    return t.is_contiguous() and t.data_ptr() % 8 == 0 and t.nbytes % 8 == 0


@torch.no_grad()
def lanes_of(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The two lanes of each of `ts` (all on one device), int64 [len(ts), 2] on that device, without a host read.
    On CUDA with Triton: one kernel launch (`checksum_kernels.lanes_into`) that reads every tensor in place (a
    padded copy of the few that are not `whole_words`)."""
    if not ts:
        return torch.zeros(0, 2, dtype=torch.int64)
    device = ts[0].device
    kernels = _kernels_on(device)
    if kernels is not None:
        out = torch.zeros(len(ts), 2, dtype=torch.int64, device=device)
        rows: list[int] = []
        srcs: list[torch.Tensor] = []
        sp: list[int] = []
        nbytes: list[int] = []
        for i, t in enumerate(ts):  # pointers and sizes read once (the host's work per tensor)
            n = t.nbytes
            if not n:
                continue
            a = t.data_ptr()
            if n % 8 or a % 8 or not t.is_contiguous():
                t = words(t)  # a padded copy, read in place
                n, a = t.nbytes, t.data_ptr()
            rows.append(i)
            srcs.append(t)
            sp.append(a)
            nbytes.append(n)
        powers = power_table(max([1, *(-(-n // (8 * CHUNK)) for n in nbytes)]), device)
        if kernels.launch(out, rows, srcs, sp, nbytes, None, None, CHUNK, powers):
            return out
    return torch.stack([_torch_lanes(words(t)) for t in ts])


@torch.no_grad()
def copy_with_lanes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``dst.copy_(src)`` for each (src, dst) pair (same dtype and shape; sources on one device) and the lanes of
    what was written, int64 [len(pairs), 2] on the sources' device. On CUDA with Triton the pairs whose sources and
    destinations are `whole_words` on that device are copied and hashed in one launch, one pass over the bytes
    (the host work per pair: pointers and sizes); the others are copied by torch and their sources hashed by a
    second launch."""
    for s, d in pairs:
        if s.dtype != d.dtype or s.shape != d.shape:
            raise ValueError(f"copy_with_lanes: {s.dtype}{tuple(s.shape)} into {d.dtype}{tuple(d.shape)}")
    if not pairs:
        return torch.zeros(0, 2, dtype=torch.int64)
    device = pairs[0][0].device
    kernels = _kernels_on(device)
    if kernels is None:
        for s, d in pairs:
            d.copy_(s)
        return lanes_of([s for s, _ in pairs])
    out = torch.zeros(len(pairs), 2, dtype=torch.int64, device=device)
    index = device.index
    fused: list[int] = []
    rest: list[int] = []
    sp: list[int] = []
    dp: list[int] = []
    nbytes: list[int] = []
    for i, (s, d) in enumerate(pairs):  # pointers and sizes read once (the host's work per pair, every push)
        n = s.nbytes
        if not n:
            continue
        a, b = s.data_ptr(), d.data_ptr()
        if n % 8 or a % 8 or b % 8 or d.get_device() != index or not (s.is_contiguous() and d.is_contiguous()):
            rest.append(i)
            continue
        fused.append(i)
        sp.append(a)
        dp.append(b)
        nbytes.append(n)
    powers = power_table(max([1, *(-(-n // (8 * CHUNK)) for n in nbytes)]), device)
    srcs = [pairs[i][0] for i in fused]
    if not kernels.launch(out, fused, srcs, sp, nbytes, [pairs[i][1] for i in fused], dp, CHUNK, powers):
        rest = sorted(rest + fused)
    for i in rest:
        pairs[i][1].copy_(pairs[i][0])
    if rest:
        ws = [pairs[i][0] if whole_words(pairs[i][0]) else words(pairs[i][0]) for i in rest]
        if not kernels.lanes_into(out, rest, ws, None, CHUNK, power_table(_max_chunks(ws), device)):
            out[torch.tensor(rest, device=device)] = torch.stack([_torch_lanes(w) for w in map(words, ws)])
    return out


def _torch_lanes(w: torch.Tensor) -> torch.Tensor:
    """The two lanes of the flat integer tensor `w`, int64 [2] on its device (torch ops, the definition)."""
    n = w.numel()
    table = multipliers(w.device, min(n, CHUNK))
    p = torch.tensor(_P, dtype=torch.int64, device=w.device)
    f = torch.zeros(2, dtype=torch.int64, device=w.device)
    for a in range(0, n, CHUNK):
        x = w[a : a + CHUNK].to(torch.int64)
        m = table[:, : x.numel()]
        # Same sums either way (integer sums wrap the same in any order): torch's CPU integer mv is one pass;
        # CUDA has no integer mv.
        s = torch.mv(m, x) if x.device.type == "cpu" else (x[None, :] * m).sum(dim=1)
        f = f * p + s
    return f


def _max_chunks(ts: Sequence[torch.Tensor]) -> int:
    """The most chunks of words any of `ts` has (at least 1)."""
    return max([1, *(-(-t.nbytes // (8 * CHUNK)) for t in ts)])


_powers: dict[torch.device, torch.Tensor] = {}


def power_table(count: int, device: torch.device) -> torch.Tensor:
    """int64 [>= count, 2] on `device`, row k = (P_0^k, P_1^k) modulo 2^64 as signed values: the fold of a chunk
    k places from the end (cached per device, grown by doubling: no copy per call)."""
    with _lock:
        table = _powers.get(device)
        if table is None or table.shape[0] < count:
            size = 1 << max(6, (count - 1).bit_length())
            rows = [[1, 1]]
            for _ in range(size - 1):
                rows.append([(v * (p % (1 << 64))) % (1 << 64) for v, p in zip(rows[-1], _P)])
            signed = [[v - (1 << 64) if v >= 1 << 63 else v for v in row] for row in rows]
            table = _powers[device] = torch.tensor(signed, dtype=torch.int64, device=device)
        return table


_kernel_module: object | None = None


def _kernels() -> Any:
    """`sync.wire.checksum_kernels` where Triton imports (CUDA machines), else None (the torch path)."""
    global _kernel_module
    if _kernel_module is None:
        try:
            from miles_hpc.sync.wire import checksum_kernels

            _kernel_module = checksum_kernels
        except ImportError:
            _kernel_module = False
    return _kernel_module or None


_checked: dict[torch.device, bool] = {}
_check_lock = threading.Lock()


def _kernels_on(device: torch.device) -> Any:
    """The kernels for tensors on `device`: a CUDA (or ROCm) device with Triton whose `self_check` passed (run
    once per device), else None (the torch path)."""
    if device.type != "cuda":
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    with _check_lock:
        ok = _checked.get(device)
        if ok is None:
            ok = _checked[device] = self_check(kernels, device)
    return kernels if ok else None


@torch.no_grad()
def self_check(kernels: Any, device: torch.device) -> bool:
    """Whether `kernels` (`checksum_kernels`) give the definition's lanes on `device`: both launches of
    `lanes_into` (hash, and copy + hash) on probes (more than two chunks, views 16 and 8 bytes off, bf16 values,
    a padded copy, an empty tensor, rows out of order) against `_torch_lanes`. A Triton, compiler or driver that
    computes other bits (a GPU or ROCm version these kernels were not tested on) must not verify transfers: on a
    difference or an error this logs a warning naming the device and returns False, and the torch path is used
    there (same values, slower). Kernels that decline (return False) are not wrong: the torch path runs."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        n = 2 * CHUNK + 5
        raw = torch.randint(0, 256, (8 * n + 24,), dtype=torch.uint8, generator=g, device=device)
        base = raw[: 8 * n].view(torch.int64)
        probes = [base, base[1 : 1 + CHUNK // 2 + 3], raw[3:24], base[:0], base[-7:], raw[16:816].view(torch.bfloat16)]
        ws = [words(t) for t in probes]
        powers = power_table(_max_chunks(ws), device)
        want = torch.stack([_torch_lanes(w) for w in ws])
        live = [i for i, t in enumerate(probes) if t.numel()][::-1]  # rows need not be in order
        got = torch.zeros(len(probes), 2, dtype=torch.int64, device=device)
        srcs = [probes[i] if whole_words(probes[i]) else ws[i] for i in live]
        if kernels.lanes_into(got, live, srcs, None, CHUNK, powers) and not torch.equal(got, want):
            raise AssertionError(f"lanes {got.tolist()} != {want.tolist()}")
        own = [i for i in live if whole_words(probes[i])]
        dsts = [torch.zeros_like(probes[i]) for i in own]
        lanes = torch.zeros(len(own), 2, dtype=torch.int64, device=device)
        if kernels.lanes_into(lanes, range(len(own)), [probes[i] for i in own], dsts, CHUNK, powers):
            if not torch.equal(lanes, want[own]):
                raise AssertionError(f"copy lanes {lanes.tolist()} != {want[own].tolist()}")
            if not all(torch.equal(words(d), ws[i]) for d, i in zip(dsts, own)):  # (bits: random bf16 has NaNs)
                raise AssertionError("the copy wrote other bytes than its sources")
        return True
    except Exception as e:  # noqa: BLE001  (whatever failed, the torch path is correct)
        log.warning(
            "sync.wire.checksum: the Triton checksum kernels disagree with the definition on %s (%s: %s); "
            "using the torch path there",
            device,
            type(e).__name__,
            e,
        )
        return False


def tensor_checksum(t: torch.Tensor) -> str:
    """Hex blake2b-128 of (dtype name, shape, fingerprint of the bits) of `t`."""
    return digests([head(t)], lanes_of([t]))[0]


@torch.no_grad()
def tensor_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`tensor_checksum` of many tensors with one host read per device instead of one per tensor (GPU weights:
    the per-tensor synchronisation, not the hashing, dominates otherwise)."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, t in named:
        names.append(name)
        tensors.append(t)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: dict[int, str] = {}
    for idx in by_device.values():
        group = [tensors[i] for i in idx]
        out.update(zip(idx, digests([head(t) for t in group], lanes_of(group))))
    return {names[i]: out[i] for i in range(len(names))}


def digests(heads: Sequence[bytes], lanes: torch.Tensor) -> list[str]:
    """The checksums of tensors from their heads (`head`) and lanes (`lanes_of`): one host read."""
    raw = lanes.cpu().numpy().astype("<i8", copy=False).tobytes()  # row k: bytes 16k .. 16k + 16
    out = []
    for k, covered in enumerate(heads):
        h = hashlib.blake2b(covered, digest_size=16)
        h.update(raw[16 * k : 16 * k + 16])
        out.append(h.hexdigest())
    return out


def head(t: torch.Tensor) -> bytes:
    """What a checksum covers besides the bits: the dtype name and the shape."""
    return head_of(t.dtype, t.shape)


def head_of(dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    """`head` of a tensor of this dtype and shape."""
    return str(dtype).removeprefix("torch.").encode() + b"|" + ",".join(str(s) for s in shape).encode() + b"|"


def piece_key(name: str, dims: tuple[tuple[int, int], ...]) -> str:
    """Name of the checksum of one box of a tensor (the p2p strategy verifies per held piece): ``name@0:4,0:8``."""
    return f"{name}@" + ",".join(f"{lo}:{hi}" for lo, hi in dims)
