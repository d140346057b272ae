"""Colocated weight sync: trainer and engines on one host hand tensors over by handle (stage: sync; docs/design.md section 6).

Per bucket of HF-named tensors (``bucket_bytes`` in the rollout dtype), trainer rank 0 calls every engine's
``/update_weights_from_tensor`` with one payload in SGLang's own format: base64 of a ``ForkingPickler`` dump of
``list[(name, tensor)]`` (SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)``). Only handles cross
HTTP, never tensor bytes:
- CUDA tensors go by torch's CUDA IPC reduction (``rebuild_cuda_tensor``), with the device named by its UUID as
  SGLang's patched reductions do, so the same strategy drives real SGLang engines colocated on the trainer's GPUs
  (tp size 1: one payload per engine). A bucket's tensors are cast into one flat buffer on their GPU, sent as
  SGLang's ``flattened_bucket`` load format: one tensor (the buffer) plus per-tensor metadata, so an engine rebuilds
  one handle per bucket. Per-tensor handles (``ColocatedSpec.flattened=False``) cost ~0.2 ms each in torch's IPC
  bookkeeping, which left a 7B-shaped push ~20x slower than copying its bytes (H200, docs/benchmarks.md). The
  engine copies each tensor into its weights once.
- CPU tensors (the CPU tier; real SGLang never sees them) are copied once into a POSIX shared-memory segment per
  bucket (``/dev/shm/miles_hpc_<pid>_<random>``, mode 0600, reserved with ``posix_fallocate`` so a full /dev/shm is
  a clear error, never a SIGBUS), and the pickle names each tensor by the persistent id
  ``("miles-hpc/shm", segment, offset, dtype, shape)``: our one extension of the format, which the embedded engine
  maps (sync/wire/tensor_handles.py) and copies from. We chose this over torch's CPU reductions: their default passes
  file descriptors through the sending process's resource sharer, which unrelated processes cannot reach, and their
  "file_system" variant depends on the torch_shm_manager daemon and on reference counts that an engine which never
  opened the segment would leak. Here the trainer owns each segment and unlinks it once every engine answered.

On a GPU with our embedded engines the strategy skips all of this: it writes straight into the engines' parameters
(``ColocatedSpec.direct``, colocated_direct.py), the bytes moving once; buckets remain for real SGLang and the CPU.

Invariants: tensors are cast to the rollout dtype before they leave, so the returned checksums are of exactly the
bytes the engines read; the last bucket carries ``weight_version`` and flushes the prefix cache; a bucket's tensors
and its segment live until every engine answered (success, error or timeout), then go (CUDA IPC blocks return to the
allocator once the engines dropped them, ``torch.cuda.ipc_collect``); the iterator's tensors must stay valid until
their bucket is sent (as for broadcast). Engines must run on this host as the same user: ``connect`` refuses an
engine URL that is not a local address, naming it. An engine whose call fails makes the bucket fail with an
``EngineSyncError`` naming it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import secrets
import socket
import time
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any, cast
from urllib.parse import urlsplit

import torch

from miles_hpc.config import ConfigError, RunConfig
from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.protocol import EngineSyncError, WeightSyncError, verify_checksums
from miles_hpc.sync.strategies.base import Strategy
from miles_hpc.sync.strategies.colocated_direct import DirectWriter
from miles_hpc.sync.wire.checksum import tensor_checksums
from miles_hpc.sync.wire.tensor_pickle import SHM_TAG, ShmSlice, serialize_named, serialize_object

__all__ = [
    "SHM_TAG",
    "ColocatedSpec",
    "ColocatedSync",
    "ShmSlice",
    "is_local_url",
    "serialize_named",
    "serialize_object",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_ALIGN = 64  # every tensor starts at a multiple of this in its segment (any dtype's alignment, a cache line)


@dataclass(frozen=True, kw_only=True, slots=True)
class ColocatedSpec:
    bucket_bytes: int = 512 << 20
    """A bucket is sent once it holds this many bytes (rollout dtype): one update call per engine per bucket, and
    the peak extra memory (CPU: one shared-memory segment of this size)."""
    rollout_dtype: torch.dtype | None = None
    """The engines' dtype; tensors are cast to it before they leave (None: the trainer's dtype)."""
    timeout_s: float = 300.0
    """Seconds one engine may take to map and copy one bucket."""
    flattened: bool = True
    """CUDA buckets go as SGLang's ``flattened_bucket`` load format (one tensor per bucket plus metadata, so one
    handle to open and one rebuild) instead of a list of per-tensor handles (False: for SGLang versions without it)."""
    direct: bool = True
    """CUDA tensors to our embedded engines: write straight into their parameters (colocated_direct.py) instead
    of sending buckets; engines without the route (real SGLang) or on the CPU get buckets."""

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0 or self.timeout_s <= 0:
            raise ValueError("bucket_bytes and timeout_s must be positive")


def is_local_url(url: str) -> bool:
    """Whether the URL's host is an address of this machine (loopback, or one a socket can bind here)."""
    host = urlsplit(url).hostname
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        if ipaddress.ip_address(str(addr[0]).split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr[0], 0, *addr[2:]))  # only addresses of this host's interfaces bind
            return True
        except OSError:
            continue
    return False


