"""The MPI transport for weight sync: the operations of ``sync/wire/pg.py``'s ``CustomGroup`` over mpi4py.

Stage: weight sync (shared by trainer and engine side, like ``pg.py``; imports nothing of ours). On many HPC
systems the vendor MPI is the tuned RDMA path; :class:`MPIGroup` moves the same HF-named tensors over it, with the
duck-typed surface ``broadcast.py`` uses (``broadcast``, ``device``, ``rank``, ``world_size``, ``destroy``) plus
``send``/``recv`` and a batched :meth:`MPIGroup.exchange` for the p2p plan (``planner/transfer.py``).

How processes form the group:
- one MPI world (a shared MPMD launch, ``mpirun -np T trainer : -np E engine``): :meth:`MPIGroup.from_world`
  makes a sub-communicator of the given world ranks in the given order (group rank 0 = trainer rank 0).
- separately launched jobs: :meth:`MPIGroup.join` (``MPI_Comm_accept``/``MPI_Comm_connect`` + ``Intercomm.Merge``),
  the port names exchanged as files in a shared directory. Open MPI 4.x needs an ``ompi-server`` that every
  ``mpirun`` names (``--ompi-server file:URI``); without it, connect fails and accept waits forever, so ``join``
  checks first (:func:`connect_accept_blocker`) and raises.

Invariants:
- Tensors move as raw bytes (a uint8 view of a contiguous copy): any dtype (bfloat16, float8, bool) is bit-exact.
  Messages are cut at ``chunk_bytes`` (MPI counts are C ints); both sides cut identically, since shapes agree.
- CUDA tensors go to MPI as device buffers when the MPI is GPU-aware (:func:`detect_gpu_aware`, or the
  ``gpu_aware`` option), else through pinned host memory. MPI knows no CUDA streams: the producing stream is
  synchronized before MPI reads, and a receive returns with the data visible to the host and every stream.
- Threads: MPI must provide ``MPI_THREAD_MULTIPLE`` (mpi4py requests it by default); the constructor checks and
  raises otherwise. Engines call from HTTP worker threads, and several groups may run concurrently. Calls on ONE
  group are serialised by its lock (MPI forbids concurrent collectives on one communicator); their order across
  ranks is the caller's business, as with a torch process group.
- mpi4py is imported lazily (importing it initialises MPI), so this module is importable without it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["MPIGroup", "MPIOptions", "connect_accept_blocker", "detect_gpu_aware"]

DeviceLike = str | torch.device | None
Piece = tuple[torch.Tensor, int]  # a tensor and the peer group rank it goes to (sends) or comes from (recvs)


@dataclass(frozen=True, kw_only=True, slots=True)
class MPIOptions:
    gpu_aware: bool | None = None
    """Hand CUDA buffers to MPI directly (True), stage them through pinned host memory (False), or detect (None)."""
    chunk_bytes: int = 1 << 30
    """Largest single MPI message in bytes; a bigger tensor moves as several (MPI-3 counts are C ints)."""
    timeout_s: float = 300.0
    """How long a job joining with :meth:`MPIGroup.join` waits for its port file (MPI's accept has no timeout)."""

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes < 2**31:
            raise ValueError(f"chunk_bytes must be in [1, 2**31), got {self.chunk_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


# ---------------------------------------------------------------------- pure facts -> decisions
def detect_gpu_aware(library_version: str, env: Mapping[str, str], cuda_query: int | None = None) -> bool:
    """Whether the MPI described by ``MPI.Get_library_version()`` and ``env`` takes CUDA device buffers.

    ``cuda_query``: Open MPI's ``MPIX_Query_cuda_support()`` (1: built with CUDA and enabled at run time), None
    where the symbol is missing. Unknown MPIs count as not GPU-aware: staging is always correct, only slower."""
    lib = library_version.lower()
    if "open mpi" in lib:
        return bool(cuda_query)
    if "mvapich" in lib:  # before "mpich": MVAPICH's version string may name MPICH too
        return env.get("MV2_USE_CUDA") == "1"
    if "mpich" in lib:  # MPICH and Cray MPICH
        return env.get("MPICH_GPU_SUPPORT_ENABLED") == "1"
    return False


def connect_accept_blocker(library_version: str, env: Mapping[str, str]) -> str | None:
    """Why ``MPI_Comm_connect``/``accept`` between separate launches cannot work here, or None if it may.

    Open MPI up to 4.x routes the port lookup through a PMIx server that every ``mpirun`` must share: started
    with ``ompi-server --report-uri FILE`` and named by ``mpirun --ompi-server file:FILE`` (which exports
    ``OMPI_MCA_pmix_server_uri``). Without it the connecting side fails with MPI_ERR_INTERN and the accepting
    side waits forever (seen with Open MPI 4.1.4)."""
    lib = library_version.strip()
    old_open_mpi = lib.startswith("Open MPI v") and lib[len("Open MPI v") :].split(".")[0] in ("1", "2", "3", "4")
    if old_open_mpi and not env.get("OMPI_MCA_pmix_server_uri"):
        return (
            "joining separately launched MPI jobs with this Open MPI needs a shared ompi-server: run "
            "`ompi-server --no-daemonize --report-uri URI_FILE` once, and start every mpirun of the group with "
            "`--ompi-server file:URI_FILE` (or export OMPI_MCA_pmix_server_uri=file:URI_FILE); or launch all "
            "processes as one MPMD mpirun and use MPIGroup.from_world"
        )
    return None


# ---------------------------------------------------------------------- the group
class MPIGroup:
    """A weight-sync group over an MPI intra-communicator: broadcast, send/recv, exchange, barrier, destroy."""

    def __init__(self, comm: Any, *, options: MPIOptions = MPIOptions(), device: DeviceLike = None) -> None:
        """Wrap ``comm`` (an ``mpi4py.MPI.Intracomm``; the group owns and frees it unless it is COMM_WORLD or
        COMM_SELF). ``device``: where callers should put tensors (default CPU; "cuda" = the current device).
        CPU and CUDA tensors are both accepted whatever ``device`` says."""
        MPI = _mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "MPIGroup needs MPI_THREAD_MULTIPLE (engines communicate from worker threads), but MPI provides "
                f"level {MPI.Query_thread()}: keep mpi4py.rc.thread_level = 'multiple' (the default) and use an MPI "
                "built with thread support"
            )
        self.options = options
        self._comm: Any = comm
        self._owned = comm != MPI.COMM_WORLD and comm != MPI.COMM_SELF
        self._lock = threading.Lock()
        self._pinned: torch.Tensor | None = None  # grown on demand, reused across calls (pinning is slow)
        self.rank: int = comm.Get_rank()
        self.world_size: int = comm.Get_size()
        dev = torch.device("cpu" if device is None else device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" -> "cuda:N", so tensor.device compares equal
            dev = torch.device("cuda", torch.cuda.current_device())
        self._device = dev
        if options.gpu_aware is None:
            self.gpu_aware = detect_gpu_aware(MPI.Get_library_version(), os.environ, _query_cuda_support(MPI))
        else:
            self.gpu_aware = options.gpu_aware

    @classmethod
    def from_world(
        cls, ranks: Sequence[int], *, options: MPIOptions = MPIOptions(), device: DeviceLike = None, tag: int = 0
    ) -> MPIGroup:
        """The sub-group of COMM_WORLD made of world ``ranks``, group rank i = ``ranks[i]``. Collective over the
        members only (``MPI_Comm_create_group``): every listed process calls it with the same ``ranks`` and
        ``tag``; the others do not call it. Groups created concurrently need different tags."""
        MPI = _mpi()
        world = MPI.COMM_WORLD
        me = world.Get_rank()
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or not all(0 <= r < world.Get_size() for r in ranks):
            raise ValueError(f"ranks {ranks} must be distinct ranks of a world of size {world.Get_size()}")
        if me not in ranks:
            raise ValueError(f"world rank {me} is not in the group {ranks}: only members call from_world")
        group = world.Get_group().Incl(ranks)
        try:
            comm = world.Create_group(group, tag)
        finally:
            group.Free()
        return cls(comm, options=options, device=device)

    @classmethod
    def join(
        cls,
        rendezvous_dir: str | os.PathLike[str],
        name: str,
        *,
        job: int,
        jobs: int,
        comm: Any = None,
        options: MPIOptions = MPIOptions(),
        device: DeviceLike = None,
    ) -> MPIGroup:
        """Join ``jobs`` separately launched jobs into one group; job 0 (the trainer side) gets ranks 0.., then
        job 1's processes, and so on. Every process of each job calls this with its job's ``comm`` (default
        COMM_WORLD; COMM_SELF, or "self", to join one process, such as trainer rank 0 of a broadcast). Job 0 accepts the jobs
        in index order; job k reads its port from ``rendezvous_dir/name.k.port`` (a directory every job sees;
        use a fresh one per run) and, once in, takes part in accepting the later jobs."""
        MPI = _mpi()
        blocker = connect_accept_blocker(MPI.Get_library_version(), os.environ)
        if blocker:
            raise RuntimeError(f"MPIGroup.join({name!r}): {blocker}")
        if not 0 <= job < jobs:
            raise ValueError(f"job {job} is not in [0, {jobs})")
        base = MPI.COMM_WORLD if comm is None else MPI.COMM_SELF if comm == "self" else comm
        directory = Path(rendezvous_dir)
        intra = base.Dup()  # ours to free, whatever the caller passed
        if job > 0:
            port = _wait_port(directory / f"{name}.{job}.port", options.timeout_s) if base.Get_rank() == 0 else ""
            inter = intra.Connect(port, root=0)
            intra = _merge(intra, inter, high=True)
        for k in range(job + 1, jobs):  # everyone already in accepts job k; group rank 0 (job 0) owns the port
            port = ""
            path = directory / f"{name}.{k}.port"
            if intra.Get_rank() == 0:
                port = MPI.Open_port()
                _write_atomic(path, port)
            inter = intra.Accept(port, root=0)
            if intra.Get_rank() == 0:
                MPI.Close_port(port)
                path.unlink(missing_ok=True)  # a port file exists only while its accept is pending
            intra = _merge(intra, inter, high=False)
        return cls(intra, options=options, device=device)

    @property
    def device(self) -> torch.device:
        """Where callers should put this group's tensors (receivers allocate here)."""
        return self._device

    # ------------------------------------------------------------------ operations
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank, in place (same shape/dtype everywhere)."""
        self._check_peer(src)
        with self._lock:
            root = self.rank == src
            comm, MPI = self._live(), _mpi()
            (buf,), finish, _ = self._wire([tensor], fill=root)
            for piece in _chunks(buf, self.options.chunk_bytes):
                comm.Bcast([piece, MPI.BYTE], root=src)
            if not root:
                finish()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.exchange([(tensor, dst)], [], tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor`` (in place) what rank ``src`` sent with the same ``tag``."""
        self.exchange([], [(tensor, src)], tag=tag)

    def exchange(self, sends: Sequence[Piece], recvs: Sequence[Piece], tag: int = 0) -> None:
        """Post every receive, then every send, nonblocking; wait for all. Between two peers the k-th send pairs
        with the k-th receive (MPI keeps order per peer, tag and communicator), so both sides must list a link's
        pieces in the same order (the plan's). Receive buffers are filled in place."""
        for _, peer in (*sends, *recvs):
            self._check_peer(peer)
        with self._lock:
            comm, MPI = self._live(), _mpi()
            send_bufs, _, used = self._wire([t for t, _ in sends], fill=True)
            recv_bufs, finish, _ = self._wire([t for t, _ in recvs], fill=False, pinned_from=used)
            chunk = self.options.chunk_bytes
            # Receives first: a message that finds its receive posted skips the unexpected-message queue.
            reqs = [
                comm.Irecv([p, MPI.BYTE], source=src, tag=tag)
                for buf, (_, src) in zip(recv_bufs, recvs)
                for p in _chunks(buf, chunk)
            ]
            reqs += [
                comm.Isend([p, MPI.BYTE], dest=dst, tag=tag)
                for buf, (_, dst) in zip(send_bufs, sends)
                for p in _chunks(buf, chunk)
            ]
            MPI.Request.Waitall(reqs)
            finish()

    def barrier(self) -> None:
        with self._lock:
            self._live().Barrier()

    def destroy(self) -> None:
        """Release the communicator. Every member calls it (MPI_Comm_free is collective in the standard, though
        Open MPI's returns at once). Idempotent; the group is unusable afterwards."""
        with self._lock:
            comm, self._comm = self._comm, None
            self._pinned = None
        # Free, not Disconnect, also for joined jobs: Disconnect of an intra-communicator hangs in Open MPI 4.1.4
        # (allowed upstream only by open-mpi/ompi#12119). join() already disconnected the inter-communicators, and
        # a joined job then finalizes without waiting for the others (checked with 4.1.4).
        if comm is not None and self._owned:
            comm.Free()

    # ------------------------------------------------------------------ internals
    def _live(self) -> Any:
        if self._comm is None:
            raise RuntimeError("MPI group was destroyed")
        return self._comm

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"rank {peer} is not in this MPI group of size {self.world_size}")

    def _wire(
        self, tensors: Sequence[torch.Tensor], *, fill: bool, pinned_from: int = 0
    ) -> tuple[list[Any], Callable[[], None], int]:
        """MPI buffers holding the bytes of ``tensors``, ``finish()``, which moves received bytes back into them,
        and the end offset of the pinned bytes used. ``fill``: the buffers must hold the tensors' current bytes
        (senders). CPU tensors and GPU-aware CUDA tensors are used in place (contiguous copies where needed);
        other CUDA tensors get slices of the group's pinned host buffer from offset ``pinned_from`` on."""
        for t in tensors:
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"the MPI transport moves CPU or CUDA tensors, got one on {t.device}")
        works = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        # detach: shares the storage (MPI writes land in the tensor) and lets .numpy() take a parameter
        raw = [w.detach().reshape(-1).view(torch.uint8) for w in works]  # reshape: 0-d becomes 1 element
        staged = [i for i, t in enumerate(tensors) if t.is_cuda and not self.gpu_aware]
        bufs: list[torch.Tensor] = list(raw)
        offset = pinned_from
        if staged:
            # A reallocation leaves earlier slices on the old storage, which they keep alive: still correct.
            host = self._pinned_bytes(pinned_from + sum(raw[i].numel() for i in staged))
            for i in staged:
                bufs[i] = host[offset : offset + raw[i].numel()]
                offset += raw[i].numel()
                if fill:
                    bufs[i].copy_(raw[i], non_blocking=True)
        devices = {t.device for t in tensors if t.is_cuda}
        for dev in devices:  # MPI reads device or pinned memory without knowing streams: finish the writers
            torch.cuda.current_stream(dev).synchronize()

        def finish() -> None:
            for i in staged:
                raw[i].copy_(bufs[i], non_blocking=True)
            for t, w in zip(tensors, works):
                if w is not t:
                    t.copy_(w)
            for dev in devices:  # receivers read the result on the host or another stream (often another thread)
                torch.cuda.current_stream(dev).synchronize()

        return [b if b.is_cuda else b.numpy() for b in bufs], finish, offset

    def _pinned_bytes(self, n: int) -> torch.Tensor:
        """The first ``n`` bytes of the group's pinned host buffer, grown on demand and reused across calls."""
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = None  # drop our reference first, so the old one can go before the new one is pinned
            self._pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return self._pinned[:n]


