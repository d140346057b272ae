"""Open the tensor handles of SGLang's ``/update_weights_from_tensor`` pickles without running untrusted code.

Stage: engine (weight sync, engine side of the ``colocated`` strategy, sync/strategies/colocated.py).

The format: each entry of ``serialized_named_tensors`` is base64 of a ``multiprocessing.reduction.ForkingPickler``
dump of ``list[tuple[hf_name, tensor]]`` (SGLang's ``MultiprocessingSerializer.serialize``). No tensor bytes are in
it, only handles to memory of the sending process on this host:
- a CUDA tensor is torch's own reduction, ``torch.multiprocessing.reductions.rebuild_cuda_tensor(...)`` with a CUDA
  IPC handle; its device is an index or, as SGLang's patched reductions send it, the GPU's UUID (robust to
  different ``CUDA_VISIBLE_DEVICES`` in the two processes). SGLang-patched senders name
  ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified``, which is read the same way;
- a CPU tensor is our extension: the persistent id ``("miles-hpc/shm", segment, offset, dtype, shape)``, a slice of
  the POSIX shared-memory segment ``/dev/shm/<segment>`` that the sender keeps until every engine answered. torch's
  own CPU reduction passes file descriptors through the sender's resource sharer, which unrelated processes cannot
  reach, so it is refused here (real SGLang refuses our persistent ids in turn: it runs on GPUs).

Security model: the route is admin-level (auth.py), and on top of that the bytes are never given to an unrestricted
unpickler. :func:`load_named_tensors` first scans the opcodes (no BUILD, NEWOBJ, INST/OBJ, extension codes, dict or
set building: only what the format needs), then unpickles with :class:`HandleUnpickler`, whose ``find_class``
resolves exactly the globals above plus ``torch.Size`` and dtype constants, each to a wrapper of ours that checks
its arguments before it touches torch, and raises :class:`TensorHandleError` naming any other global (``os.system``
never resolves, so nothing runs). The result must be a list of ``(str, Tensor)`` pairs. A segment name must look
like the sender's (``miles_hpc_*``) and every slice must lie inside the segment; mappings are private (copy on
write), so nothing here can write into the sender's memory.

Invariants: tensors come back exactly as sent (dtype, shape, bits), on the sender's device; the caller copies them
into the model (``Engine.update_weights``) and drops them, which releases the mappings (CUDA IPC reference counts
go back to the sender; the shared-memory mappings are unmapped).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import pickletools
import re
import types
from typing import Any

import torch
from torch.multiprocessing import reductions

__all__ = [
    "SEGMENT_PATTERN",
    "SHM_DIR",
    "SHM_TAG",
    "FlatBucketUnpickler",
    "HandleUnpickler",
    "TensorHandleError",
    "load_flattened_bucket",
    "load_named_tensors",
]

SHM_TAG = "miles-hpc/shm"  # first element of a CPU tensor's persistent id
SHM_DIR = "/dev/shm"  # where POSIX shm_open puts segments on Linux
SEGMENT_PATTERN = re.compile(r"miles_hpc_[A-Za-z0-9_]{1,120}")

# Opcodes the format uses (binary protocols 2-5): data, stack, memo, lists and tuples, globals, calls, persistent ids.
# Everything that builds objects through other paths (BUILD -> __setstate__/setattr, NEWOBJ, INST, OBJ), the
# extension registry, text persistent ids, and dict/set building (SETITEMS calls __setitem__ on any object) is refused.
ALLOWED_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "POP",
        "POP_MARK",
        "DUP",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "LONG4",
        "BINFLOAT",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "EMPTY_LIST",
        "APPEND",
        "APPENDS",
        "LIST",
        "BINPUT",
        "LONG_BINPUT",
        "MEMOIZE",
        "BINGET",
        "LONG_BINGET",
        "GLOBAL",
        "STACK_GLOBAL",
        "REDUCE",
        "BINPERSID",
    }
)
# Weight dtypes by name (also the dtypes the engine's weight routes accept: engine/protocol.py).
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPE_NAMES if hasattr(torch, n)}


class TensorHandleError(ValueError):
    """A payload this engine refuses (HTTP 400); the message says which global, opcode or field."""


class _Token:
    """A class a payload may name as a value (``torch.Tensor``, a storage class), never call: REDUCE on a token
    fails, and only our wrappers translate it to the real class."""

    def __init__(self, name: str, cls: type) -> None:
        self.name, self.cls = name, cls

    def __repr__(self) -> str:
        return f"<{self.name}>"


_TENSOR = _Token("torch.Tensor", torch.Tensor)
_TYPED_STORAGE = _Token("torch.storage.TypedStorage", torch.storage.TypedStorage)
_UNTYPED_STORAGE = _Token("torch.storage.UntypedStorage", torch.UntypedStorage)


def _int(v: Any, what: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise TensorHandleError(f"{what}: expected an integer >= {lo}, got {v!r}"[:200])
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or len(v) > 64:
        raise TensorHandleError(f"{what}: expected a tuple of at most 64 integers, got {type(v).__name__}")
    return tuple(_int(x, what) for x in v)


def _size(dims: Any) -> torch.Size:
    """``torch.Size(dims)``, for integer tuples only (what ``torch.Size.__reduce__`` pickles)."""
    return torch.Size(_ints(dims, "torch.Size"))


class _Handles:
    """The globals and persistent ids of the handle format, shared by both unpicklers below."""

    def _setup(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._segments: dict[str, torch.Tensor] = {}  # segment name -> its bytes (uint8, mapped privately)
        self._globals: dict[tuple[str, str], object] = {
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): self._rebuild_cuda,
            ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): self._rebuild_cuda,
            ("torch", "Tensor"): _TENSOR,
            ("torch.storage", "TypedStorage"): _TYPED_STORAGE,
            ("torch", "TypedStorage"): _TYPED_STORAGE,
            ("torch.storage", "UntypedStorage"): _UNTYPED_STORAGE,
            ("torch", "UntypedStorage"): _UNTYPED_STORAGE,
            ("torch", "Size"): _size,
            **{("torch", name): dtype for name, dtype in DTYPES.items()},
        }

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102
        try:
            return self._globals[(module, name)]
        except KeyError:
            raise TensorHandleError(
                f"refused global {module}.{name}: a tensor-handle payload may name only torch's CUDA tensor "
                f"rebuild, torch.Size, tensor/storage classes and dtypes (sync/wire/tensor_handles.py)"
            ) from None

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == SHM_TAG):
            raise TensorHandleError(f"unknown persistent id {pid!r}"[:200] + f"; expected ({SHM_TAG!r}, ...)")
        _, segment, offset, dtype_name, shape = pid
        if not isinstance(segment, str) or not SEGMENT_PATTERN.fullmatch(segment):
            raise TensorHandleError(f"shared-memory segment name {segment!r} is not one of ours (miles_hpc_*)"[:200])
        if dtype_name not in DTYPES:
            raise TensorHandleError(f"segment {segment}: unknown dtype {dtype_name!r}"[:200])
        dtype, dims = DTYPES[dtype_name], _ints(shape, f"segment {segment}: shape")
        offset = _int(offset, f"segment {segment}: offset")
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(dims, dtype=dtype)
        flat = self._segment(segment)
        if offset % dtype.itemsize or offset + nbytes > flat.numel():
            raise TensorHandleError(
                f"segment {segment}: {nbytes} bytes at offset {offset} are not an aligned slice "
                f"of its {flat.numel()} bytes"
            )
        return flat[offset : offset + nbytes].view(dtype).view(dims)

    def _segment(self, name: str) -> torch.Tensor:
        if name not in self._segments:
            path = os.path.join(SHM_DIR, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as e:
                raise TensorHandleError(
                    f"cannot open shared-memory segment {path}: {e.strerror} (the colocated "
                    f"strategy needs the trainer on this host)"
                ) from e
            try:
                size = os.fstat(fd).st_size
                # Private (copy-on-write) mapping: the tensors are writable for torch, the sender's memory is not.
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
            finally:
                os.close(fd)
            self._segments[name] = (
                torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
            )
        return self._segments[name]

    def _rebuild_cuda(self, *args: Any) -> torch.Tensor:
        """torch's ``rebuild_cuda_tensor`` after checking every argument (15, in torch's order)."""
        if len(args) != 15:
            raise TensorHandleError(f"rebuild_cuda_tensor: expected 15 arguments, got {len(args)}")
        (
            tensor_cls,
            size,
            stride,
            tensor_offset,
            storage_cls,
            dtype,
            device,
            handle,
            storage_bytes,
            storage_offset,
            requires_grad,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = args
        if tensor_cls is not _TENSOR:
            raise TensorHandleError(f"rebuild_cuda_tensor: tensor class {tensor_cls!r}, expected torch.Tensor")
        if storage_cls not in (_TYPED_STORAGE, _UNTYPED_STORAGE):
            raise TensorHandleError(f"rebuild_cuda_tensor: storage class {storage_cls!r} is not a torch storage")
        if not isinstance(dtype, torch.dtype) or dtype not in DTYPES.values():
            raise TensorHandleError(f"rebuild_cuda_tensor: dtype {dtype!r} is not a weight dtype"[:200])
        checked = (_size(size), _ints(stride, "stride"), _int(tensor_offset, "tensor offset"))
        for v, what in ((handle, "storage handle"), (ref_handle, "ref-counter handle"), (event_handle, "event handle")):
            if not (v is None or isinstance(v, bytes)):  # None: an empty storage (no allocation to share)
                raise TensorHandleError(f"rebuild_cuda_tensor: {what} must be bytes, got {type(v).__name__}")
        if not all(isinstance(b, bool) for b in (requires_grad, event_sync)):
            raise TensorHandleError("rebuild_cuda_tensor: requires_grad and event_sync_required must be booleans")
        index = self._cuda_index(device)
        return reductions.rebuild_cuda_tensor(
            torch.Tensor,
            *checked,
            storage_cls.cls,
            dtype,
            index,
            handle,
            _int(storage_bytes, "storage bytes"),
            _int(storage_offset, "storage offset"),
            False,
            ref_handle,
            _int(ref_offset, "ref-counter offset"),
            event_handle,
            event_sync,
        )

    def _cuda_index(self, device: Any) -> int:
        """The local index of the sender's GPU: its index, or its UUID (SGLang's patched reductions send that)."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise TensorHandleError(
                f"the payload holds CUDA IPC handles, but this engine runs on {self.device}: "
                f"serve it with --device cuda on the trainer's host"
            )
        n = torch.cuda.device_count()
        if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < n:
            return device
        if isinstance(device, str):
            for i in range(n):
                if str(torch.cuda.get_device_properties(i).uuid) == device:
                    return i
        raise TensorHandleError(f"CUDA device {device!r} of the payload is not a GPU of this host"[:200])


