"""The writing side of tensor handles: what the colocated sync pickles for ``/update_weights_from_tensor``.

SGLang's format: base64 of a ``ForkingPickler`` dump of ``list[(name, tensor)]`` (or of a flattened bucket). CUDA
tensors go by torch's CUDA IPC reduction with the device named by its UUID (SGLang's convention); CPU tensors lie in
POSIX shared-memory segments and go as the persistent id ``(SHM_TAG, segment, offset, dtype, shape)``, our one
extension. The reading side, with its restricted unpickler, is ``tensor_handles.py``; the two share ``SHM_TAG``.
Imports nothing of ours outside ``sync/wire``: the engine (direct writes) and the trainer both use it.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from miles_hpc.sync.wire.tensor_handles import SHM_TAG, TensorHandleError

__all__ = ["SHM_TAG", "ShmSlice", "cuda_reduction", "serialize_named", "serialize_object"]


@dataclass(frozen=True, slots=True)
class ShmSlice:
    """Where one CPU tensor lies: pickled as a persistent id, opened by the engine."""

    segment: str
    offset: int
    dtype: str
    shape: tuple[int, ...]


class _Pickler(ForkingPickler):
    """ForkingPickler with our two reductions: CUDA tensors by IPC handle with the GPU's UUID, `ShmSlice` as a
    persistent id. Per instance, so no process-global reduction or sharing strategy changes."""

    def __init__(self, file: io.BytesIO, gpu_uuid: Callable[[int], str]) -> None:
        super().__init__(file)
        self._gpu_uuid = gpu_uuid

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if isinstance(obj, ShmSlice):
            return (SHM_TAG, obj.segment, obj.offset, obj.dtype, obj.shape)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return cuda_reduction(obj, self._gpu_uuid)
        return NotImplemented


def cuda_reduction(t: torch.Tensor, gpu_uuid: Callable[[int], str]) -> tuple[Any, tuple[Any, ...]]:
    """torch's CUDA IPC reduction of `t` with the device index replaced by the GPU's UUID (SGLang's convention)."""
    from torch.multiprocessing import reductions

    if not t.is_cuda or type(t) is not torch.Tensor or t.layout != torch.strided:
        raise TensorHandleError(
            f"colocated sync sends plain strided CUDA tensors by handle, got a {type(t).__name__} "
            f"on {t.device} ({t.layout})"
        )
    fn, args = reductions.reduce_tensor(t)
    return fn, (*args[:6], gpu_uuid(args[6]), *args[7:])


def serialize_named(items: Sequence[tuple[str, torch.Tensor | ShmSlice]], gpu_uuid: Callable[[int], str]) -> str:
    """One `serialized_named_tensors` entry: base64 of the ForkingPickler dump of `items`."""
    return serialize_object(list(items), gpu_uuid)


def serialize_object(obj: Any, gpu_uuid: Callable[[int], str]) -> str:
    """base64 of the ForkingPickler dump of `obj` with our reductions (a list of pairs, or a flattened bucket)."""
    buf = io.BytesIO()
    _Pickler(buf, gpu_uuid).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")
