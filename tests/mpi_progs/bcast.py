"""mpirun -np K python bcast.py [--device cpu|cuda] [--chunk-bytes N] [--gpu-aware auto|yes|no]

Every rank joins MPIGroup.from_world(range(K)); rank 0 broadcasts common.payloads(), the others receive into zeros
(one into a non-contiguous buffer). Each rank reports the checksums it holds afterwards.
"""

from __future__ import annotations

import argparse

import torch
from common import payloads, report
from mpi4py import MPI

from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.mpi import MPIGroup, MPIOptions

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu")
ap.add_argument("--chunk-bytes", type=int, default=1 << 30)
ap.add_argument("--gpu-aware", choices=["auto", "yes", "no"], default="auto")
args = ap.parse_args()

world = MPI.COMM_WORLD
device = args.device
if device == "cuda":
    torch.cuda.set_device(world.Get_rank() % torch.cuda.device_count())
gpu_aware = {"auto": None, "yes": True, "no": False}[args.gpu_aware]
group = MPIGroup.from_world(
    range(world.Get_size()), options=MPIOptions(chunk_bytes=args.chunk_bytes, gpu_aware=gpu_aware), device=device
)
sums = []
for i, want in enumerate(payloads()):
    if group.rank == 0:
        t = want.to(group.device)
    elif i == 0:  # a non-contiguous receive buffer is filled in place
        t = torch.zeros(want.shape[::-1], dtype=want.dtype, device=group.device).t()
        assert not t.is_contiguous()
    else:
        t = torch.zeros(want.shape, dtype=want.dtype, device=group.device)
    group.broadcast(t, src=0)
    sums.append(tensor_checksum(t))
group.barrier()
report(rank=group.rank, size=group.world_size, sums=sums, gpu_aware=group.gpu_aware, device=str(group.device))
group.destroy()
group.destroy()  # idempotent
