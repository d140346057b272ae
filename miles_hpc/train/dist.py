"""The trainer world: process-group setup from the environment, object broadcast, teardown (stage: train).

Every trainer rank calls :func:`init_trainer_world` once at start-up. Ranks come from the standard torchrun-style
variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), which the cluster layer
sets from Slurm/MPI/torchrun. Backend: gloo on CPU, NCCL (RCCL on ROCm) on GPU.

The controller (rank 0) drives the others with :func:`broadcast_object`: it sends a command and a `TrainBatch`,
and every rank then calls the same collective method of its trainer. A world of size 1 needs no process group
for any of this, but one is still created so FSDP2 code paths are identical.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from miles_hpc.sync.wire.store import process_group_kwargs

__all__ = [
    "WorldInfo",
    "world_from_env",
    "init_trainer_world",
    "broadcast_object",
    "all_reduce_floats",
    "group_size",
    "teardown",
    "leave",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    device: torch.device
    """The device this rank computes on: cuda:LOCAL_RANK when CUDA is available (and not disabled), else cpu."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def _int_env(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise RuntimeError(f"trainer world: environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"trainer world: {key}={raw!r} is not an integer") from None


def world_from_env(env: Mapping[str, str] | None = None, *, device: str | None = None) -> WorldInfo:
    """Read the world from torchrun-style variables. Missing RANK/WORLD_SIZE mean a single-process world.

    device: "cpu", "cuda" or None (= cuda when available).
    """
    env = os.environ if env is None else env
    rank = _int_env(env, "RANK", 0)
    world_size = _int_env(env, "WORLD_SIZE", 1)
    local_rank = _int_env(env, "LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise RuntimeError(f"trainer world: RANK={rank} outside WORLD_SIZE={world_size}")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if world_size > 1 and "MASTER_PORT" not in env:
        raise RuntimeError("trainer world: MASTER_PORT is not set (needed when WORLD_SIZE > 1)")
    port = _int_env(env, "MASTER_PORT", 29500)
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        from miles_hpc.cluster.bootstrap import device_index

        dev = torch.device("cuda", device_index(local_rank, 1, torch.cuda.device_count()))
    else:
        dev = torch.device("cpu")
    return WorldInfo(
        rank=rank, world_size=world_size, local_rank=local_rank, master_addr=addr, master_port=port, device=dev
    )


def init_trainer_world(info: WorldInfo, *, timeout_s: float = 1800.0) -> None:
    """Create the default process group of the trainer world (idempotent if one with the same size exists)."""
    if dist.is_initialized():
        if dist.get_world_size() != info.world_size or dist.get_rank() != info.rank:
            raise RuntimeError(
                f"a process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"expected {info.rank}/{info.world_size}"
            )
        return
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if info.world_size == 1:  # nobody to meet: an in-memory store, no port
        where: dict[str, Any] = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent serves the store on the port
        where = {
            "init_method": f"tcp://{info.master_addr}:{info.master_port}",
            "rank": info.rank,
            "world_size": info.world_size,
        }
    else:  # rank 0 serves the store on the master address only, never on every interface
        where = process_group_kwargs(
            info.master_addr, info.master_port, rank=info.rank, world_size=info.world_size, timeout_s=timeout_s
        )
    dist.init_process_group(
        backend=info.backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        # NCCL: bind the group to this rank's GPU so collectives need no guess.
        device_id=info.device if info.device.type == "cuda" else None,
        **where,
    )


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Send a picklable object from `src` to every rank; returns it on all ranks (`obj` is ignored off `src`).

    Used by the controller for commands and `TrainBatch`es. Goes through the CPU (gloo) or the GPU (NCCL) as
    torch.distributed decides; payloads are small compared with weights.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in `group` (None: the default group); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce_floats(
    values: list[float], device: torch.device, op: str = "sum", group: dist.ProcessGroup | None = None
) -> list[float]:
    """Reduce a few scalars across `group` (None: the world) in one float64 collective ("sum" or "max")."""
    if group_size(group) == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t.tolist()


def teardown(ok: bool = True) -> None:
    """Destroy the default process group if this process created one (safe to call twice).

    ``ok``: the run ended as planned, so every rank reaches this barrier. After a failure there is no barrier: the
    other ranks may sit in a collective (or a command broadcast) that never comes, and a barrier would hang this rank
    with them; they learn of the failure from the controller's abort command or from its exit."""
    if not dist.is_initialized():
        return
    if ok and dist.get_world_size() > 1:
        try:
            dist.barrier()  # no rank tears the group down while another still uses it
        except RuntimeError:
            pass  # a peer is already gone (a failure elsewhere): tear down anyway
    try:
        dist.destroy_process_group()
    except RuntimeError:  # after a failure the group may be broken; the process exits next
        pass


def leave(code: int = 0) -> NoReturn:
    """End a worker process whose work is saved, closed and torn down, without interpreter-exit destructors.

    After gloo/NCCL groups were used, torch's C++ side can abort in them ("terminate called without an active
    exception": seen on a trainer rank after a resumed run, and on a 2-rank test worker in CI), and srun
    --kill-on-bad-exit then fails a job whose results are complete. Child processes still alive are ended first
    (what multiprocessing's own exit hook would do; megatron's checkpoint writer keeps a spawned queue manager):
    by now nothing of the run is left in them. Under an MPI launcher MPI is finalized first (exiting without it is
    an abnormal termination to mpirun)."""
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5.0)
        if child.is_alive():
            child.kill()
    mpi = sys.modules.get("mpi4py.MPI")  # bootstrap read an MPI launcher's ranks: mpirun wants MPI_Finalize
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
