"""Shared by the programs mpirun starts (tests/mpi_progs/*.py) and by tests/test_sync_mpi.py, which checks them.

Each program prints one ``RESULT {json}`` line per rank; the test parses those lines out of mpirun's output.
"""

from __future__ import annotations

import json
import sys

import torch


def payloads() -> list[torch.Tensor]:
    """What rank 0 broadcasts: several dtypes, a 0-d and an empty tensor, deterministic bits."""
    g = torch.Generator().manual_seed(7)
    big = torch.randn(300, 257, generator=g)
    return [
        big,  # float32, 308 KB: several chunks with a small chunk_bytes
        (torch.randn(17, 33, generator=g) * 3).to(torch.bfloat16),
        torch.randint(-(2**62), 2**62, (5, 7, 3), generator=g, dtype=torch.int64),
        torch.tensor(3.25),  # 0-d
        torch.empty(0, 4, dtype=torch.bfloat16),  # empty
        torch.randn(6, 9, generator=g).to(torch.float16),
    ]


def piece(src: int, dst: int, k: int) -> torch.Tensor:
    """The k-th piece that sender ``src`` sends to receiver ``dst`` in the exchange program (bit-exact check)."""
    g = torch.Generator().manual_seed(1000 * src + 10 * dst + k)
    shape = (3 + k + src, 5 + dst)
    if k % 3 == 0:
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    if k % 3 == 1:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int32)
    return torch.randn(shape, generator=g)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def report(**fields: object) -> None:
    # One write of one short line: mpirun forwards each rank's pipe in the chunks it reads, so a line written in
    # pieces (print writes the text and the newline separately) can interleave with another rank's.
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()
