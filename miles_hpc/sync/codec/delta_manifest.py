"""On-disk format of a published weight version of the "delta" strategy: payload files plus a manifest.

Stage: sync (pure: imports only `atomic` and the codec, so the engine reads what the trainer writes with this same
module). Layout, under ``RUN/weights/``::

    v<N>/manifest.json            what changed since base_version (kinds same | delta | full), or all "full"
    v<N>/payload-00000.bin ...    `delta_codec.to_bytes` frames, back to back, a few frames per file
    v<N>/full/manifest.json       only when some engine lacks the base: every tensor "full", base_version null
    v<N>/full/payload-00000.bin ...

``manifest.json``::

    {"format": "miles-hpc-weights/2", "version": "3", "base_version": "2",
     "tensors": [{"name": HF name, "file": "payload-00000.bin", "offset": 0, "length": 123, "kind": "delta",
                  "dtype": "bfloat16", "shape": [64, 32], "checksum": tensor_checksum of the new tensor,
                  "elem_offset": null}, ...],
     "total_bytes": sum of the frames' lengths, "full_bytes": bytes of the new tensors themselves}

A frame codes one tensor (``elem_offset`` null: the frame's shape and checksum are the tensor's) or a group of
tensors coded as one (their flat concatenation, in ``elem_offset`` order): every entry of a group names the same
file, offset, length, kind and dtype, and its ``elem_offset`` is where its values start in the concatenation; its
checksum is of the tensor itself (the frame's own checksum covers the concatenation).

Invariants: a reader never sees a half-written version: `VersionWriter` writes into ``v<N>.partial/``, fsyncs the
payloads and the manifest, then renames the directory to ``v<N>/`` (a rename is atomic on POSIX file systems); an
error while writing removes the partial directory. `base_version` null means every entry is "full" (no base
needed). Every reading error (`ManifestError`) names the manifest or payload file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Self

from miles_hpc.atomic import write_text_atomic
from miles_hpc.sync.codec.delta_codec import DeltaError, DeltaPayload, from_bytes, to_bytes

__all__ = [
    "FORMAT",
    "MANIFEST",
    "PARTIAL",
    "Entry",
    "Manifest",
    "ManifestError",
    "VersionWriter",
    "prune_versions",
    "read_manifest",
    "read_payload",
]

FORMAT = "miles-hpc-weights/2"  # 2: frames may code a group of tensors (elem_offset)
MANIFEST = "manifest.json"
PARTIAL = ".partial"
KINDS = ("same", "delta", "full")


def prune_versions(root: Path, keep: Path, count: int) -> list[Path]:
    """Remove the version directories ``v*`` under `root` but the newest `count` (`keep`, the one just published,
    counts as the newest) and leftovers of interrupted writes (``*.partial``, ``*.stale-*``); returns the removed.
    Used by the strategies that publish versions as directories (delta, lora)."""
    versions, junk = [], []
    for p in root.iterdir() if root.is_dir() else ():
        if not p.is_dir() or not p.name.startswith("v"):
            continue
        if p.name.endswith(PARTIAL) or ".stale-" in p.name:
            junk.append(p)
        elif p != keep:
            versions.append(p)
    versions.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    removed = junk + versions[count - 1 :]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


class ManifestError(ValueError):
    """A manifest or payload file that cannot be used; the message names the file (and the tensor)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One tensor of a version: where its payload frame lies and what the frame must say."""

    name: str  # HF name
    file: str  # a plain file name inside the version directory
    offset: int
    length: int
    kind: str  # same | delta | full
    dtype: str  # e.g. "bfloat16"
    shape: tuple[int, ...]
    checksum: str  # of the new tensor
    elem_offset: int | None = None  # in a group's frame: where this tensor's values start; None: its own frame


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    version: str
    base_version: str | None  # None: every entry is "full"
    tensors: tuple[Entry, ...]
    total_bytes: int
    full_bytes: int

    def to_json(self) -> str:
        body = {"format": FORMAT, **asdict(self)}
        body["tensors"] = [{**asdict(e), "shape": list(e.shape)} for e in self.tensors]
        return json.dumps(body, indent=1) + "\n"


class VersionWriter:
    """Writes one version directory: `add` payloads, then `commit` (write-then-rename). Use as a context manager:
    leaving the block without `commit` (an error) removes the partial directory."""

    def __init__(self, final: Path, *, version: str, base_version: str | None, shard_bytes: int = 1 << 30) -> None:
        self.final, self.version, self.base_version = final, version, base_version
        self.partial = final.with_name(final.name + PARTIAL)
        self.shard_bytes = shard_bytes
        self._entries: list[Entry] = []
        self._full_bytes = 0
        self._file: BinaryIO | None = None
        self._file_name = ""
        self._files = 0
        self._committed = False
        if self.partial.exists():  # left by a trainer that died while writing: never read, safe to drop
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._committed:
            self.abort()

    def add(self, name: str, payload: DeltaPayload) -> None:
        if payload.kind != "full" and self.base_version is None:
            raise ValueError(f"tensor {name!r}: a {payload.kind!r} payload in a version without a base")
        frame = to_bytes(payload)
        if self._file is None or self._file.tell() >= self.shard_bytes:
            self._next_file()
        assert self._file is not None
        offset = self._file.tell()
        self._file.write(frame)
        self._entries.append(
            Entry(
                name=name,
                file=self._file_name,
                offset=offset,
                length=len(frame),
                kind=payload.kind,
                dtype=payload.dtype,
                shape=payload.shape,
                checksum=payload.checksum,
            )
        )
        self._full_bytes += payload.raw_nbytes

    def add_group(self, members: list[tuple[str, tuple[int, ...], str]], payload: DeltaPayload) -> None:
        """One frame for several tensors: `payload` codes the concatenation of `members` (name, shape, checksum of
        the tensor), in this order."""
        if payload.kind != "full" and self.base_version is None:
            raise ValueError(f"tensor {members[0][0]!r}: a {payload.kind!r} payload in a version without a base")
        frame = to_bytes(payload)
        if self._file is None or self._file.tell() >= self.shard_bytes:
            self._next_file()
        assert self._file is not None
        offset = self._file.tell()
        self._file.write(frame)
        at = 0
        for name, shape, checksum in members:
            self._entries.append(
                Entry(
                    name=name,
                    file=self._file_name,
                    offset=offset,
                    length=len(frame),
                    kind=payload.kind,
                    dtype=payload.dtype,
                    shape=tuple(shape),
                    checksum=checksum,
                    elem_offset=at,
                )
            )
            at += math.prod(shape)
        if (at,) != payload.shape:
            raise ValueError(
                f"group of {len(members)} tensors from {members[0][0]!r} holds {at} values, its payload {payload.shape}"
            )
        self._full_bytes += payload.raw_nbytes

    def commit(self) -> Manifest:
        """fsync the payloads, write the manifest, rename ``v<N>.partial`` to ``v<N>``: a version written before
        under the same name (a retried publish) is replaced."""
        self._close_file()
        names = [e.name for e in self._entries]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor {dup!r} appears twice in weight version {self.version}")
        frames = {(e.file, e.offset): e.length for e in self._entries}
        manifest = Manifest(
            version=self.version,
            base_version=self.base_version,
            tensors=tuple(self._entries),
            total_bytes=sum(frames.values()),
            full_bytes=self._full_bytes,
        )
        write_text_atomic(self.partial / MANIFEST, manifest.to_json())
        if self.final.exists():
            stale = self.final.with_name(f"{self.final.name}.stale-{uuid.uuid4().hex[:8]}")
            self.final.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        self.partial.rename(self.final)
        _fsync_dir(self.final.parent)
        self._committed = True
        return manifest

    def abort(self) -> None:
        self._close_file()
        shutil.rmtree(self.partial, ignore_errors=True)

    def _next_file(self) -> None:
        self._close_file()
        self._file_name = f"payload-{self._files:05d}.bin"
        self._files += 1
        self._file = open(self.partial / self._file_name, "wb")  # noqa: SIM115 (closed by _close_file)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading (the engine side)
def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Parse and check ``DIR/manifest.json``; `ManifestError` names the file and what is wrong."""
    d = Path(directory)
    if not d.is_dir():
        raise ManifestError(f"manifest_path {str(d)!r} is not a directory")
    path = d / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: cannot read the manifest: {e}") from e
    try:
        return _parse(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path}: {e}") from e


