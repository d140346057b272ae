"""A torch.distributed process group between processes that do NOT share one default world.

Stage: weight sync (shared by the engine's weight receiver and the trainer's senders; imports nothing of ours but
``sync/wire/store.py`` and, for backend "mpi" in ``open_group``, ``sync/wire/mpi.py``). Trainer rank 0 already lives in the trainer's own world (FSDP, gloo/NCCL); each engine process lives in its
own. The weight-update group spans trainer rank 0 (rank 0 here) and every engine rank (``rank_offset + tp_rank``),
exactly as SGLang's ``init_weights_update_group`` builds it, so our trainer can drive real SGLang engines and real
SGLang-style trainers can drive our engine.

How: rank 0 hosts a ``TCPStore`` at ``master_address:master_port``, listening on that address only (store.py);
the others connect to it; each process then constructs ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` directly on that store. Nothing is registered with
``torch.distributed``'s global state, so ``dist.broadcast(..., group=...)`` does not know the group: use the methods
of :class:`CustomGroup`.

Invariants:
- Wire compatibility with SGLang (``sglang.srt.utils.common.init_custom_process_group`` over
  ``torch.distributed._new_process_group_helper``): the store keys are nested under the same prefixes
  (``group_name`` / ``group_name + "/"`` / ``"cpu/"`` or ``"cuda/"``) and rank 0 publishes the collective sequence
  number the other ranks wait for. Change neither without checking against SGLang.
- Gloo moves CPU tensors, NCCL CUDA tensors; a dtype gloo cannot reduce or copy (float8) travels as its raw bytes,
  which is exact for broadcast/send/recv (pure copies).
- Listening sockets: the store on the master address only; gloo's pairs on loopback when that address is a loopback
  one, else on gloo's default device (store.py).
- Creation blocks until every rank has joined (gloo connects its full mesh in the constructor; NCCL connects
  lazily at the first collective); a missing rank fails after ``timeout_s`` with the group named.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from miles_hpc.sync.wire.store import client_store, gloo_device, master_store

Backend = Literal["gloo", "nccl", "mpi"]

# gloo's typed collectives reject these; as bytes they copy exactly.
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_GLOO_AS_BYTES = frozenset(getattr(torch, n) for n in _FLOAT8 if hasattr(torch, n))


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    backend: Backend
    """"gloo" (CPU tensors), "nccl" (CUDA/ROCm tensors; RCCL on ROCm) or "mpi" (``open_group``: MPI's
    connect/accept, ``sync/wire/mpi.py``)."""
    master_address: str
    """Host of rank 0, which serves the TCPStore; for "mpi", the shared directory of the port files."""
    master_port: int
    """Port of that TCPStore (one per group; pick a free one on rank 0's host)."""
    rank: int
    """This process's rank in the group: trainer rank 0 is 0, engine ranks are rank_offset + tp_rank."""
    world_size: int
    """1 (trainer rank 0) + the number of engine ranks."""
    group_name: str = "weight_update_group"
    """Namespaces the store keys, so several groups can share a store host."""
    timeout_s: float = 300.0
    """How long to wait for the other ranks to join and for each collective."""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl", "mpi"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or 'mpi', got {self.backend!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")
        if not self.group_name:
            raise ValueError("group_name must not be empty")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def open_group(spec: GroupSpec, device: str | torch.device | None = None, *, mpi_gpu_aware: bool | None = None) -> Any:
    """Join the group ``spec`` names: a :class:`CustomGroup` for gloo/nccl; for "mpi" an ``MPIGroup`` (same
    operations) formed by connect/accept with every process its own job (job = ``spec.rank``, port files under
    ``spec.master_address``). Every member must run under an MPI launcher that lets separate jobs connect
    (Open MPI 4: one ``ompi-server`` named by every ``mpirun``). ``mpi_gpu_aware``: None detects."""
    if spec.backend != "mpi":
        return CustomGroup(spec, device)
    from miles_hpc.sync.wire.mpi import MPIGroup, MPIOptions

    options = MPIOptions(gpu_aware=mpi_gpu_aware, timeout_s=spec.timeout_s)
    return MPIGroup.join(
        spec.master_address,
        spec.group_name,
        job=spec.rank,
        jobs=spec.world_size,
        comm="self",
        options=options,
        device=device,
    )


