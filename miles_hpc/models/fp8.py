"""FP8 block-quantized HF checkpoints (DeepSeek-V3.x, Kimi-K2, GLM-5 releases): read and dequantized on load.

Stage: shared (`hf_io.load_hf_checkpoint` and the engine's reload from disk read checkpoints through it).

Format: config.json's `quantization_config` says `quant_method: "fp8"`, `fmt: "e4m3"` (absent means e4m3) and
`weight_block_size: [bo, bi]`. Each quantized weight `X.weight` [..., out, in] is stored as float8_e4m3fn with a
sibling `X.weight_scale_inv` [..., ceil(out/bo), ceil(in/bi)] (float32, or UE8M0 exponents with `scale_fmt: "ue8m0"`):
the real weight is the fp8 value times the scale of its bo x bi block (the last row and column blocks are ragged when
out/in are not multiples). Every other tensor (norms, embeddings, lm_head, router gates, biases) is stored plain.

Invariants:
- Only that scheme is read; any other `quantization_config` (another quant_method, fmt, per-tensor fp8, static
  activation scales, fp4 experts) is a ValueError naming config.json, the field and the value.
- Which weights are quantized is read from the file, not from `modules_to_not_convert`: an fp8 tensor must have its
  scale (and the config must declare fp8), a scale must belong to an fp8 weight of the checkpoint, and its shape must
  be the block grid of its weight. Every error names the tensor and the file.
- Dequantization runs in float32, one tensor at a time, then casts to the caller's dtype: no fp32 copy of the model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
SUPPORTED = (
    "supported: quant_method 'fp8' with fmt 'e4m3', weight_block_size [bo, bi], activation_scheme 'dynamic', "
    "scale_fmt 'float' or 'ue8m0' (DeepSeek-V3 style block scales)"
)
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)
_E8M0_SCALES = (torch.float8_e8m0fnu, torch.uint8)
_E8M0_BIAS = 127


@dataclass(frozen=True)
class Fp8Quantization:
    """A parsed `quantization_config`: block size [rows, cols] of one scale, and the scales' format."""

    block: tuple[int, int]
    scale_fmt: str = "float"
    modules_to_not_convert: tuple[str, ...] = ()
    source: str = "config.json"


class TensorFile(Protocol):
    """What `safe_open` gives: tensors and their headers by name."""

    def get_tensor(self, name: str) -> torch.Tensor: ...
    def get_slice(self, name: str) -> Any: ...


# ---------------------------------------------------------------- config
def _refuse(source: str, field: str, value: object) -> ValueError:
    return ValueError(f"{source}: quantization_config.{field} = {value!r} is not supported; {SUPPORTED}")


def _block_size(source: str, value: object) -> tuple[int, int]:
    if value is None:
        raise ValueError(
            f"{source}: quantization_config.weight_block_size is missing: per-tensor fp8 is not supported; {SUPPORTED}"
        )
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _refuse(source, "weight_block_size", value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise _refuse(source, "weight_block_size", value)
    return int(value[0]), int(value[1])


def parse_quantization(d: Mapping[str, Any], *, source: str = "config.json") -> Fp8Quantization | None:
    """The FP8 block scheme of an HF config dict; None when it has no `quantization_config`."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"{source}: quantization_config must be an object, got {q!r}; {SUPPORTED}")
    checks: tuple[tuple[str, object, tuple[object, ...]], ...] = (
        ("quant_method", q.get("quant_method"), ("fp8",)),
        ("fmt", q.get("fmt", "e4m3"), ("e4m3",)),
        ("activation_scheme", q.get("activation_scheme", "dynamic"), ("dynamic",)),
        ("scale_fmt", q.get("scale_fmt") or "float", ("float", "ue8m0")),
        ("expert_dtype", q.get("expert_dtype", "fp8"), ("fp8",)),
    )
    for field, value, allowed in checks:
        if value not in allowed:
            raise _refuse(source, field, value)
    block = _block_size(source, q.get("weight_block_size"))
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return Fp8Quantization(block, str(q.get("scale_fmt") or "float"), tuple(str(m) for m in skip), source)


def read_quantization(path: str | os.PathLike[str]) -> Fp8Quantization | None:
    """The FP8 scheme of the checkpoint directory `path` (None without config.json or quantization_config)."""
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return None
    return parse_quantization(json.loads(cfg.read_text()), source=str(cfg))


# ---------------------------------------------------------------- names
def is_scale(name: str) -> bool:
    """`X.weight_scale_inv` (and fused `X_scale_inv`): a block scale, not a model tensor."""
    return name.endswith(SCALE_SUFFIX)


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def weight_name(scale: str) -> str:
    return scale.removesuffix(SCALE_SUFFIX)


def split_scales(files: Mapping[str, Path]) -> tuple[dict[str, Path], dict[str, Path]]:
    """Split a checkpoint's name -> file map into its tensors and its scales (keyed by the weight they scale)."""
    tensors = {n: f for n, f in files.items() if not is_scale(n)}
    scales = {weight_name(n): f for n, f in files.items() if is_scale(n)}
    return tensors, scales


def check_scales(scales: Mapping[str, Path], tensors: Mapping[str, Path], quant: Fp8Quantization | None) -> None:
    """Every scale belongs to a weight of the checkpoint (which then decides whether both are loaded or ignored),
    and scales appear only where config.json declares fp8."""
    for weight, file in scales.items():
        if quant is None:
            raise ValueError(
                f"{file}: tensor {scale_name(weight)!r} is an FP8 block scale, but the checkpoint's config.json has "
                f"no quantization_config; {SUPPORTED}"
            )
        if weight not in tensors:
            raise ValueError(f"{file}: scale {scale_name(weight)!r} has no weight {weight!r} in the checkpoint")


# ---------------------------------------------------------------- tensors
def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block grid of a weight: [..., ceil(out/bo), ceil(in/bi)]."""
    if len(shape) < 2:
        raise ValueError(f"an FP8 block-quantized weight has at least 2 dims, got shape {shape}")
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def _scale_float32(scale: torch.Tensor, name: str, file: Path | str, quant: Fp8Quantization) -> torch.Tensor:
    if scale.dtype in _FLOAT_SCALES:
        return scale.to(torch.float32)
    if scale.dtype in _E8M0_SCALES and quant.scale_fmt == "ue8m0":
        exponent = scale.view(torch.uint8).to(torch.float32) - _E8M0_BIAS
        return torch.exp2(exponent)
    raise ValueError(
        f"{file}: scale {scale_name(name)!r} has dtype {scale.dtype} (scale_fmt {quant.scale_fmt!r}); "
        f"expected float32 (or UE8M0 bytes with scale_fmt 'ue8m0')"
    )


def dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    quant: Fp8Quantization,
    dtype: torch.dtype,
    *,
    name: str,
    file: Path | str,
) -> torch.Tensor:
    """`weight` (float8_e4m3fn) times the scale of its block, computed in float32 and returned in `dtype`."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{file}: tensor {name!r} has dtype {weight.dtype}, expected {FP8_DTYPE} (fmt e4m3)")
    shape, grid = tuple(weight.shape), scale_shape(tuple(weight.shape), quant.block)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"{file}: scale {scale_name(name)!r} has shape {tuple(scale_inv.shape)}, expected {grid} "
            f"(weight {name!r} {shape} in blocks of {list(quant.block)})"
        )
    bo, bi = quant.block
    rows, cols = shape[-2:]
    full = cols // bi
    # Scales over rows only ([..., out, ceil(in/bi)], small); columns broadcast through views of the weight.
    scale = _scale_float32(scale_inv, name, file, quant).repeat_interleave(bo, dim=-2)[..., :rows, :]
    out = weight.to(torch.float32)
    out[..., : full * bi].unflatten(-1, (full, bi)).mul_(scale[..., :full, None])
    if full * bi < cols:
        out[..., full * bi :].mul_(scale[..., full:])
    return out.to(dtype)