def _parse(raw: Any) -> Manifest:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} manifest (format {raw.get('format') if isinstance(raw, dict) else raw!r})")
    base = raw["base_version"]
    if not isinstance(raw["version"], str) or not (base is None or isinstance(base, str)):
        raise ValueError("version must be a string and base_version a string or null")
    entries, seen = [], set()
    for i, t in enumerate(raw["tensors"]):
        name = t["name"]
        where = f"tensor {name!r} (entry {i})"
        if not isinstance(name, str) or name in seen:
            raise ValueError(f"{where}: the name is not a string or appears twice")
        seen.add(name)
        f = t["file"]
        if not isinstance(f, str) or not f or "/" in f or "\\" in f or f.startswith("."):
            raise ValueError(f"{where}: file {f!r} is not a plain file name")
        ints = [t["offset"], t["length"], *t["shape"]]
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints):
            raise ValueError(f"{where}: offset, length and shape must be non-negative integers")
        if t["kind"] not in KINDS or (base is None and t["kind"] != "full"):
            raise ValueError(f"{where}: kind {t['kind']!r} (a version without base_version holds 'full' only)")
        at = t.get("elem_offset")
        if at is not None and (not isinstance(at, int) or isinstance(at, bool) or at < 0):
            raise ValueError(f"{where}: elem_offset must be a non-negative integer or null")
        entries.append(
            Entry(
                name=name,
                file=f,
                offset=t["offset"],
                length=t["length"],
                kind=t["kind"],
                dtype=str(t["dtype"]),
                shape=tuple(t["shape"]),
                checksum=str(t["checksum"]),
                elem_offset=at,
            )
        )
    frames: dict[tuple[str, int], Entry] = {}
    for e in entries:  # the entries of one frame agree on what the frame is
        first = frames.setdefault((e.file, e.offset), e)
        if (first.length, first.kind, first.dtype) != (e.length, e.kind, e.dtype) or (
            e is not first and (first.elem_offset is None or e.elem_offset is None)
        ):
            raise ValueError(
                f"tensors {first.name!r} and {e.name!r} share the frame at {e.file}:{e.offset} but "
                "not its length, kind and dtype, or one of them is not a group member"
            )
    return Manifest(
        version=raw["version"],
        base_version=base,
        tensors=tuple(entries),
        total_bytes=int(raw["total_bytes"]),
        full_bytes=int(raw["full_bytes"]),
    )


