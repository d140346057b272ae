"""Direct writes, the `colocated` strategy's fast path on a GPU (stage: sync, trainer side; docs/weight_sync.md).

When every engine is our embedded engine on this host's GPU, the trainer writes the new weights straight into the
engines' parameters: each engine shares CUDA IPC handles of its parameters once (`/weights_ipc_handles`,
engine/direct_weights.py), the trainer opens them once per engine process and keeps them, and a push is then
`/weights_direct_begin` (the engine must be paused; it counts as half-updated from here), the tensors cast to the
engine's dtype and written into the engine's own views of them in batches, each batch by one kernel that also
hashes what it writes (`checksum.copy_with_lanes`), a stream synchronisation, and `/weights_direct_commit` (prefix
cache flushed, version set). No staging buffer, no per-bucket call, no handle opened per push: the bytes move once.

Invariants: the checksums returned are of the trainer's tensors cast to each engine's dtype (what the copy wrote),
computed from the trainer's side, so `verify` still compares two independent computations; an engine whose
instance id changed (restarted) is opened again; a name the engine does not hold, or a shape that differs, stops the
push naming the tensor and the engine, which then stays half-updated (it refuses to continue until a complete
update); real SGLang and CPU engines do not offer the handles, and the caller falls back to buckets.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.errors import EngineHTTPError
from miles_hpc.sync.protocol import EngineSyncError, WeightSyncError
from miles_hpc.sync.wire.checksum import copy_with_lanes, digests, head
from miles_hpc.sync.wire.tensor_handles import TensorHandleError, load_named_tensors

__all__ = ["DirectTarget", "DirectWriter", "write_and_hash"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DirectTarget:
    """One engine's parameters as this process sees them: HF name -> a view of the engine's memory."""

    url: str
    instance: str
    views: dict[str, torch.Tensor]
    params: list[torch.Tensor]  # the opened parameters (keep the IPC mappings alive)


class DirectWriter:
    """Opened engines, by URL, and the push over them (module docstring)."""

    def __init__(self, hash_bytes: int = 512 << 20) -> None:
        self._targets: dict[str, DirectTarget] = {}
        self._unsupported: dict[str, str] = {}  # url -> why it has no direct path
        self._hash_bytes = hash_bytes

    def close(self) -> None:
        """Drop every opened engine's mappings (before the engines go: a producer must outlive its consumers)."""
        if self._targets:
            self._targets.clear()
            torch.cuda.ipc_collect()

    def unsupported(self, clients: Sequence[EngineClient]) -> str | None:
        """Why the direct path is known not to apply to some of `clients` (None: try it)."""
        return next((f"{c.url}: {self._unsupported[c.url]}" for c in clients if c.url in self._unsupported), None)

    async def begin(self, clients: Sequence[EngineClient], device: torch.device) -> list[DirectTarget] | None:
        """Begin a direct write on every engine and open the handles of new instances; None (and remembered) when
        an engine does not offer them (real SGLang: no such route; a CPU engine: refused)."""
        targets = []
        for c in clients:
            try:
                instance = await c.weights_direct_begin()
            except EngineHTTPError as e:
                if e.status == 404 or "need an engine on a GPU" in str(e):
                    self._unsupported[c.url] = str(e)
                    log.info("colocated sync: %s has no direct write (%s); sending buckets", c.url, e)
                    return None
                raise EngineSyncError([c.url], f"cannot begin a direct weight write on {c.url}: {e}") from e
            t = self._targets.get(c.url)
            if t is None or t.instance != instance:
                t = self._targets[c.url] = await self._open(c, device)
                if t.instance != instance:
                    raise EngineSyncError([c.url], f"engine {c.url} changed instance while its handles were opened")
            targets.append(t)
        return targets

    async def _open(self, c: EngineClient, device: torch.device) -> DirectTarget:
        t0 = time.perf_counter()
        obj = await c.weights_ipc_handles()
        try:
            params = [
                p for _, p in await asyncio.to_thread(load_named_tensors, base64.b64decode(obj["payload"]), device)
            ]
            views = {}
            for name, idx, shape, stride, offset in obj["entries"]:
                views[str(name)] = params[int(idx)].as_strided(tuple(shape), tuple(stride), int(offset))
        except (TensorHandleError, ValueError, TypeError, IndexError, RuntimeError) as e:
            raise EngineSyncError([c.url], f"cannot open the weight handles of {c.url}: {e}") from e
        log.info(
            "colocated sync: opened %d parameters (%d tensors) of %s in %.0f ms",
            len(params),
            len(views),
            c.url,
            (time.perf_counter() - t0) * 1e3,
        )
        return DirectTarget(c.url, str(obj["instance"]), views, params)

    async def push(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        targets: Sequence[DirectTarget],
        clients: Sequence[EngineClient],
        version: str,
        timeout_s: float,
    ) -> dict[str, str]:
        """Copy every tensor of `named` into every target (`write_and_hash`), commit; the checksums of what was
        written, from one host read."""
        heads: list[tuple[str, bytes]] = []
        t0 = time.perf_counter()

        def items() -> Iterator[tuple[torch.Tensor, list[torch.Tensor], bool]]:
            for name, t in named:  # stepped on the caller's thread: trainer-side iterators run collectives
                src = t.detach()
                dsts = []
                for tgt in targets:
                    dst = tgt.views.get(name)
                    if dst is None:
                        raise EngineSyncError(
                            [tgt.url],
                            f"engine {tgt.url} has no tensor {name!r} (a direct "
                            "write needs the engine's model to match the trainer's)",
                        )
                    if dst.shape != src.shape:
                        raise EngineSyncError(
                            [tgt.url],
                            f"tensor {name!r}: trainer shape {tuple(src.shape)}, "
                            f"engine {tgt.url} holds {tuple(dst.shape)}",
                        )
                    dsts.append(dst)
                dtypes = {d.dtype for d in dsts}
                if len(dtypes) != 1:
                    raise WeightSyncError(f"tensor {name!r}: the engines hold it in dtypes {sorted(map(str, dtypes))}")
                want = dtypes.pop()
                cast = src.dtype != want
                src = src.to(want) if cast else src  # torch's cast: what the engines' checksums expect
                heads.append((name, head(src)))
                yield src, dsts, cast

        lanes = write_and_hash(items(), self._hash_bytes)
        sums = dict(zip([n for n, _ in heads], digests([h for _, h in heads], lanes)))
        torch.cuda.synchronize()
        copied = time.perf_counter()
        results = await asyncio.gather(
            *(c.weights_direct_commit(weight_version=version, flush_cache=True, timeout=timeout_s) for c in clients),
            return_exceptions=True,
        )
        failed = [(c.url, r) for c, r in zip(clients, results) if isinstance(r, BaseException)]
        if failed:
            raise EngineSyncError(
                [u for u, _ in failed], f"direct weight write commit failed on {failed[0][0]}: {failed[0][1]}"
            )
        log.debug(
            "colocated direct write of %d tensors: copies and hashes %.1f ms, commit %.1f ms",
            len(sums),
            (copied - t0) * 1e3,
            (time.perf_counter() - copied) * 1e3,
        )
        return sums


