"""The receiving side of the "delta" weight sync: ``POST /update_weights_from_delta`` (our extension).

Stage: engine (weight sync, engine side). The trainer (``sync/strategies/delta.py``) writes a version directory
(``sync/codec/delta_manifest.py``: manifest + payload files) and names it here; `apply_version` reads it, decodes each
tensor against this engine's current value of that HF tensor (the same name mapping as ``/weights_checker``:
``models.hf_target``, per-expert views of fused MoE tensors), and applies the results with
``Engine.update_weights``, the last part carrying the new ``weight_version``. A frame that codes a group of tensors
(their concatenation) is decoded once against the concatenation of this engine's tensors, on their device.

Invariants:
- Nothing is written before everything that can be checked was: the manifest, the base version (the engine must
  hold exactly the version the delta was coded against, and not be half-updated), every name, shape and dtype
  against the model, and every payload frame (read, CRC-checked, matched against its manifest entry).
- Each decoded tensor is verified against the checksum the trainer computed (the codec does it), so a wrong base
  cannot go unnoticed. A tensor that fails only then (the engine's weights were not the base despite the version)
  stops the update part-way: the parts already applied carried no version, so a paused engine is left
  half-updated (``Engine.resume`` refuses) and the trainer sends full tensors next time.
- Deltas need this engine's tensor dtype to equal the payload's (the rollout dtype); "full" payloads are cast
  like every other weight update.
- The caller (``WeightEndpoints``) serialises this with every other weight change and runs it in a worker thread.
Every error names the file and the tensor; the server answers it with HTTP 400.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from miles_hpc.models import hf_target
from miles_hpc.sync.codec.delta_codec import DeltaError, decode
from miles_hpc.sync.codec.delta_manifest import Entry, Manifest, read_manifest, read_payload
from miles_hpc.sync.wire.checksum import tensor_checksums

from .core import Engine, RequestError

__all__ = ["DeltaReport", "apply_version"]

BUCKET_BYTES = 64 << 20  # decoded tensors held before they are applied (one `update_weights` part)


@dataclass(frozen=True, slots=True)
class DeltaReport:
    version: str
    tensors: int  # entries of the manifest
    changed: int  # tensors written (not "same")
    bytes_read: int  # payload bytes (each read twice: checked, then decoded)


def apply_version(
    engine: Engine,
    manifest_path: str | os.PathLike[str],
    *,
    base_version: str | None,
    weight_version: str | None,
    flush_cache: bool,
) -> DeltaReport:
    """Read, check, decode and apply the version in directory `manifest_path` (module docstring)."""
    directory = Path(manifest_path)
    m = read_manifest(directory)
    where = directory / "manifest.json"
    if base_version != m.base_version:
        raise RequestError(f"base_version {base_version!r} in the request, {m.base_version!r} in {where}")
    version = m.version if weight_version is None else weight_version
    if version != m.version:
        raise RequestError(f"weight_version {weight_version!r} in the request, {m.version!r} in {where}")
    if m.base_version is not None:
        if engine.weight_version != m.base_version:
            raise RequestError(
                f"engine holds weight version {engine.weight_version!r}, the delta in {directory} is "
                f"against {m.base_version!r}: it needs the full tensors"
            )
        if engine.half_updated:
            raise RequestError(
                f"engine weights are half-updated, not version {m.base_version!r}: a delta cannot "
                "apply; it needs the full tensors"
            )
    targets, skip = _targets(engine, m, directory)
    for e in m.tensors:  # every frame readable and as described before anything is written
        read_payload(directory, e)
    changed = 0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, new in _decoded(directory, m, targets):
        if name in skip:
            continue
        if bucket and size + new.numel() * new.element_size() > BUCKET_BYTES:
            engine.update_weights(bucket, version=None, flush_cache=False)
            bucket, size = [], 0
        bucket.append((name, new))
        size += new.numel() * new.element_size()
        changed += 1
    # The last part carries the version (and flushes the prefix cache); an empty one only names the weights.
    engine.update_weights(bucket, version=version, flush_cache=flush_cache)
    return DeltaReport(version=version, tensors=len(m.tensors), changed=changed, bytes_read=2 * m.total_bytes)


def _targets(engine: Engine, m: Manifest, directory: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(HF name -> the engine's current value it is decoded against, names to decode but not apply); checks names,
    shapes and delta dtypes. TP 1: views of the model's parameters. A tensor-parallel engine: the whole tensors its
    ranks hold, gathered on rank 0's CPU (the codec's context classes span the whole tensor, so no rank can decode
    its part alone); "full" and "same" entries, which are not decoded against a base, get a shape-only (meta)
    stand-in."""
    model = engine.model
    tied = model.config.tie_word_embeddings
    skip = {e.name for e in m.tensors if tied and e.name == "lm_head.weight"}
    # The tied LM head is the embedding itself, which loading and every other update skip; a group that holds it
    # still needs its current values (the embedding's) to decode against.
    held_as = {e.name: "model.embed_tokens.weight" if e.name in skip else e.name for e in m.tensors}
    if engine.tp is None:
        params = dict(model.named_parameters())

        def lookup(name: str) -> torch.Tensor:
            return hf_target(model, name, params)
    else:
        shapes = engine.tp.shard.shapes
        wanted = {held_as[e.name] for e in m.tensors if e.kind == "delta" and held_as[e.name] in shapes}
        whole = engine.whole_weights(wanted)
        dtype = next(model.parameters()).dtype

        def lookup(name: str) -> torch.Tensor:
            if name not in shapes:
                raise KeyError(name)
            if name not in whole:
                return torch.empty(shapes[name], dtype=dtype, device="meta")
            if tuple(whole[name].shape) != shapes[name]:  # tp.py's assembly found the ranks' copies differ
                raise RequestError(
                    f"tensor {name!r} of {directory}: this engine's tensor-parallel ranks disagree on its values "
                    "(a replicated tensor or a padding differs between ranks): a delta cannot apply; it needs the "
                    "full tensors"
                )
            return whole[name]

    out: dict[str, torch.Tensor] = {}
    for e in m.tensors:
        where = f"tensor {e.name!r} of {directory}"
        try:
            target = lookup(held_as[e.name])
        except KeyError:
            raise RequestError(f"{where}: no such tensor in this {model.config.model_type} model") from None
        if tuple(target.shape) != e.shape:
            raise RequestError(f"{where}: shape {e.shape}, the model's is {tuple(target.shape)}")
        held = str(target.dtype).removeprefix("torch.")
        if e.kind != "full" and held != e.dtype:
            raise RequestError(
                f"{where}: a {e.dtype} delta, but this engine holds {held}: deltas need the engine "
                f"in the rollout dtype (send full tensors, or serve with --dtype {e.dtype})"
            )
        out[e.name] = target
    return out, skip