class CustomGroup:
    """One process group outside the default world: broadcast, send/recv, barrier, destroy."""

    def __init__(self, spec: GroupSpec, device: str | torch.device | None = None) -> None:
        """Join the group (blocks until every rank has; see module invariants). ``device``: the CUDA device of
        an NCCL group's tensors (default: the current one); gloo groups always use the CPU."""
        if spec.backend == "mpi":
            raise ValueError("backend 'mpi' groups are MPIGroups: make them with open_group()")
        self.spec = spec
        if spec.backend == "gloo":
            self._device = torch.device("cpu")
        elif device is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device(device)
            if self._device.type != "cuda":
                raise ValueError(f"an NCCL group needs a CUDA device, got {self._device}")
            if self._device.index is None:  # "cuda" -> "cuda:N", so tensor.device compares equal
                self._device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # The store of rank 0 must outlive the group: peers read keys from it during every (re)connect. As torch's
        # tcp:// rendezvous (SGLang's side) does, each client counts itself in and rank 0 waits until all have (a
        # client that skipped the count would leave an SGLang-hosted store waiting forever); rank 0's server
        # listens on the master address only (store.py), not on every interface as torch's would.
        self._store: dist.Store | None
        if spec.rank == 0:
            self._store = master_store(spec.master_address, spec.master_port, spec.world_size, spec.timeout_s)
        else:
            self._store = client_store(spec.master_address, spec.master_port, spec.world_size, spec.timeout_s)
        kind = self._device.type
        # Same key nesting as SGLang's init_custom_process_group: PrefixStore(group_name) there, then
        # PrefixStore(f"{group_name}/") and PrefixStore(f"{device}/") inside torch's _new_process_group_helper.
        store = dist.PrefixStore(spec.group_name, self._store)
        store = dist.PrefixStore(f"{kind}/", dist.PrefixStore(f"{spec.group_name}/", store))
        if spec.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # private, but the only way to pick the device (store.py)
            opts._timeout = timeout
            device = gloo_device(spec.master_address)
            opts._devices = [device if device is not None else dist.ProcessGroupGloo.create_default_device()]
            self._pg = dist.ProcessGroupGloo(store, spec.rank, spec.world_size, opts)
        else:
            with torch.cuda.device(self._device):
                self._pg = _new_nccl(store, spec.rank, spec.world_size, timeout, spec.group_name)
        _publish_sequence_number(self._pg)

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def device(self) -> torch.device:
        """Where this group's tensors must live (CPU for gloo, the current CUDA device for NCCL)."""
        return self._device

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank, in place (same shape/dtype everywhere)."""
        self._run(tensor, lambda t: self._backend().broadcast(t, src))

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._run(tensor, lambda t: self._backend().send([t], dst, tag), write_back=False)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor`` (in place) what rank ``src`` sent with the same ``tag``."""
        self._run(tensor, lambda t: self._backend().recv([t], src, tag))

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]], tag: int = 0
    ) -> None:
        """Post every receive, then every send (``(tensor, peer rank)``, contiguous tensors); wait for all. Between
        two ranks the k-th send pairs with the k-th receive, so both sides list a link's pieces in one agreed order
        (the plan's). Receives land in place; on CUDA the device is synchronized before returning (as ``_run``).
        The same surface as ``sync/wire/mpi.py``'s ``MPIGroup.exchange``."""
        pg = self._backend()
        works = [pg.recv([self._wire(t)], src, tag) for t, src in recvs]
        works += [pg.send([self._wire(t)], dst, tag) for t, dst in sends]
        for w in works:
            w.wait()
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every rank, in place (a tensor-parallel engine's partial outputs)."""
        self._run(tensor, lambda t: self._backend().allreduce([t]))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype everywhere), in rank order."""
        work = tensor.contiguous()
        out = [torch.empty_like(work) for _ in range(self.world_size)]
        self._run(work, lambda t: self._backend().allgather([out], [t]), write_back=False)
        return out

    def barrier(self) -> None:
        # An all-reduce of one element works the same on gloo and NCCL (NCCL's own barrier guesses a device).
        flag = torch.ones(1, device=self._device)
        self._run(flag, lambda t: self._backend().allreduce([t]), write_back=False)

    def destroy(self) -> None:
        """Release the communicator and, on rank 0, the store. Idempotent; the group is unusable afterwards."""
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # a peer that already left makes NCCL's shutdown complain; the resources are freed anyway
        self._store = None

    # ------------------------------------------------------------------ internals
    def _backend(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise RuntimeError(f"process group {self.spec.group_name!r} was destroyed")
        return self._pg

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as the backend moves it (float8 as bytes on gloo); posted operations need contiguous ones."""
        if tensor.device.type != self._device.type or (self._device.type == "cuda" and tensor.device != self._device):
            raise ValueError(
                f"{self.spec.backend} group {self.spec.group_name!r} needs tensors on {self._device}, "
                f"got {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"group {self.spec.group_name!r}: exchange needs contiguous tensors")
        if self.spec.backend == "gloo" and tensor.dtype in _GLOO_AS_BYTES:
            return tensor.reshape(-1).view(torch.uint8)
        return tensor

    def _run(self, tensor: torch.Tensor, op: Callable[[torch.Tensor], Any], write_back: bool = True) -> None:
        if tensor.device.type != self._device.type:
            raise ValueError(
                f"{self.spec.backend} group {self.spec.group_name!r} needs {self._device.type} tensors, "
                f"got {tensor.device}"
            )
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        wire = work
        if self.spec.backend == "gloo" and work.dtype in _GLOO_AS_BYTES:
            wire = work.reshape(-1).view(torch.uint8)
        if self._device.type == "cuda":
            if tensor.device != self._device:
                raise ValueError(f"group {self.spec.group_name!r} is on {self._device}, the tensor on {tensor.device}")
            with torch.cuda.device(self._device):
                op(wire).wait()
                # Work.wait() only orders the current stream after NCCL's; callers read the tensor on the host or
                # on another stream next (often from another thread), so finish here.
                torch.cuda.current_stream().synchronize()
        else:
            op(wire).wait()
        if write_back and work is not tensor:
            tensor.copy_(work)


# ---------------------------------------------------------------------- torch internals, isolated here
def _new_nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, name: str) -> dist.ProcessGroup:
    """ProcessGroupNCCL with a timeout. Its Options expose the timeout only as ``_timeout`` (what torch's own
    ``_new_process_group_helper`` sets); there is no public constructor argument for it."""
    if not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL/RCCL: use backend 'gloo'")
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout  # private attribute, see docstring
    opts.group_name = name
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _publish_sequence_number(pg: dist.ProcessGroup) -> None:
    """Rank 0 writes the collective sequence number into the store and the others wait for it (gloo; a no-op
    for NCCL). torch's ``_new_process_group_helper`` does this for every group, so SGLang's engine side waits for
    the key: a rank 0 that skipped it would hang real SGLang engines. Private method, no public equivalent."""
    pg._set_sequence_number_for_group()
