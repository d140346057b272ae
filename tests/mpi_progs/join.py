"""mpirun --ompi-server file:URI -np N python join.py DIR NAME JOB JOBS [self]   (one mpirun per job)

Separately launched jobs form one group through MPIGroup.join (port files in DIR); job 0 gets the first ranks.
With ``self``, only world rank 0 of this job joins (comm=COMM_SELF), as trainer rank 0 does for a broadcast; the
job's other ranks stay out. Rank 0 broadcasts the payloads, then the last rank sends one tensor to rank 0. Each
process reports.
"""

from __future__ import annotations

import sys

import torch
from common import payloads, report
from mpi4py import MPI

from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.mpi import MPIGroup, MPIOptions

directory, name, job, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
alone = sys.argv[5:] == ["self"]
if alone and MPI.COMM_WORLD.Get_rank() > 0:
    report(job=job, job_rank=MPI.COMM_WORLD.Get_rank(), member=False)
    sys.exit(0)
try:
    group = MPIGroup.join(
        directory, name, job=job, jobs=jobs, comm=MPI.COMM_SELF if alone else None, options=MPIOptions(timeout_s=50)
    )
except RuntimeError as e:  # the missing-ompi-server case: report the message, exit non-zero without hanging
    report(job=job, error=str(e))
    sys.exit(3)
sums = []
for want in payloads():
    t = want.clone() if group.rank == 0 else torch.zeros(want.shape, dtype=want.dtype)
    group.broadcast(t, src=0)
    sums.append(tensor_checksum(t))
fields: dict[str, object] = {}
last = group.world_size - 1
if group.rank == last:
    group.send(torch.full((3, 3), float(last)), dst=0)
elif group.rank == 0:
    got = torch.zeros(3, 3)
    group.recv(got, src=last)
    fields["back_ok"] = bool((got == last).all())
report(job=job, job_rank=MPI.COMM_WORLD.Get_rank(), rank=group.rank, size=group.world_size, sums=sums, **fields)
group.destroy()
