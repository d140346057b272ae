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
from miles_hpc.sync.wire.checksum import copy_with_lanes, digests, head_of
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
        self.last: dict[str, float] = {}
        """Seconds of the last push's phases: ``begin_s`` (the begin calls, handles opened), ``issue_s`` (the
        trainer's iterator stepped and every copy launched: host work), ``write_s`` (until the copies and hashes
        finished and the lanes were read), ``digest_s`` (the checksums from the lanes) and ``commit_s`` (the
        commit calls, sent before the digests: the two overlap)."""
        self._known: tuple[tuple[tuple[str, str, int], ...], dict[str, _Resolved]] = ((), {})
        self._begun = 0.0

    def close(self) -> None:
        """Drop every opened engine's mappings (before the engines go: a producer must outlive its consumers)."""
        self._known = ((), {})  # (holds views of the engines' memory)
        if self._targets:
            self._targets.clear()
            torch.cuda.ipc_collect()

    def unsupported(self, clients: Sequence[EngineClient]) -> str | None:
        """Why the direct path is known not to apply to some of `clients` (None: try it)."""
        return next((f"{c.url}: {self._unsupported[c.url]}" for c in clients if c.url in self._unsupported), None)

    async def begin(self, clients: Sequence[EngineClient], device: torch.device) -> list[DirectTarget] | None:
        """Begin a direct write on every engine and open the handles of new instances; None (and remembered) when
        an engine does not offer them (real SGLang: no such route; a CPU engine: refused)."""
        self._begun = time.perf_counter()
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

    def _resolved(self, targets: Sequence[DirectTarget]) -> dict[str, _Resolved]:
        """Per tensor name, what a push needs to write it into these targets (their views, dtype, shape, the
        checksum's head), kept while the targets are the same engine instances: a push then costs a dict look-up
        and a shape check per tensor, not the views' look-ups and the head's formatting."""
        key = tuple((t.url, t.instance, id(t.views)) for t in targets)
        if self._known[0] != key:
            self._known = (key, {})
        return self._known[1]

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
        names: list[str] = []
        heads: list[bytes] = []
        t0 = time.perf_counter()
        known = self._resolved(targets)

        def items() -> Iterator[tuple[torch.Tensor, list[torch.Tensor], bool]]:
            for name, t in named:  # stepped on the caller's thread: trainer-side iterators run collectives
                entry = known.get(name)
                if entry is None or entry[2] != t.shape:
                    entry = known[name] = _resolve(name, t, targets)
                dsts, want, _, h = entry
                src = t.detach() if t.requires_grad else t
                cast = src.dtype != want
                if cast:
                    src = src.to(want)  # torch's cast: what the engines' checksums expect
                names.append(name)
                heads.append(h)
                yield src, dsts, cast

        lanes = write_and_hash(items(), self._hash_bytes)
        issued = time.perf_counter()
        host = lanes.cpu()  # waits for the copies (this stream) ...
        if host.device != lanes.device:
            torch.cuda.synchronize()  # ... and for anything else on the device
        copied = time.perf_counter()
        commits = asyncio.ensure_future(
            asyncio.gather(
                *(
                    c.weights_direct_commit(weight_version=version, flush_cache=True, timeout=timeout_s)
                    for c in clients
                ),
                return_exceptions=True,
            )
        )
        try:
            for _ in range(2):  # the commit requests go out; the digests are computed while the engines answer
                await asyncio.sleep(0)
            sums = dict(zip(names, digests(heads, host)))
            digested = time.perf_counter()
        finally:
            results = await commits
        failed = [(c.url, r) for c, r in zip(clients, results) if isinstance(r, BaseException)]
        if failed:
            raise EngineSyncError(
                [u for u, _ in failed], f"direct weight write commit failed on {failed[0][0]}: {failed[0][1]}"
            )
        self.last = {
            "begin_s": t0 - self._begun,
            "issue_s": issued - t0,
            "write_s": copied - t0,
            "digest_s": digested - copied,
            "commit_s": time.perf_counter() - copied,
        }
        log.debug(
            "colocated direct write of %d tensors: %s",
            len(sums),
            ", ".join(f"{k[:-2]} {v * 1e3:.2f} ms" for k, v in self.last.items()),
        )
        return sums