@dataclass(slots=True)
class _Bucket:
    """One bucket as the engines will see it; holds its tensors and segment until `release`."""

    items: list[tuple[str, torch.Tensor | ShmSlice]] = field(default_factory=list)
    sent: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # what the engines read, for the checksums
    segment: shared_memory.SharedMemory | None = None
    cuda: bool = False
    gpu_flat: dict[torch.device, torch.Tensor] = field(default_factory=dict)  # uint8 buffer per GPU, views in `sent`

    def checksums(self) -> dict[str, str]:
        return tensor_checksums(self.sent)

    def flattened(self) -> dict[str, Any] | None:
        """SGLang's flattened-bucket object for this bucket, when it is all on one GPU in one dtype (else None):
        ``{"flattened_tensor": 1-D view of the buffer, "metadata": [entries with FlattenedTensorMetadata's fields]}``.
        Entries are ``SimpleNamespace``s: SGLang reads them by attribute, and unpickling them needs no SGLang."""
        dtypes = {t.dtype for _, t in self.sent}
        if len(self.gpu_flat) != 1 or len(dtypes) != 1 or self.segment is not None:
            return None
        (buf,), dtype = self.gpu_flat.values(), dtypes.pop()
        meta = []
        for name, t in self.sent:
            start = (t.data_ptr() - buf.data_ptr()) // t.element_size() if t.numel() else 0
            meta.append(
                types.SimpleNamespace(
                    name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + t.numel(), numel=t.numel()
                )
            )
        return {"flattened_tensor": buf.view(dtype), "metadata": meta}

    def release(self) -> None:
        self.items.clear()
        self.sent.clear()
        self.gpu_flat.clear()
        if self.segment is not None:
            try:
                self.segment.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with it
                log.warning("colocated sync: segment %s still mapped here; unlinking it anyway", self.segment.name)
            self.segment.unlink()
            self.segment = None
        if self.cuda:
            torch.cuda.ipc_collect()  # free sent blocks whose engine-side references are gone


