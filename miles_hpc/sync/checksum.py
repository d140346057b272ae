"""Per-tensor checksums that trainer and engine compute identically, to verify a weight sync end to end.

Stage: sync (pure; imports nothing of ours, so the engine may import it too).

`tensor_checksum(t)` = hex blake2b-128 over: the dtype name (e.g. "bfloat16"), the shape (decimal, comma
separated), and the tensor's contiguous little-endian bytes. Two tensors share a checksum iff they have the same
dtype, shape and bits (views and strided slices hash as their contiguous copies). Computed on a CPU copy.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import torch

# numpy has no bfloat16/float8: hash those through a same-width unsigned integer view (the bits are what matter).
_BITS_VIEW: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(t: torch.Tensor) -> str:
    """Hex blake2b-128 of (dtype name, shape, little-endian bytes) of `t`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(t.dtype).removeprefix("torch.").encode())
    h.update(b"|" + ",".join(str(s) for s in t.shape).encode() + b"|")
    cpu = t.detach().to("cpu").contiguous()
    if cpu.dtype.is_complex:
        cpu = torch.view_as_real(cpu).contiguous()
    if cpu.dtype == torch.bool:
        cpu = cpu.to(torch.uint8)
    if cpu.numel():
        arr = cpu.view(_BITS_VIEW[cpu.element_size()]).numpy()
        if sys.byteorder != "little":
            arr = arr.byteswap()
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def piece_key(name: str, dims: tuple[tuple[int, int], ...]) -> str:
    """Name of the checksum of one box of a tensor (the p2p strategy verifies per held piece): ``name@0:4,0:8``."""
    return f"{name}@" + ",".join(f"{lo}:{hi}" for lo, hi in dims)