LAUNCH_BYTES = 2 << 30
"""Sources per copy-and-hash launch of a direct write. On an H200 (7B shape, 310 bf16 tensors, 2026-12-03) the
write took 20.4 ms in 512 MB launches, 13.2 ms in 2 GiB ones and 14.7 ms in one launch (whose host work all comes
before it); docs/benchmarks.md."""


def write_and_hash(
    items: Iterable[tuple[torch.Tensor, list[torch.Tensor]] | tuple[torch.Tensor, list[torch.Tensor], bool]],
    batch_bytes: int,
    launch_bytes: int = LAUNCH_BYTES,
) -> torch.Tensor:
    """Write each source into each of its destinations (same dtype and shape) and return the lanes of what was
    written, int64 [n, 2] on the sources' device (no host read). Sources go in batches: one pass copies a batch
    into the first destinations and hashes what it wrote (`checksum.copy_with_lanes`, one Triton launch on a
    GPU); further destinations get plain copies. An item may say whether its source is a temporary (a cast made
    for this write; a 2-tuple is one): a batch holds at most about `batch_bytes` of temporaries, which stay
    referenced until it is written, and about `launch_bytes` of sources in all."""
    lanes: list[torch.Tensor] = []
    batch: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    held = size = 0

    def flush() -> None:
        lanes.append(copy_with_lanes([(src, dsts[0]) for src, dsts in batch]))
        for src, dsts in batch:
            for dst in dsts[1:]:
                dst.copy_(src)
        batch.clear()

    for item in items:
        src, dsts = item[0], item[1]
        batch.append((src, dsts))
        nbytes = src.numel() * src.element_size()
        held += nbytes if len(item) < 3 or item[2] else 0
        size += nbytes
        if held >= batch_bytes or size >= launch_bytes:
            flush()
            held = size = 0
    if batch:
        flush()
    return torch.cat(lanes) if lanes else torch.zeros(0, 2, dtype=torch.int64)