def stage_bucket(pending: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> _Bucket:
    """Cast every tensor to `dtype`: CUDA tensors stay on their device, CPU tensors go into one new segment."""
    bucket = _Bucket()
    try:
        offsets: dict[int, int] = {}  # index in pending -> byte offset in its device's flat buffer
        totals: dict[torch.device, int] = {}
        for i, (_, t) in enumerate(pending):
            offsets[i] = totals.get(t.device, 0)
            totals[t.device] = offsets[i] + -(-t.numel() * (dtype or t.dtype).itemsize // _ALIGN) * _ALIGN
        cpu_total = sum(v for d, v in totals.items() if d.type == "cpu")
        has_cpu = any(not t.is_cuda for _, t in pending)
        flat = _new_segment(bucket, max(cpu_total, _ALIGN)) if has_cpu else None  # (empty tensors: a tiny one)
        gpu_flat = {
            d: torch.empty(max(n, _ALIGN), dtype=torch.uint8, device=d) for d, n in totals.items() if d.type == "cuda"
        }
        sent: torch.Tensor | None = None
        for i, (name, t) in enumerate(pending):
            want = dtype or t.dtype
            if t.is_cuda:
                off, n = offsets[i], t.numel() * want.itemsize
                sent = gpu_flat[t.device][off : off + n].view(want).view(t.shape)
                sent.copy_(t.detach())
                bucket.items.append((name, sent))
                bucket.cuda = True
            else:
                off, n = offsets[i], t.numel() * want.itemsize
                assert flat is not None and bucket.segment is not None
                sent = flat[off : off + n].view(want).view(t.shape) if n else torch.empty(t.shape, dtype=want)
                sent.copy_(t.detach())
                bucket.items.append(
                    (name, ShmSlice(bucket.segment.name, off, str(want).removeprefix("torch."), tuple(t.shape)))
                )
            bucket.sent.append((name, sent))
        bucket.gpu_flat = gpu_flat
        del flat, gpu_flat, sent  # no view of the segment may outlive the bucket (release unmaps it)
    except BaseException:
        bucket.release()
        raise
    return bucket


def _new_segment(bucket: _Bucket, size: int) -> torch.Tensor:
    name = f"miles_hpc_{os.getpid()}_{secrets.token_hex(8)}"
    try:
        bucket.segment = shared_memory.SharedMemory(name=name, create=True, size=size)
        # Reserve the pages now: writing into a sparse segment on a full tmpfs is a SIGBUS, not an error.
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as e:
        free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize if os.path.isdir(SHM_DIR) else 0
        raise WeightSyncError(
            f"cannot reserve a {size} B shared-memory segment in {SHM_DIR} ({free} B free): {e}; "
            f"lower sync.bucket_bytes or give the job a larger /dev/shm"
        ) from e
    return torch.frombuffer(bucket.segment.buf, dtype=torch.uint8)


class ColocatedSync(Strategy):
    """Rank-0 side of the colocated strategy (module docstring). One push at a time, from one event loop."""

    name = "colocated"
    takes_named = True

    @classmethod
    def check_placement(cls, cfg: RunConfig, trainer_gpus: Sequence[int], engine_gpus: Sequence[int]) -> None:
        if cfg.train.device == "cuda" and cfg.rollout.device != "cuda":
            raise ConfigError(
                "sync.strategy: colocated hands CUDA tensors over by CUDA IPC handles, which an engine "
                "on the CPU cannot open: set rollout.device=cuda"
            )

    verify = staticmethod(verify_checksums)

    def __init__(self, spec: ColocatedSpec) -> None:
        self.spec = spec
        self._clients: list[EngineClient] = []
        self._uuids: dict[int, str] = {}
        self._direct = DirectWriter(hash_bytes=spec.bucket_bytes)

    @property
    def clients(self) -> Sequence[EngineClient]:
        return tuple(self._clients)

    async def connect(self, clients: Sequence[EngineClient]) -> None:
        """Nothing to build; every engine must be on this host (handles mean nothing elsewhere)."""
        remote = [c.url for c in clients if not await asyncio.to_thread(is_local_url, c.url)]
        if remote:
            raise WeightSyncError(
                f"engine {remote[0]} is not on this host: the colocated strategy hands over CUDA "
                f"IPC and shared-memory handles, which only processes of one host can open; use "
                f"sync.strategy=broadcast or delta for remote engines"
            )
        self._clients = list(clients)

    async def close(self) -> None:
        self._clients = []
        self._direct.close()

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, str]:
        """Send every tensor of `named` in buckets; return the checksums of what the engines now hold."""
        if not self._clients:
            raise WeightSyncError("push before connect()")
        it = iter(named)
        nxt = next(it, None)
        if nxt is not None and nxt[1].is_cuda and self.spec.direct and self._direct.unsupported(self._clients) is None:
            targets = await self._direct.begin(self._clients, nxt[1].device)
            if targets is not None:
                return await self._direct.push(
                    itertools.chain([nxt], it), targets, self._clients, version, self.spec.timeout_s
                )
        sums: dict[str, str] = {}
        pending: list[tuple[str, torch.Tensor]] = []
        size = 0
        while nxt is not None:  # stepped on the caller's thread: trainer-side iterators run collectives
            name, t = nxt
            pending.append((name, t))
            size += t.numel() * (self.spec.rollout_dtype or t.dtype).itemsize
            nxt = next(it, None)
            if size >= self.spec.bucket_bytes or nxt is None:
                sums.update(await self._send(pending, version if nxt is None else None))
                pending, size = [], 0
        return sums

    async def _send(self, pending: list[tuple[str, torch.Tensor]], version: str | None) -> dict[str, str]:
        t0 = time.perf_counter()
        bucket = await asyncio.to_thread(stage_bucket, pending, self.spec.rollout_dtype)
        try:
            t1 = time.perf_counter()
            # One pickle per engine: each CUDA IPC reduction takes a reference that one engine gives back.
            flat = bucket.flattened() if self.spec.flattened else None
            load_format = None if flat is None else "flattened_bucket"
            payloads = [
                serialize_named(bucket.items, self._gpu_uuid)
                if flat is None
                else serialize_object(flat, self._gpu_uuid)
                for _ in self._clients
            ]
            t2 = time.perf_counter()
            # The checksums of what was sent are computed while the engines copy (both only read the bucket).
            sums, *results = await asyncio.gather(
                asyncio.to_thread(bucket.checksums),
                *(
                    c.update_weights_from_tensor(
                        [p],
                        weight_version=version,
                        flush_cache=version is not None,
                        timeout=self.spec.timeout_s,
                        load_format=load_format,
                    )
                    for c, p in zip(self._clients, payloads)
                ),
                return_exceptions=True,
            )
            log.debug(
                "colocated bucket of %d tensors: staged %.1f ms, pickled %.1f ms, engines and hashes %.1f ms",
                len(pending),
                (t1 - t0) * 1e3,
                (t2 - t1) * 1e3,
                (time.perf_counter() - t2) * 1e3,
            )
        finally:
            await asyncio.to_thread(bucket.release)
        if isinstance(sums, BaseException):
            raise sums
        failed = [(c.url, r) for c, r in zip(self._clients, results) if isinstance(r, BaseException)]
        if failed:
            url, err = failed[0]
            span = f"{pending[0][0]}..{pending[-1][0]}"
            raise EngineSyncError([u for u, _ in failed], f"weight update of bucket {span} failed on {url}: {err}")
        return cast(dict[str, str], sums)  # bucket.checksums' (gather's result type is the union of its awaitables)

    def _gpu_uuid(self, index: int) -> str:
        if index not in self._uuids:
            self._uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
        return self._uuids[index]