def _header(f: TensorFile, file: Path, name: str, other: Path) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype code, shape) of `name`, read from `f` when it lives in `file`, else from `other`."""
    if other == file:
        s = f.get_slice(name)
        return str(s.get_dtype()), tuple(s.get_shape())
    with safe_open(str(other), framework="pt", device="cpu") as g:
        s = g.get_slice(name)
        return str(s.get_dtype()), tuple(s.get_shape())


def check_tensor(
    f: TensorFile, file: Path, name: str, quant: Fp8Quantization | None, scales: Mapping[str, Path]
) -> None:
    """Headers only: an fp8 tensor is e4m3, declared by config.json and has a scale of the right shape; a plain
    tensor has no scale."""
    dtype, shape = _header(f, file, name, file)
    scale_file = scales.get(name)
    if not dtype.startswith("F8_"):
        if scale_file is not None:
            raise ValueError(
                f"{scale_file}: scale {scale_name(name)!r} belongs to {name!r}, which {file} stores as {dtype}, "
                "not as float8_e4m3fn"
            )
        return
    if quant is None:
        raise ValueError(
            f"{file}: tensor {name!r} is stored as {dtype} but the checkpoint's config.json has no "
            f"quantization_config; {SUPPORTED}"
        )
    if dtype != "F8_E4M3":
        raise ValueError(f"{file}: tensor {name!r} is stored as {dtype}; only F8_E4M3 (e4m3) weights are read")
    if scale_file is None:
        raise ValueError(f"{file}: fp8 weight {name!r} has no scale {scale_name(name)!r} in the checkpoint")
    _, got = _header(f, file, scale_name(name), scale_file)
    if got != scale_shape(shape, quant.block):
        raise ValueError(
            f"{scale_file}: scale {scale_name(name)!r} has shape {got}, expected {scale_shape(shape, quant.block)} "
            f"(weight {name!r} {shape} in blocks of {list(quant.block)})"
        )


def read_tensor(
    f: TensorFile,
    file: Path,
    name: str,
    quant: Fp8Quantization | None,
    scales: Mapping[str, Path],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Tensor `name` of `file` as the model holds it: an fp8 weight dequantized to `dtype`, any other as stored."""
    check_tensor(f, file, name, quant, scales)
    t = f.get_tensor(name)
    if t.dtype != FP8_DTYPE or quant is None:
        return t
    scale_file = scales[name]
    if scale_file == file:
        scale = f.get_tensor(scale_name(name))
    else:
        with safe_open(str(scale_file), framework="pt", device="cpu") as g:
            scale = g.get_tensor(scale_name(name))
    return dequantize(t, scale, quant, dtype, name=name, file=file)
