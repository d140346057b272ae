"""The receiving side of distributed weight updates (SGLang's ``/init_weights_update_group`` and
``/update_weights_from_distributed``).

Stage: engine (weight sync, engine side). The trainer's rank 0 creates a process group spanning itself (rank 0) and
every engine rank (``rank_offset + tp_rank``; this engine is TP 1, so one rank) with ``sync/wire/pg.py`` and announces
each bucket over HTTP: names, dtypes, shapes. The engine allocates those tensors, receives each by broadcast from
rank 0 in the announced order, and hands them to ``Engine.update_weights``, which applies them between steps.

Invariants:
- Every method blocks (joining waits for the trainer; receiving waits for its broadcasts): the server calls them in
  worker threads, never on the event loop, because the trainer joins/broadcasts concurrently with the HTTP call.
- A bucket is received completely even when a name turns out to be unknown to the model: skipping a broadcast
  would leave the trainer blocked and every later bucket misaligned. The error is reported after the receive.
- Tensors arrive exactly as sent (dtype and bits); casting to the engine's dtype is ``update_weights``' job, so
  checksums of what was sent can be compared with what was received.
- One group per ``group_name``; joining a name twice is an error (SGLang's too), ``destroy`` frees it. A receive
  that fails (a member of the group died) destroys the group on this engine at once (``_breaks``): a broken group
  cannot carry another bucket, and closing this rank's connections frees the members waiting on it.

:class:`WeightEndpoints` holds the HTTP handlers of every way new weights reach this engine (disk, tensor,
distributed, and our delta files: delta_receiver.py), of the weight version and of ``/weights_checker``; they
answer SGLang's ``{success, message}`` (400 on failure) and run one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from miles_hpc.faults import crash_point
from miles_hpc.sync.wire.pg import GroupSpec, open_group
from miles_hpc.sync.wire.tensor_handles import load_flattened_bucket, load_named_tensors

from . import protocol
from .core import Engine, RequestError
from .delta_receiver import apply_version
from .direct_weights import weight_handles
from .pause_lease import PauseLease

if TYPE_CHECKING:
    from .tp import TPDriver

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in protocol.DTYPE_NAMES if hasattr(torch, n)}

GroupFactory = Callable[[GroupSpec, str | None], Any]  # a CustomGroup, or an MPIGroup for backend "mpi"


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinRequest:
    """The fields of ``/init_weights_update_group`` (SGLang's ``InitWeightsUpdateGroupReqInput``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class WeightReceiver:
    """Process groups this engine joined for weight updates, by name, and the receive of one bucket."""

    def __init__(
        self,
        device: str,
        *,
        timeout_s: float = 600.0,
        make_group: GroupFactory | None = None,
        tp: TPDriver | None = None,
    ) -> None:
        """``device``: the engine's torch device (NCCL groups receive there; gloo groups receive on the CPU).
        ``make_group`` builds the group (default ``sync.wire.pg.open_group``; tests inject fakes).
        ``tp``: a tensor-parallel engine's rank 0: its other ranks join at ``rank_offset + tp_rank`` and receive
        every broadcast too, each keeping its part (engine/tp.py), as SGLang's TP ranks do."""
        self._tp = tp
        self._device = device
        self._timeout_s = timeout_s
        self._make_group: GroupFactory = make_group or (lambda spec, dev: open_group(spec, dev))
        self._groups: dict[str, Any] = {}
        self._joining: set[str] = set()
        self._lock = threading.Lock()  # guards the two containers; joins and receives run outside it

    def join(self, req: JoinRequest) -> None:
        """Join the group (blocks until the trainer and every other engine rank have joined, or the timeout)."""
        if req.backend == "nccl" and not torch.device(self._device).type == "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA engine; this one runs on {self._device}: use 'gloo'")
        with self._lock:
            if req.group_name in self._groups or req.group_name in self._joining:
                raise ValueError(f"weight update group {req.group_name!r} already exists on this engine")
            self._joining.add(req.group_name)
        try:
            if self._tp is not None and req.backend == "mpi":
                raise ValueError("backend 'mpi' weight-update groups are for engines of tp_size 1: use gloo or nccl")
            spec = GroupSpec(
                backend=req.backend,  # type: ignore[arg-type]  # any string: GroupSpec checks it
                master_address=req.master_address,
                master_port=req.master_port,
                rank=req.rank_offset,  # + tp_rank, 0 here: the other TP ranks join in tp.py
                world_size=req.world_size,
                group_name=req.group_name,
                timeout_s=self._timeout_s,
            )
            device = None if req.backend == "gloo" else self._device
            if self._tp is None:
                group = self._make_group(spec, device)
            else:
                group = self._tp.join_group(spec, lambda: self._make_group(spec, device))
            with self._lock:
                self._groups[req.group_name] = group
        finally:
            with self._lock:
                self._joining.discard(req.group_name)

    def receive(
        self, group_name: str, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Allocate and receive one announced bucket, in order, by broadcast from rank 0. On a tensor-parallel
        engine its other ranks receive the same broadcasts and apply their parts at once: call this between the
        engine's steps (`Engine.update_weights_from_group`)."""
        group = self._group(group_name)
        bad = [(n, d) for n, d in zip(names, dtypes, strict=True) if d not in TORCH_DTYPES]
        if bad:
            raise ValueError(f"tensor {bad[0][0]!r}: unknown dtype {bad[0][1]!r}")
        with self._breaks(group_name):
            if self._tp is not None:
                self._tp.receive_group(group_name, names, dtypes, shapes)
            bucket: list[tuple[str, torch.Tensor]] = []
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(tuple(shape), dtype=TORCH_DTYPES[dtype], device=group.device)
                group.broadcast(t, src=0)
                bucket.append((name, t))
                crash_point("engine:receiving")  # a tensor of an update received, the update unfinished
        return bucket

    def receive_pieces(
        self,
        group_name: str,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        pieces: Sequence[Sequence[tuple[int, tuple[tuple[int, int], ...]]]],
        tp_pieces: Sequence[Sequence[Sequence[tuple[int, tuple[tuple[int, int], ...]]]]] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Allocate one announced bucket and receive each tensor's pieces from the trainer ranks that hold them
        (the p2p strategy): receives are posted in the announced order, which is the order the ranks send in.
        The pieces of a tensor must cover it exactly once (checked before anything is posted). `tp_pieces` (a
        tensor-parallel engine, resharded): every rank receives its own parts, rank 0 returns its parts; call it
        between the engine's steps."""
        for name, dtype in zip(names, dtypes, strict=True):
            if dtype not in TORCH_DTYPES:
                raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if tp_pieces is None or self._tp is None:
            if tp_pieces is not None:
                raise ValueError("tp_pieces: this engine is not tensor-parallel")
            for name, shape, ps in zip(names, shapes, pieces, strict=True):
                _check_cover(name, shape, [dims for _, dims in ps])
            group = self._group(group_name)
            with self._breaks(group_name):
                return receive_into(group, names, dtypes, shapes, pieces)
        shard = self._tp.shard
        for name, ranks in zip(names, tp_pieces, strict=True):
            if len(ranks) != shard.tp:
                raise ValueError(f"tensor {name!r}: tp_pieces for {len(ranks)} ranks, this engine has {shard.tp}")
            for r, ps in enumerate(ranks):
                _check_cover(name, shard.part_shape(name, r), [dims for _, dims in ps])
        group = self._group(group_name)
        for name, ranks in zip(names, tp_pieces, strict=True):  # before any rank posts a receive
            bad = [src for ps in ranks for src, _ in ps if not 0 <= src < group.world_size]
            if bad:
                raise ValueError(
                    f"tensor {name!r}: piece from rank {bad[0]}, outside the {group.world_size}-rank group"
                )
        mine = [ranks[0] for ranks in tp_pieces]
        with self._breaks(group_name):
            self._tp.receive_parts(group_name, names, dtypes, tp_pieces)
            return receive_into(group, names, dtypes, [shard.part_shape(n) for n in names], mine)

    @contextlib.contextmanager
    def _breaks(self, group_name: str) -> Iterator[None]:
        """Around a collective of `group_name`: when it fails (a member died) the group is broken for everyone, so
        it is destroyed here at once, closing this rank's connections: members waiting on this one (a broadcast
        tree passes through engine ranks) then fail too instead of waiting out their timeout. Then the other
        tensor-parallel ranks are told (after, not before: one may be waiting on this rank). The trainer's next
        connect makes a new group."""
        try:
            yield
        except BaseException:
            with self._lock:
                group = self._groups.pop(group_name, None)
            if group is not None:
                group.destroy()
                if self._tp is not None:
                    try:
                        self._tp.destroy_group(group_name)
                    except Exception as e:  # noqa: BLE001 (a rank gone: the engine is going down anyway)
                        log.warning("destroying group %r on the other ranks: %s", group_name, e)
            raise

    def destroy(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise KeyError(f"no weight update group {group_name!r} on this engine")
        if self._tp is not None:
            self._tp.destroy_group(group_name)
        group.destroy()

    def destroy_all(self) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for g in groups:
            g.destroy()

    def group_names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def _group(self, name: str) -> Any:
        with self._lock:
            if name not in self._groups:
                raise KeyError(f"no weight update group {name!r} on this engine: call /init_weights_update_group")
            return self._groups[name]


def receive_into(
    group: Any,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    pieces: Sequence[Sequence[tuple[int, tuple[tuple[int, int], ...]]]],
) -> list[tuple[str, torch.Tensor]]:
    """Tensors of `shapes`, each filled by its pieces ``(group rank, dims)`` received in the listed order."""
    for name, ps in zip(names, pieces, strict=True):
        bad = [src for src, _ in ps if not 0 <= src < group.world_size]
        if bad:
            raise ValueError(f"tensor {name!r}: piece from rank {bad[0]}, outside the {group.world_size}-rank group")
    bucket: list[tuple[str, torch.Tensor]] = []
    recvs: list[tuple[torch.Tensor, int]] = []
    landing = []
    for name, dtype, shape, ps in zip(names, dtypes, shapes, pieces, strict=True):
        t = torch.empty(tuple(shape), dtype=TORCH_DTYPES[dtype], device=group.device)
        for src, dims in ps:
            view = t[tuple(slice(lo, hi) for lo, hi in dims)]
            buf = view if view.is_contiguous() else torch.empty_like(view, memory_format=torch.contiguous_format)
            recvs.append((buf, src))
            if buf is not view:
                landing.append((view, buf))
        bucket.append((name, t))
    group.exchange([], recvs)
    for view, buf in landing:
        view.copy_(buf)
    return bucket


def _check_cover(name: str, shape: Sequence[int], boxes: Sequence[tuple[tuple[int, int], ...]]) -> None:
    """The boxes tile the tensor: inside it, pairwise disjoint, as many elements as it has."""
    total = 1
    for n in shape:
        total *= n
    sizes = []
    for dims in boxes:
        size = 1
        for lo, hi in dims:
            size *= hi - lo
        sizes.append(size)
    overlap = any(
        all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(x, y)) for i, x in enumerate(boxes) for y in boxes[i + 1 :]
    )
    if overlap or sum(sizes) != total:
        raise ValueError(f"tensor {name!r}: the announced pieces do not cover shape {list(shape)} exactly once")


# ---------------------------------------------------------------------------------------------- HTTP handlers
ReadJson = Callable[[web.Request, int | None], Awaitable[Any]]


def _answer(body: dict[str, Any], success: bool = True) -> web.Response:
    return web.json_response({"success": success, **body}, status=200 if success else 400)


class WeightEndpoints:
    """Handlers of the weight routes (all admin-level, see miles_hpc/auth.py), over one engine and its WeightReceiver."""

    def __init__(
        self,
        engine: Engine,
        receiver: WeightReceiver,
        read_json: ReadJson,
        max_tensor_bytes: int,
        *,
        lease: PauseLease | None = None,
        on_unknown: protocol.Unknown = protocol.ignore_quietly,
    ) -> None:
        """``lease``: held while an update runs, also past its client's disconnect (see ``_apply``); ``on_unknown``:
        told each body key that SGLang's endpoints ignore (protocol.parse_control)."""
        self.engine = engine
        self._on_unknown = on_unknown
        self.receiver = receiver
        self._json = read_json
        self._max_tensor_bytes = max_tensor_bytes
        self._lease = lease
        self._lock = asyncio.Lock()  # weight changes one at a time, in arrival order

    def routes(self) -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
        return {
            "/update_weight_version": self.update_weight_version,
            "/weights_checker": self.weights_checker,
            "/update_weights_from_disk": self.update_from_disk,
            "/update_weights_from_tensor": self.update_from_tensor,
            "/init_weights_update_group": self.init_group,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_delta": self.update_from_delta,  # our extension (delta_receiver.py)
            "/update_weights_from_p2p": self.update_from_p2p,  # our extension (the p2p strategy)
            "/weights_piece_checksums": self.piece_checksums,  # our extension (p2p verification)
            "/weights_ipc_handles": self.ipc_handles,  # our extension: direct writes (direct_weights.py)
            "/weights_direct_begin": self.direct_begin,  # our extension
            "/weights_direct_commit": self.direct_commit,  # our extension
        }

    async def _parse(self, endpoint: str, request: web.Request, limit: int | None = None) -> dict[str, Any]:
        return protocol.parse_control(endpoint, await self._json(request, limit), self._on_unknown)

    async def _apply(self, p: dict[str, Any], work: Callable[[], object], ok: str, **extra: object) -> web.Response:
        """Serialised; abort first when asked; run `work` in a thread; SGLang's success/failure answer.

        Shielded: a worker thread cannot be cancelled, so when the client disconnects the update still runs to its
        end holding the lock; otherwise the next update (say, the trainer's retry) would overlap a receive."""

        async def locked() -> web.Response:
            # A pause must not end by its lease while an update runs (the middleware's hold ends with the request).
            with self._lease.hold() if self._lease is not None else contextlib.nullcontext():
                async with self._lock:
                    if p.get("abort_all_requests"):
                        await asyncio.to_thread(self.engine.abort, None)
                    try:
                        await asyncio.to_thread(work)
                    except (RequestError, ValueError, KeyError, OSError, RuntimeError) as e:
                        log.warning("weight update failed: %s", e)
                        return _answer({"message": f"Failed to update weights: {e}", **extra}, False)
                return _answer({"message": ok, **extra})

        return await asyncio.shield(asyncio.ensure_future(locked()))

    async def update_weight_version(self, request: web.Request) -> web.Response:
        p = await self._parse("update_weight_version", request)
        v = p["new_version"]

        def work() -> None:
            self.engine.set_weight_version(v)

        return await self._apply(p, work, f"Weight version updated to {v}", new_version=v)

    async def weights_checker(self, request: web.Request) -> web.Response:
        p = await self._parse("weights_checker", request)
        sums = await asyncio.to_thread(self.engine.checksums)
        sums = {k: v for k, v in sums.items() if not any(s in k for s in p["skip_tensor_list"])}
        return web.json_response(checksum_response(sums, self.engine.weight_version))

    async def update_from_disk(self, request: web.Request) -> web.Response:
        p = await self._parse("update_weights_from_disk", request)

        def work() -> None:
            self.engine.update_weights_from_disk(
                p["model_path"], version=p["weight_version"], flush_cache=p["flush_cache"]
            )
            if p["keep_pause"]:  # SGLang pauses around a disk update; keep_pause leaves it paused (in place)
                self.engine.pause("in_place")

        return await self._apply(p, work, "Succeeded to update model weights.", num_paused_requests=0)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """``serialized_named_tensors``: one entry per TP rank (one here), each base64 of either
        - SGLang's ``MultiprocessingSerializer`` pickle of ``[(hf_name, tensor)]`` holding CUDA IPC handles or our
          shared-memory slices (the ``colocated`` strategy), opened by the restricted unpickler of
          tensor_handles.py, never by ``pickle.loads``; or
        - a safetensors file (``safetensors.torch.save({hf_name: tensor})``; ``load_format="safetensors"``, or
          recognised by its header when ``load_format`` is absent);
        - with ``load_format="flattened_bucket"``, SGLang's one-tensor-per-bucket pickle (``{"flattened_tensor",
          "metadata"}``): one handle for the whole bucket (tensor_handles.load_flattened_bucket).
        The tensors are copied into the model once and dropped (that releases the handles)."""
        p = await self._parse("update_weights_from_tensor", request, self._max_tensor_bytes)
        blobs = p["serialized_named_tensors"]
        if len(blobs) != 1:
            raise protocol.BadRequest(
                f"field `serialized_named_tensors`: one entry per TP rank (tp_size 1), got {len(blobs)}"
            )

        def work() -> None:
            from safetensors import SafetensorError
            from safetensors.torch import load

            try:
                raw = base64.b64decode(blobs[0], validate=True)
            except binascii.Error as e:
                raise ValueError(f"serialized_named_tensors[0] is not base64: {e}") from e
            # A safetensors file starts with its header length (8 bytes) and the header's "{"; a pickle with 0x80.
            if p["load_format"] == "flattened_bucket":
                named = load_flattened_bucket(raw, self.engine.device)
            elif p["load_format"] is None and raw[:1] == b"\x80" and raw[8:9] != b"{":
                named = load_named_tensors(raw, self.engine.device)
            else:
                try:
                    named = list(load(raw).items())
                except SafetensorError as e:
                    raise ValueError(f"serialized_named_tensors[0] is not base64 safetensors: {e}") from e
            try:
                self.engine.update_weights(named, version=p["weight_version"], flush_cache=p["flush_cache"])
            finally:
                named.clear()  # the last references: CUDA IPC handles and shared-memory mappings go now

        return await self._apply(p, work, "Succeeded to update model weights.")

    async def init_group(self, request: web.Request) -> web.Response:
        p = await self._parse("init_weights_update_group", request)
        fields = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
        try:  # not under the lock: joining waits for the trainer, which may want other answers first
            await asyncio.shield(asyncio.to_thread(self.receiver.join, JoinRequest(**{k: p[k] for k in fields})))
        except Exception as e:  # noqa: BLE001 (torch raises several types; all mean "not joined")
            return _answer({"message": f"Failed to initialize custom process group: {e}."}, False)
        return _answer({"message": "Succeeded to initialize custom process group."})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        p = await self._parse("update_weights_from_distributed", request)

        def work() -> None:
            def receive() -> list[tuple[str, torch.Tensor]]:
                return self.receiver.receive(p["group_name"], p["names"], p["dtypes"], p["shapes"])

            self.engine.update_weights_from_group(receive, version=p["weight_version"], flush_cache=p["flush_cache"])

        return await self._apply(p, work, "Succeeded to update parameter online.")

    async def update_from_p2p(self, request: web.Request) -> web.Response:
        """One bucket sent point-to-point by the trainer ranks (``pieces``: what comes from which rank)."""
        p = await self._parse("update_weights_from_p2p", request)

        def work() -> None:
            def receive() -> list[tuple[str, torch.Tensor]]:
                args = (p["group_name"], p["names"], p["dtypes"], p["shapes"], p["pieces"])
                return self.receiver.receive_pieces(*args, tp_pieces=p.get("tp_pieces"))

            tp = p.get("tp_pieces") is not None
            self.engine.update_weights_from_group(
                receive, version=p["weight_version"], flush_cache=p["flush_cache"], parts=tp
            )

        return await self._apply(p, work, "Succeeded to update parameter online.")

    async def piece_checksums(self, request: web.Request) -> web.Response:
        p = await self._parse("weights_piece_checksums", request)
        try:
            sums = await asyncio.to_thread(self.engine.piece_checksums, dict(zip(p["names"], p["boxes"])))
        except (KeyError, ValueError) as e:
            return _answer({"message": f"Failed to compute piece checksums: {e}"}, False)
        return web.json_response(
            {
                "success": True,
                "message": f"checksums of {len(sums)} pieces",
                "checksums": sums,
                "weight_version": self.engine.weight_version,
            }
        )

    async def ipc_handles(self, request: web.Request) -> web.Response:
        """CUDA IPC handles of every parameter and where each HF tensor lies in them (direct_weights.py)."""
        await self._parse("weights_ipc_handles", request)
        try:
            body = await asyncio.to_thread(weight_handles, self.engine.model, self.engine.instance_id)
        except ValueError as e:
            return _answer({"message": f"Failed to share weight handles: {e}"}, False)
        return web.json_response({"success": True, **body})

    async def direct_begin(self, request: web.Request) -> web.Response:
        """A colocated trainer starts writing into the weights (paused engines only; half-updated until commit)."""
        await self._parse("weights_direct_begin", request)
        async with self._lock:
            try:
                instance = await asyncio.to_thread(self.engine.begin_direct_write)
            except RequestError as e:
                return _answer({"message": f"Failed to begin a direct weight write: {e}"}, False)
        return _answer({"message": "direct weight write begun", "instance": instance})

    async def direct_commit(self, request: web.Request) -> web.Response:
        p = await self._parse("weights_direct_commit", request)

        def work() -> None:
            self.engine.commit_direct_write(version=p["weight_version"], flush_cache=p["flush_cache"])

        return await self._apply(p, work, "Succeeded to update model weights.")

    async def update_from_delta(self, request: web.Request) -> web.Response:
        """Apply a version written by the delta strategy (``manifest_path``: its directory); delta_receiver.py."""
        p = await self._parse("update_weights_from_delta", request)

        def work() -> None:
            apply_version(
                self.engine,
                p["manifest_path"],
                base_version=p["base_version"],
                weight_version=p["weight_version"],
                flush_cache=p["flush_cache"],
            )

        return await self._apply(p, work, "Succeeded to update model weights from delta.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        p = await self._parse("destroy_weights_update_group", request)
        try:
            await asyncio.to_thread(self.receiver.destroy, p["group_name"])
        except KeyError:
            return _answer({"message": "The group to be destroyed does not exist."}, False)
        return _answer({"message": "Succeeded to destroy custom process group."})


def checksum_response(sums: dict[str, str], weight_version: str) -> dict[str, Any]:
    """SGLang's /weights_checker answer for one TP rank (its per-rank list, hashed as SGLang hashes), plus our
    top-level ``checksums`` (HF names -> ``sync.wire.checksum.tensor_checksum``) and ``weight_version``."""
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(name.encode())
        h.update(sums[name].encode())
    per_gpu = h.hexdigest()
    info = {
        "role": "target",
        "tp_rank": 0,
        "tp_size": 1,
        "dp_rank": 0,
        "dp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "rank": 0,
        "size": 1,
    }
    return {
        "success": True,
        "message": f"checksums of {len(sums)} tensors",
        "ranks": [{"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [info]}],
        "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
        "checksums": sums,
        "weight_version": weight_version,
    }