def read_payload(directory: str | os.PathLike[str], entry: Entry) -> DeltaPayload:
    """The payload frame of `entry`, parsed (CRC checked) and matched against the manifest's description."""
    path = Path(directory) / entry.file
    where = f"tensor {entry.name!r} in {path}"
    try:
        with open(path, "rb") as f:
            f.seek(entry.offset)
            frame = f.read(entry.length)
    except OSError as e:
        raise ManifestError(f"{where}: {e}") from e
    if len(frame) != entry.length:
        raise ManifestError(f"{where}: {len(frame)} bytes at offset {entry.offset}, the manifest says {entry.length}")
    try:
        payload = from_bytes(frame)
    except DeltaError as e:
        raise ManifestError(f"{where}: {e}") from e
    if entry.elem_offset is None:
        got = (payload.kind, payload.dtype, payload.shape, payload.checksum)
        want = (entry.kind, entry.dtype, entry.shape, entry.checksum)
    else:  # a group member: the frame is the concatenation, this tensor a range of it
        fits = len(payload.shape) == 1 and entry.elem_offset + math.prod(entry.shape) <= payload.shape[0]
        got = (payload.kind, payload.dtype, fits)
        want = (entry.kind, entry.dtype, True)
    if got != want:
        raise ManifestError(
            f"{where}: the payload is {got}, the manifest says {want} (kind, dtype, shape/range, checksum)"
        )
    return payload