# ---------------------------------------------------------------------- helpers
def _mpi() -> Any:
    """mpi4py's MPI module; importing it initialises MPI (THREAD_MULTIPLE, mpi4py's default request)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError("the MPI transport needs mpi4py: pip install 'miles-hpc[mpi]'") from e
    return MPI


def _query_cuda_support(MPI: Any) -> int | None:
    """Open MPI's ``MPIX_Query_cuda_support()``: through mpi4py where it wraps it, else from the loaded libmpi
    (mpi4py loads it RTLD_GLOBAL, so the process's symbol table has it). None where there is no such symbol."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return int(query())
    try:
        return int(ctypes.CDLL(None).MPIX_Query_cuda_support())
    except (AttributeError, OSError):
        return None


def _chunks(buf: Any, chunk: int) -> Iterator[Any]:
    """Consecutive slices of at most ``chunk`` bytes of a 1-d uint8 buffer; none for an empty one."""
    return (buf[start : start + chunk] for start in range(0, len(buf), chunk))


def _merge(intra: Any, inter: Any, *, high: bool) -> Any:
    """The intra-communicator of both sides of ``inter`` (``high``: this side's ranks come after the other's);
    releases the two inputs (the inter-communicator by MPI_Comm_disconnect, as connected jobs must)."""
    merged = inter.Merge(high=high)
    inter.Disconnect()
    intra.Free()
    return merged


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` so readers see the whole file or none (tmp + rename in the same directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _wait_port(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no MPI port file {path} after {timeout_s:.0f} s: is job 0 of the group running?")
        time.sleep(0.05)
    return path.read_text().strip()