_Resolved = tuple[list[torch.Tensor], torch.dtype, torch.Size, bytes]  # destinations, their dtype, shape, head


def _resolve(name: str, t: torch.Tensor, targets: Sequence[DirectTarget]) -> _Resolved:
    """Where tensor `name` (the trainer's `t`) goes in each target, in which dtype, and its checksum's head; an
    `EngineSyncError` naming the engine when one lacks it or holds another shape."""
    dsts = []
    for tgt in targets:
        dst = tgt.views.get(name)
        if dst is None:
            raise EngineSyncError(
                [tgt.url],
                f"engine {tgt.url} has no tensor {name!r} (a direct write needs the engine's model to match the trainer's)",
            )
        if dst.shape != t.shape:
            raise EngineSyncError(
                [tgt.url], f"tensor {name!r}: trainer shape {tuple(t.shape)}, engine {tgt.url} holds {tuple(dst.shape)}"
            )
        dsts.append(dst)
    dtypes = {d.dtype for d in dsts}
    if len(dtypes) != 1:
        raise WeightSyncError(f"tensor {name!r}: the engines hold it in dtypes {sorted(map(str, dtypes))}")
    want = dtypes.pop()
    return dsts, want, t.shape, head_of(want, t.shape)


LAUNCH_BYTES = 2 << 30
"""Sources per copy-and-hash launch of a direct write. On an H200 (7B shape, 310 bf16 tensors, 2026-12-03) the
write took 20.4 ms in 512 MB launches, 13.2 ms in 2 GiB ones and 14.7 ms in one launch (whose host work all comes
before it), with the host work per launch of then; since the launches' tables are kept (checksum_kernels.launch)
the sizes matter less: 7.02 ms in 2 GiB launches, 7.35 ms in one (`benchmarks/bench_direct_write.py`, same call);
docs/benchmarks.md."""
FIRST_LAUNCH_BYTES = 256 << 20
"""Sources of the first launch: the GPU idles until it is issued, the later ones are prepared while it runs (the
same H200 call: 6.86 ms with a 256 MiB first launch, 7.02 ms without)."""


def write_and_hash(
    items: Iterable[tuple[torch.Tensor, list[torch.Tensor]] | tuple[torch.Tensor, list[torch.Tensor], bool]],
    batch_bytes: int,
    launch_bytes: int | None = None,
    first_bytes: int | None = None,
) -> torch.Tensor:
    """Write each source into each of its destinations (same dtype and shape) and return the lanes of what was
    written, int64 [n, 2] on the sources' device (no host read). Sources go in batches: one pass copies a batch
    into the first destinations and hashes what it wrote (`checksum.copy_with_lanes`, one Triton launch on a
    GPU); further destinations get plain copies. An item may say whether its source is a temporary (a cast made
    for this write; a 2-tuple is one): a batch holds at most about `batch_bytes` of temporaries, which stay
    referenced until it is written, and about `launch_bytes` of sources in all (`first_bytes` the first one;
    defaults `LAUNCH_BYTES`, `FIRST_LAUNCH_BYTES`)."""
    launch_bytes = LAUNCH_BYTES if launch_bytes is None else launch_bytes
    limit = FIRST_LAUNCH_BYTES if first_bytes is None else first_bytes
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
        nbytes = src.nbytes
        held += nbytes if len(item) < 3 or item[2] else 0
        size += nbytes
        if held >= batch_bytes or size >= min(limit, launch_bytes):
            flush()
            held = size = 0
            limit = launch_bytes
    if batch:
        flush()
    return torch.cat(lanes) if lanes else torch.zeros(0, 2, dtype=torch.int64)
