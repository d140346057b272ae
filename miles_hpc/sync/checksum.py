"""Per-tensor checksums that trainer and engine compute identically, to verify a weight sync end to end.

Stage: sync (pure; imports nothing of ours, so the engine may import it too).

`tensor_checksum(t)` = hex blake2b-128 over: the dtype name (e.g. "bfloat16"), the shape (decimal, comma
separated), and a 128-bit fingerprint of the tensor's bits, computed where the tensor lives (a GPU tensor is never
copied to the host: the earlier definition, blake2b over a CPU copy, hashed ~0.7 GB/s and dominated every sync).

The fingerprint, exact integer arithmetic with wrap-around modulo 2^64, so every device gives the same bits:
- words: the row-major elements reinterpreted as signed integers of the element's width (bool and 1-byte types as
  uint8, complex as its float pairs), widened to int64: w_0 .. w_{n-1};
- two lanes l = 0, 1, each over chunks of `CHUNK` consecutive words: s_c = sum_j w_{cC+j} * m_l[j], where m_l[j] is
  the odd number `splitmix64(j + l * 2^32) | 1`; the lane is the chunks' polynomial f = f * P_l + s_c (from 0);
- the fingerprint is the two lanes as 8-byte little-endian signed integers.
On CUDA with Triton the lanes come from one kernel pass (`checksum_kernels.py`), same value.
Two tensors with the same dtype, shape and bits share a checksum (views and strided slices hash as their contiguous
copies). It detects what a transfer can get wrong (a changed, lost, stale or misplaced value: any single changed
word changes a lane, as every multiplier is odd), which is what it is for; it is not a cryptographic hash, and
need not be: nobody forges weights between our own processes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import numpy as np
import torch

CHUNK = 1 << 22  # words per chunk: bounds the temporaries ([2, CHUNK] int64 = 64 MiB) on any device
_P = (0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64))  # odd chunk multipliers, as signed int64
_WORDS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_tables: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def multipliers(device: torch.device) -> torch.Tensor:
    """The two lanes' odd multipliers, int64 [2, CHUNK] on `device` (built once per device)."""
    with _lock:
        table = _tables.get(device)
        if table is None:
            j = np.arange(CHUNK, dtype=np.uint64)
            lanes = np.stack([_splitmix64(j), _splitmix64(j + np.uint64(1 << 32))]) | np.uint64(1)
            table = torch.from_numpy(lanes.view(np.int64)).to(device)
            _tables[device] = table
        return table


def words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as a flat tensor of same-width integers (a view where `t` is contiguous)."""
    t = t.detach()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.contiguous().view(-1).view(_WORDS[t.element_size()])


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> bytes:
    """The 16-byte fingerprint of `t`'s bits (module docstring), computed on `t`'s device; one host read."""
    return _to_bytes(_lanes(t).cpu())


def _to_bytes(lanes: torch.Tensor) -> bytes:
    return np.asarray(lanes.tolist(), dtype="<i8").tobytes()


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """The two lanes, int64 [2] on `t`'s device (no host sync)."""
    w = words(t)
    n = w.numel()
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=w.device)
    if w.is_cuda and _kernels() is not None:
        sums = _kernels().chunk_sums(w, CHUNK)  # type: ignore[union-attr]
        # sum_c s_c * P^(C-1-c): the same as folding chunk by chunk.
        return (sums * _fold_powers(sums.shape[0], w.device)).sum(dim=0)
    table = multipliers(w.device)
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


_powers: dict[tuple[int, torch.device], torch.Tensor] = {}


def _fold_powers(chunks: int, device: torch.device) -> torch.Tensor:
    """int64 [C, 2] on `device`: P_l^(C-1-c) modulo 2^64 as signed values (cached: no copy per call)."""
    key = (chunks, device)
    if key not in _powers:
        rows = [[1, 1]]
        for _ in range(chunks - 1):
            rows.append([(v * (p % (1 << 64))) % (1 << 64) for v, p in zip(rows[-1], _P)])
        signed = [[v - (1 << 64) if v >= 1 << 63 else v for v in row] for row in reversed(rows)]
        with _lock:
            _powers[key] = torch.tensor(signed, dtype=torch.int64, device=device)
    return _powers[key]


_kernel_module: object | None = None


def _kernels() -> object | None:
    """`sync.checksum_kernels` where Triton imports (CUDA machines), else None (the torch path)."""
    global _kernel_module
    if _kernel_module is None:
        try:
            from miles_hpc.sync import checksum_kernels

            _kernel_module = checksum_kernels
        except ImportError:
            _kernel_module = False
    return _kernel_module or None


def tensor_checksum(t: torch.Tensor) -> str:
    """Hex blake2b-128 of (dtype name, shape, fingerprint of the bits) of `t`."""
    h = hashlib.blake2b(_head(t), digest_size=16)
    h.update(fingerprint(t))
    return h.hexdigest()


@torch.no_grad()
def tensor_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`tensor_checksum` of many tensors with one host read per device instead of one per tensor (GPU weights:
    the per-tensor synchronisation, not the hashing, dominates otherwise)."""
    heads: list[tuple[str, bytes]] = []
    lanes: list[torch.Tensor] = []
    for name, t in named:
        heads.append((name, _head(t)))
        lanes.append(_lanes(t))
    if not lanes:
        return {}
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(lanes):
        by_device.setdefault(f.device, []).append(i)
    values: list[bytes] = [b""] * len(lanes)
    for idx in by_device.values():
        host = torch.stack([lanes[i] for i in idx]).cpu()
        for i, row in zip(idx, host):
            values[i] = _to_bytes(row)
    out = {}
    for (name, head), fp in zip(heads, values):
        h = hashlib.blake2b(head, digest_size=16)
        h.update(fp)
        out[name] = h.hexdigest()
    return out


def _head(t: torch.Tensor) -> bytes:
    return str(t.dtype).removeprefix("torch.").encode() + b"|" + ",".join(str(s) for s in t.shape).encode() + b"|"


def piece_key(name: str, dims: tuple[tuple[int, int], ...]) -> str:
    """Name of the checksum of one box of a tensor (the p2p strategy verifies per held piece): ``name@0:4,0:8``."""
    return f"{name}@" + ",".join(f"{lo}:{hi}" for lo, hi in dims)