class HandleUnpickler(_Handles, pickle.Unpickler):
    """Unpickles the handle format (module docstring) and nothing else. One instance per payload: it caches the
    segments it mapped, which stay mapped only as long as the tensors viewing them live."""

    def __init__(self, data: bytes, device: torch.device | str) -> None:
        pickle.Unpickler.__init__(self, io.BytesIO(data))
        self._setup(device)


FLAT_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")  # SGLang's FlattenedTensorMetadata
FLAT_OPCODES = ALLOWED_OPCODES | {"EMPTY_DICT", "SETITEM", "SETITEMS", "BUILD"}


class FlatBucketUnpickler(_Handles, pickle._Unpickler):  # type: ignore[name-defined,misc]
    """SGLang's ``load_format="flattened_bucket"`` payload: ``{"flattened_tensor": tensor, "metadata": [m, ...]}``
    where each ``m`` has the attributes of SGLang's ``FlattenedTensorMetadata`` (we send ``types.SimpleNamespace``,
    which SGLang reads by attribute). That needs dicts and BUILD, so this is Python's pure unpickler with those
    opcodes narrowed: items go only into real dicts under string keys, and BUILD only sets metadata fields on a
    ``SimpleNamespace`` (never ``__setstate__`` of anything)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: bytes, device: torch.device | str) -> None:
        pickle._Unpickler.__init__(self, io.BytesIO(data))  # type: ignore[attr-defined]
        self._setup(device)
        self._globals[("types", "SimpleNamespace")] = types.SimpleNamespace

    def _set(self, d: Any, key: Any, value: Any) -> None:
        if type(d) is not dict or not isinstance(key, str):
            raise TensorHandleError("flattened bucket: items may only go into dicts, under string keys")
        d[key] = value

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._set(self.stack[-1], key, value)

    def load_setitems(self) -> None:
        items = self.pop_mark()
        for i in range(0, len(items) - 1, 2):
            self._set(self.stack[-1], items[i], items[i + 1])

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is not types.SimpleNamespace or type(state) is not dict or not set(state) <= set(FLAT_FIELDS):
            raise TensorHandleError(
                f"flattened bucket: BUILD may only set {', '.join(FLAT_FIELDS)} of a metadata "
                f"entry, got {type(inst).__name__} with {type(state).__name__}"[:200]
            )
        inst.__dict__.update(state)

    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.BUILD[0]] = load_build


def load_flattened_bucket(data: bytes, device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """One ``flattened_bucket`` payload -> ``[(hf_name, view of the flat tensor)]``, every entry checked against the
    flat tensor (a 1-D tensor; each [start_idx, end_idx) inside it, numel = end - start = prod(shape), dtype its
    own or a weight dtype to cast to, as SGLang's ``reconstruct_tensors`` does); TensorHandleError otherwise."""
    _check_opcodes(data, FLAT_OPCODES)
    try:
        obj = FlatBucketUnpickler(data, device).load()
    except TensorHandleError:
        raise
    except Exception as e:  # noqa: BLE001 (as in load_named_tensors)
        raise TensorHandleError(f"cannot open the flattened bucket: {type(e).__name__}: {e}") from e
    if type(obj) is not dict or set(obj) != {"flattened_tensor", "metadata"}:
        raise TensorHandleError("a flattened bucket must unpickle to {'flattened_tensor': ..., 'metadata': [...]}")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise TensorHandleError("flattened bucket: flattened_tensor must be a 1-D tensor and metadata a list")
    out: list[tuple[str, torch.Tensor]] = []
    for i, m in enumerate(metadata):
        if type(m) is not types.SimpleNamespace or set(vars(m)) != set(FLAT_FIELDS):
            raise TensorHandleError(f"flattened bucket: metadata[{i}] must have exactly {', '.join(FLAT_FIELDS)}")
        name, dims = m.name, _ints(tuple(m.shape) if isinstance(m.shape, torch.Size) else m.shape, "shape")
        start, end, numel = (_int(m.start_idx, "start_idx"), _int(m.end_idx, "end_idx"), _int(m.numel, "numel"))
        if not isinstance(name, str) or m.dtype not in DTYPES.values():
            raise TensorHandleError(f"flattened bucket: metadata[{i}] needs a string name and a weight dtype")
        if not start <= end <= flat.numel() or end - start != numel or math.prod(dims) != numel:
            raise TensorHandleError(
                f"flattened bucket: {name}: [{start}, {end}) of {flat.numel()} elements does "
                f"not hold shape {dims} ({numel} elements)"[:300]
            )
        t = flat[start:end].view(dims)
        out.append((name, t if t.dtype == m.dtype else t.to(m.dtype)))
    return out


def _check_opcodes(data: bytes, allowed: frozenset[str] = ALLOWED_OPCODES) -> None:
    try:
        for op, _, pos in pickletools.genops(data):
            if op.name not in allowed:
                raise TensorHandleError(
                    f"refused pickle opcode {op.name} at byte {pos}: tensor-handle payloads "
                    f"only call the rebuild functions they name"
                )
    except TensorHandleError:
        raise
    except Exception as e:  # genops raises ValueError and others on malformed input
        raise TensorHandleError(f"not a pickle: {e}") from e


def _is_named_tensor(p: object) -> bool:
    return isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)


def load_named_tensors(data: bytes, device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """Safely unpickle one payload (module docstring) into ``[(hf_name, tensor)]``; TensorHandleError otherwise."""
    _check_opcodes(data)
    try:
        obj = HandleUnpickler(data, device).load()
    except TensorHandleError:
        raise
    except Exception as e:  # torch and pickle raise many types for bad handles; all mean "refused"
        raise TensorHandleError(f"cannot open the tensor handles: {type(e).__name__}: {e}") from e
    if not isinstance(obj, list) or not all(_is_named_tensor(p) for p in obj):
        raise TensorHandleError("the payload must unpickle to a list of (name, tensor) pairs")
    return obj
