"""mpirun -np 2 python mpmd.py trainer : -np 2 python mpmd.py engine   (one MPMD world of 4 ranks)

World ranks 0-1 are the trainer (their own communicator, split off COMM_WORLD, as FSDP's world would be), 2-3 the
engines. The weight-sync group is world ranks [0, 3, 2]: trainer rank 0 first, the engines in reverse; trainer
rank 1 is not in it. Rank 0 of the group broadcasts the payloads; then the last group rank sends one tensor back to
rank 0. Every process reports what it saw.
"""

from __future__ import annotations

import sys

import torch
from common import payloads, report
from mpi4py import MPI

from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.mpi import MPIGroup

ORDER = [0, 3, 2]
role = sys.argv[1]
world = MPI.COMM_WORLD
me = world.Get_rank()
own = world.Split(color=0 if role == "trainer" else 1, key=me)  # the role's own world
total = own.allreduce(1)
fields: dict[str, object] = {"world_rank": me, "role": role, "own_size": total}
if me in ORDER:
    group = MPIGroup.from_world(ORDER, tag=5)
    sums = []
    for want in payloads():
        t = want.clone() if group.rank == 0 else torch.zeros(want.shape, dtype=want.dtype)
        group.broadcast(t, src=0)
        sums.append(tensor_checksum(t))
    back = torch.arange(10, dtype=torch.bfloat16) * group.world_size
    if group.rank == group.world_size - 1:
        group.send(back, dst=0)
    elif group.rank == 0:
        got = torch.zeros(10, dtype=torch.bfloat16)
        group.recv(got, src=group.world_size - 1)
        fields["back_ok"] = torch.equal(got, back)
    fields.update(group_rank=group.rank, group_size=group.world_size, sums=sums)
    group.destroy()
own.allreduce(1)  # the role's own world still works after the group is gone
report(**fields)
