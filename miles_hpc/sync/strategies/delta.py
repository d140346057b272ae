"""Delta weight sync over files, the trainer side (stage: sync; docs/design.md section 6, for links without RDMA).

Trainer rank 0 keeps, per HF tensor name, the last PUBLISHED tensor in the rollout dtype (on `DeltaSpec.device`),
and the version it belongs to (the base). `push(named, version)`:
1. asks every engine which weights it holds (`/get_model_info`): an engine at another version than the base, or
   half-updated, cannot apply a delta and gets the full tensors instead (a restarted engine back at "0");
2. codes the tensors against their kept copies in groups of up to `group_bytes` (one payload for the concatenation
   of a group: the codec's fixed cost per call is paid once per group; a tensor without a kept copy goes "full"
   alone) on `device` (the CPU, or the trainer's GPU where the codec runs ~300x faster) and writes
   ``RUN/weights/v<version>/`` (`delta_manifest.VersionWriter`: payload files + manifest, write-then-rename), plus
   ``v<version>/full/`` with every tensor "full" only when step 1 found an engine that needs it;
3. calls ``POST /update_weights_from_delta`` on every engine concurrently (the engine reads the files, decodes
   against its own tensors, verifies each tensor's checksum, applies, sets `weight_version`);
4. once EVERY engine succeeded, the new tensors become the kept copies and the version the base (a failed push
   never moves the base: the next push codes against what the engines still hold), then version directories
   beyond `keep_versions` are removed.
Returns the checksums of the new tensors (what the publisher verifies); engines whose call failed raise
`EngineSyncError` naming them. The publisher (publish.py) pauses and continues the engines around all this.

Memory: one rollout-dtype copy of the model on trainer rank 0 (the kept copies: host memory, or the GPU with
`device=None`), and during a push a second one (the new tensors, until every engine has them; unchanged groups
share the kept copy). Only the
embedded engine serves the endpoint (it is our extension, docs/engine.md), and engines must run in the rollout
dtype: a delta of bfloat16 values means nothing to a float32 engine, which answers 400 naming the tensor.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.codec.delta_codec import DeltaPayload, encode, encode_full
from miles_hpc.sync.codec.delta_manifest import Manifest, VersionWriter, prune_versions
from miles_hpc.sync.protocol import EngineSyncError, WeightSyncError, verify_checksums
from miles_hpc.sync.strategies.base import Strategy
from miles_hpc.sync.wire.checksum import tensor_checksums

__all__ = ["DeltaSpec", "DeltaSync", "Staged"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaSpec:
    run_dir: Path
    """The run directory: versions go to RUN/weights/v<N>/ (on a file system every engine node can read)."""
    rollout_dtype: torch.dtype | None = None
    """The engines' dtype; tensors are cast to it before coding (None: the trainer's dtype)."""
    keep_versions: int = 2
    """Version directories kept after a successful push (the newest; older ones and leftovers are removed)."""
    timeout_s: float = 600.0
    """Seconds one engine may take to read and apply a version."""
    shard_bytes: int = 1 << 30
    """A payload file is closed and the next one started once it holds this many bytes."""
    group_bytes: int = 256 << 20
    """Consecutive tensors of one dtype are coded as one payload up to this many bytes."""
    device: str | None = "cpu"
    """Where the kept copies live and the codec runs: a torch device, or None for the device of the tensors the
    trainer publishes (its GPU: fast coding, at the price of a rollout-dtype copy of the model in its memory)."""

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1 (the version just published), got {self.keep_versions}")
        if self.timeout_s <= 0 or self.shard_bytes <= 0 or self.group_bytes <= 0:
            raise ValueError("timeout_s, shard_bytes and group_bytes must be positive")

    @property
    def weights_dir(self) -> Path:
        return Path(self.run_dir) / "weights"


@dataclass(slots=True)
class Staged:
    """One version written to disk, not yet applied by the engines."""

    version: str
    base_version: str | None
    directory: Path  # v<N>/: the delta against base_version (all "full" when there is no base)
    full_directory: Path | None = None  # v<N>/full/ when some engine needs every tensor; v<N>/ when no base
    manifest: Manifest | None = None  # set once written
    checksums: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the new kept copies, once every engine has them


class DeltaSync(Strategy):
    """The "delta" strategy (module docstring). Not thread-safe: one push at a time, from one event loop."""

    name = "delta"
    takes_named = True
    verify = staticmethod(verify_checksums)

    def __init__(self, spec: DeltaSpec) -> None:
        self.spec = spec
        self._clients: list[EngineClient] = []
        self._kept: dict[str, torch.Tensor] = {}  # HF name -> last published tensor, rollout dtype
        self.base_version: str | None = None  # the version of `_kept` (None: nothing published yet)

    @property
    def clients(self) -> Sequence[EngineClient]:
        return tuple(self._clients)

    async def connect(self, clients: Sequence[EngineClient]) -> None:
        """Nothing to build (files are the transport); remember the engines and make the weights directory."""
        await asyncio.to_thread(self.spec.weights_dir.mkdir, parents=True, exist_ok=True)
        self._clients = list(clients)

    async def close(self) -> None:
        """Forget the engines; the kept copies stay (they are the base of the next push)."""
        self._clients = []

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, str]:
        if not self._clients:
            raise WeightSyncError("push before connect()")
        lagging = await self.lagging()
        staged = await self.stage(named, version, full=bool(lagging))
        await self.send(staged, lagging)
        self.commit(staged)
        return dict(staged.checksums)

    async def lagging(self) -> set[str]:
        """URLs of the engines that cannot apply a delta against the base: another version, or half-updated."""
        if self.base_version is None:
            return {c.url for c in self._clients}
        answers = await asyncio.gather(*(c.model_info() for c in self._clients), return_exceptions=True)
        failed = [(c.url, a) for c, a in zip(self._clients, answers) if isinstance(a, BaseException)]
        if failed:
            raise EngineSyncError(
                [u for u, _ in failed], f"asking {failed[0][0]} for its weight version failed: {failed[0][1]}"
            )
        out = set()
        for c, info in zip(self._clients, answers):
            assert isinstance(info, dict)
            if str(info.get("weight_version")) != self.base_version or info.get("weights_half_updated"):
                log.info(
                    "delta sync: %s holds weight version %r, not the base %r: it gets full tensors",
                    c.url,
                    info.get("weight_version"),
                    self.base_version,
                )
                out.add(c.url)
        return out

    async def stage(self, named: Iterable[tuple[str, torch.Tensor]], version: str, *, full: bool) -> Staged:
        """Code every tensor against its kept copy and write ``v<version>/`` (and ``v<version>/full/`` when `full`
        and there is a base). The iterator is stepped here, on the caller's thread (on trainer ranks it runs
        collectives); coding and writing run in a worker thread, so the event loop keeps serving."""
        final = self.spec.weights_dir / f"v{version}"
        base = self.base_version
        writer = await asyncio.to_thread(
            VersionWriter, final, version=version, base_version=base, shard_bytes=self.spec.shard_bytes
        )
        full_writer: VersionWriter | None = None
        staged = Staged(version=str(version), base_version=base, directory=final)
        try:
            if full and base is not None:
                # Inside v<N>.partial/: renamed together with the delta, so v<N>/full/ appears with v<N>/.
                full_writer = await asyncio.to_thread(
                    VersionWriter,
                    writer.partial / "full",
                    version=version,
                    base_version=None,
                    shard_bytes=self.spec.shard_bytes,
                )
            group: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, t in named:  # the tensors stay valid until their group is staged (as for every strategy)
                dtype = self.spec.rollout_dtype or t.dtype
                if group and (
                    size + t.numel() * dtype.itemsize > self.spec.group_bytes
                    or dtype != (self.spec.rollout_dtype or group[0][1].dtype)
                ):
                    await asyncio.to_thread(self._stage_group, staged, writer, full_writer, group)
                    group, size = [], 0
                group.append((name, t))
                size += t.numel() * dtype.itemsize
            if group:
                await asyncio.to_thread(self._stage_group, staged, writer, full_writer, group)
            if full_writer is not None:
                await asyncio.to_thread(full_writer.commit)
            staged.manifest = await asyncio.to_thread(writer.commit)
        except BaseException:
            if full_writer is not None:
                full_writer.abort()
            writer.abort()
            raise
        if base is None:
            staged.full_directory = final
        elif full_writer is not None:
            staged.full_directory = final / "full"
        m = staged.manifest
        assert m is not None
        log.info(
            "delta sync: v%s against %s: %d tensors, %.3g MB of %.3g MB full",
            version,
            base,
            len(m.tensors),
            m.total_bytes / 1e6,
            m.full_bytes / 1e6,
        )
        return staged

    def _own_copy(self, t: torch.Tensor) -> torch.Tensor:
        device = t.device if self.spec.device is None else torch.device(self.spec.device)
        new = t.detach().to(device=device, dtype=self.spec.rollout_dtype or t.dtype).contiguous()
        if new.data_ptr() == t.data_ptr():
            new = new.clone()  # the trainer may change its tensor in place after this: keep our own copy
        return new

    def _stage_group(
        self,
        staged: Staged,
        writer: VersionWriter,
        full_writer: VersionWriter | None,
        group: list[tuple[str, torch.Tensor]],
    ) -> None:
        """Code consecutive tensors of one dtype: one payload for all of them when each has a kept copy of its
        layout, else each alone ("full" where there is nothing to code against)."""
        group = [(name, self._own_copy(t)) for name, t in group]
        kept = [self._kept.get(name) for name, _ in group]
        codable = all(
            k is not None and k.shape == t.shape and k.dtype == t.dtype and k.device == t.device
            for k, (_, t) in zip(kept, group)
        )
        if len(group) == 1 or not codable:
            for (name, new), old in zip(group, kept):
                self._stage_one(staged, writer, full_writer, name, new, old)
            return
        old_flat = torch.cat([k.reshape(-1) for k in kept])  # type: ignore[union-attr]
        new_flat = torch.cat([t.reshape(-1) for _, t in group])
        payload = encode(old_flat, new_flat)  # "same", "delta", or "full" when the delta is not smaller
        sums = tensor_checksums(group)
        members = [(name, tuple(t.shape), sums[name]) for name, t in group]
        writer.add_group(members, payload)
        if full_writer is not None:
            full = payload if payload.kind == "full" else encode_full(new_flat, payload.checksum)
            full_writer.add_group(members, full)
        staged.checksums.update(sums)
        at = 0
        for (name, t), old in zip(group, kept):
            # The kept copies become views of the group's buffer (unchanged groups keep the old ones).
            if payload.kind == "same" and old is not None:
                staged.tensors[name] = old
            else:
                staged.tensors[name] = new_flat[at : at + t.numel()].view(t.shape)
            at += t.numel()

    def _stage_one(
        self,
        staged: Staged,
        writer: VersionWriter,
        full_writer: VersionWriter | None,
        name: str,
        new: torch.Tensor,
        kept: torch.Tensor | None,
    ) -> None:
        payload: DeltaPayload
        if kept is not None and kept.shape == new.shape and kept.dtype == new.dtype and kept.device == new.device:
            payload = encode(kept, new)  # "same", "delta", or "full" when the delta is not smaller
        else:  # no kept copy (first push, a new name) or another layout: nothing to code against
            payload = encode_full(new)
        writer.add(name, payload)
        if full_writer is not None:
            full_writer.add(name, payload if payload.kind == "full" else encode_full(new, payload.checksum))
        staged.checksums[name] = payload.checksum
        staged.tensors[name] = kept if payload.kind == "same" and kept is not None else new

    async def send(self, staged: Staged, lagging: set[str]) -> None:
        """Every engine applies the staged version: the delta, or the full tensors for `lagging` engines."""
        sources: list[tuple[Path, str | None]] = []  # per engine: (directory, base_version)
        for c in self._clients:
            if c.url not in lagging and staged.base_version is not None:
                sources.append((staged.directory, staged.base_version))
            elif staged.full_directory is not None:
                sources.append((staged.full_directory, None))
            else:
                raise WeightSyncError(f"{c.url} needs full tensors, but v{staged.version} was staged without them")
        calls = [
            c.update_weights_from_delta(
                str(d), base_version=base, weight_version=staged.version, flush_cache=True, timeout=self.spec.timeout_s
            )
            for c, (d, base) in zip(self._clients, sources)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(c.url, r) for c, r in zip(self._clients, results) if isinstance(r, BaseException)]
        if failed:
            url, err = failed[0]
            raise EngineSyncError(
                [u for u, _ in failed],
                f"applying weight version {staged.version} from {staged.directory} failed on {url}: {err}",
            )

    def commit(self, staged: Staged) -> None:
        """Every engine holds `staged`: it becomes the base, and old version directories go."""
        self._kept, self.base_version = staged.tensors, staged.version
        self.prune(keep=staged.directory)

    def prune(self, keep: Path) -> None:
        """Remove version directories but the newest `keep_versions` (`keep` counts as the newest) and leftovers
        of interrupted writes (``*.partial``, ``*.stale-*``)."""
        for p in prune_versions(self.spec.weights_dir, keep, self.spec.keep_versions):
            log.debug("delta sync: removed %s", os.fspath(p))
