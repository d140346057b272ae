"""mpirun -np 3 python threaded.py

Engines call communication from worker threads. Two groups over the same 3 ranks (A = [0, 1, 2], B = [0, 2, 1])
run at once, each from its own worker thread: A broadcasts the payloads from rank 0 while B passes tensors around
a ring with exchange. The main thread only waits. Needs MPI_THREAD_MULTIPLE (checked by MPIGroup).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from common import payloads, report
from mpi4py import MPI

from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.sync.wire.mpi import MPIGroup

a = MPIGroup.from_world([0, 1, 2], tag=1)
b = MPIGroup.from_world([0, 2, 1], tag=2)


def run_a() -> list[str]:
    sums = []
    for want in payloads():
        t = want.clone() if a.rank == 0 else torch.zeros(want.shape, dtype=want.dtype)
        a.broadcast(t, src=0)
        sums.append(tensor_checksum(t))
    return sums


def run_b() -> bool:
    ok = True
    for step in range(20):
        out = torch.full((4096,), 100 * b.rank + step, dtype=torch.float32)
        got = torch.zeros(4096)
        b.exchange([(out, (b.rank + 1) % 3)], [(got, (b.rank - 1) % 3)])
        ok &= bool((got == 100 * ((b.rank - 1) % 3) + step).all())
    return ok


with ThreadPoolExecutor(max_workers=2) as pool:
    fa, fb = pool.submit(run_a), pool.submit(run_b)
    sums, ring_ok = fa.result(timeout=50), fb.result(timeout=50)
report(
    rank=MPI.COMM_WORLD.Get_rank(),
    a_rank=a.rank,
    sums=sums,
    ring_ok=ring_ok,
    thread_multiple=MPI.Query_thread() == MPI.THREAD_MULTIPLE,
)
a.destroy()
b.destroy()
