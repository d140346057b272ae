"""mpirun -np 4 python exchange.py [--chunk-bytes N]

The p2p pattern: group ranks 0-1 send, 2-3 receive; every sender sends PIECES pieces (common.piece) to every
receiver in one batched MPIGroup.exchange, each side listing a link's pieces in the same order. A receiver's
buffers are posted interleaved across senders and one of them is non-contiguous. Receivers report bit-exactness.
"""

from __future__ import annotations

import argparse

import torch
from common import piece, report, same_bits
from mpi4py import MPI

from miles_hpc.sync.wire.mpi import MPIGroup, MPIOptions

PIECES = 5
SENDERS, RECEIVERS = (0, 1), (2, 3)

ap = argparse.ArgumentParser()
ap.add_argument("--chunk-bytes", type=int, default=1 << 30)
args = ap.parse_args()

group = MPIGroup.from_world(range(MPI.COMM_WORLD.Get_size()), options=MPIOptions(chunk_bytes=args.chunk_bytes))
r = group.rank
if r in SENDERS:
    sends = [(piece(r, dst, k), dst) for k in range(PIECES) for dst in RECEIVERS]
    group.exchange(sends, [])
    report(rank=r, role="sender", sent=len(sends))
else:
    recvs = []
    for k in range(PIECES):
        for src in SENDERS:
            want = piece(src, r, k)
            buf = torch.zeros(want.shape[::-1], dtype=want.dtype).t() if k == 2 else torch.zeros_like(want)
            recvs.append((buf, src))
    group.exchange([], recvs)
    wants = [piece(src, r, k) for k in range(PIECES) for src in SENDERS]
    ok = [same_bits(buf, want) for (buf, _), want in zip(recvs, wants)]
    report(rank=r, role="receiver", ok=ok)
# A rank that both sends and receives in one call (a ring: r -> r+1), as a p2p rank may.
size = group.world_size
out = torch.full((1000,), r, dtype=torch.int64)
got = torch.zeros(1000, dtype=torch.int64)
group.exchange([(out, (r + 1) % size)], [(got, (r - 1) % size)], tag=3)
report(rank=r, role="ring", ok=bool((got == (r - 1) % size).all()))
group.destroy()