def _decoded(directory: Path, m: Manifest, targets: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, new tensor) of each changed entry, decoded against the engine's current value and verified."""
    frames: dict[tuple[str, int], list[Entry]] = {}
    for e in m.tensors:
        frames.setdefault((e.file, e.offset), []).append(e)
    for entries in frames.values():
        if entries[0].kind == "same":
            continue
        if entries[0].elem_offset is None:
            yield entries[0].name, _decode(directory, entries[0], targets[entries[0].name])
        else:
            yield from _decode_group(directory, entries, targets)


def _decode(directory: Path, e: Entry, target: torch.Tensor) -> torch.Tensor:
    payload = read_payload(directory, e)
    # "full" needs no base: decode against an empty tensor of its own dtype (update_weights casts it).
    old = target if e.kind != "full" else torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=_real(target))
    try:
        return decode(old, payload)
    except DeltaError as err:
        raise RequestError(f"tensor {e.name!r} in {directory / e.file}: {err}") from err


def _decode_group(
    directory: Path, entries: list[Entry], targets: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one group frame: decoded once against the concatenation of their current values, each then
    checked against its own checksum."""
    first = entries[0]
    where = f"tensor {first.name!r} (and {len(entries) - 1} more in its group) in {directory / first.file}"
    entries = sorted(entries, key=lambda e: e.elem_offset or 0)
    at = 0
    for e in entries:
        if e.elem_offset != at:
            raise RequestError(
                f"{where}: the group's tensors do not tile it ({e.name!r} starts at {e.elem_offset}, expected {at})"
            )
        at += math.prod(e.shape)
    payload = read_payload(directory, first)
    if payload.shape != (at,):
        raise RequestError(f"{where}: the group's tensors hold {at} values, its payload {payload.shape}")
    dtype, device = getattr(torch, payload.dtype), _real(targets[first.name])
    if payload.kind == "full":
        old = torch.empty(at, dtype=dtype, device=device)
    else:
        old = torch.cat([targets[e.name].reshape(-1) for e in entries]) if at else torch.empty(0, dtype=dtype)
    try:
        flat = decode(old, payload, verify=False)  # checked tensor by tensor below: a mismatch names its tensor
    except DeltaError as err:
        raise RequestError(f"{where}: {err}") from err
    news = [(e.name, flat[e.elem_offset : e.elem_offset + math.prod(e.shape)].view(e.shape)) for e in entries]
    got = tensor_checksums(news)
    for e, (name, _) in zip(entries, news):  # all checked before any is applied
        if got[name] != e.checksum:
            raise RequestError(
                f"tensor {name!r} in {directory / e.file}: checksum mismatch after decoding its group: "
                f"got {got[name]}, the manifest says {e.checksum} (corrupt payload, or this engine's "
                "tensor is not the one the delta was made against)"
            )
    yield from news


def _real(t: torch.Tensor) -> torch.device:
    """Where to decode next to `t`: its device, the CPU for a shape-only (meta) stand-in."""
    return torch.device("cpu") if t.device.type == "meta" else t.device
