"""Checkpoint-side helpers: weight updates into a live model by HF tensor name, checksums, EOS ids.

Stage: engine. `Engine` calls these between steps (under its step lock); they know nothing of requests.

Invariants:
- Names are HF names: `models.hf_target` maps each (incl. per-expert MoE names) to the view of our parameter it
  fills. A tensor is checked (name, shape) before anything is written to it, so a rejected tensor is untouched;
  tensors applied before it stay applied.
- Values are cast to the parameter's dtype and device (a bf16 trainer shard into an fp32 CPU engine works).
- With tied embeddings `lm_head.weight` is the embedding: a checkpoint's copy is skipped, as loading does.
- An FP8 block-quantized checkpoint (`models.fp8`) is checked like loading checks it (every fp8 weight has its
  scale, of the right shape) and its weights stream dequantized to the model's dtype.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from miles_hpc.models import CausalLM, expected_hf_shapes, fp8, hf_target, iter_hf_tensors
from miles_hpc.models.hf_io import checkpoint_files
from miles_hpc.sync.wire.checksum import piece_key, tensor_checksums

from .protocol import parse_box
from .validate import RequestError


def _tied_head(model: CausalLM, name: str) -> bool:
    return model.config.tie_word_embeddings and name == "lm_head.weight"


@torch.no_grad()
def apply_named(model: CausalLM, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy each (HF name, tensor) into `model`; returns the names applied. RequestError names a bad tensor."""
    params = dict(model.named_parameters())
    applied: list[str] = []
    for name, value in named:
        if _tied_head(model, name):
            continue
        if not isinstance(value, torch.Tensor):
            raise RequestError(f"weight {name!r}: expected a tensor, got {type(value).__name__}")
        try:
            target = hf_target(model, name, params)
        except KeyError:
            raise RequestError(f"weight {name!r}: no such tensor in this {model.config.model_type} model") from None
        if tuple(value.shape) != tuple(target.shape):
            raise RequestError(
                f"weight {name!r}: shape {tuple(value.shape)} does not match the model's {tuple(target.shape)}"
            )
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise RequestError(f"weight {name!r}: dtype {value.dtype} is not a real floating/integer type")
        target.copy_(value.to(device=target.device, dtype=target.dtype))
        applied.append(name)
    return applied


def iter_checkpoint(model: CausalLM, path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Check that the HF checkpoint at `path` has exactly `model`'s tensors and shapes (RequestError otherwise),
    then yield them one at a time (one tensor in host memory at once)."""
    try:
        files, blame = checkpoint_files(Path(path))
        quant = fp8.read_quantization(path)
    except (FileNotFoundError, ValueError) as e:
        raise RequestError(f"model_path: {e}") from e
    files, scales = fp8.split_scales(files)  # FP8 block scales travel with their weights
    expected = expected_hf_shapes(model, files)
    missing = [n for n in expected if n not in files]
    if missing:
        raise RequestError(f"model_path: {blame} lacks tensor {missing[0]!r} ({len(missing)} missing)")
    unknown = [n for n in files if n not in expected and not _tied_head(model, n) and not n.endswith("inv_freq")]
    if unknown:
        raise RequestError(f"model_path: {files[unknown[0]]} has tensor {unknown[0]!r} this model does not")
    try:
        fp8.check_scales(scales, files, quant)
    except ValueError as e:
        raise RequestError(f"model_path: {e}") from e
    by_file: dict[Path, list[str]] = {}
    for n in expected:
        by_file.setdefault(files[n], []).append(n)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for n in names:
                shape = tuple(f.get_slice(n).get_shape())
                if shape != expected[n]:
                    raise RequestError(f"model_path: {file} tensor {n!r} has shape {shape}, expected {expected[n]}")
                try:
                    fp8.check_tensor(f, file, n, quant, scales)
                except ValueError as e:
                    raise RequestError(f"model_path: {e}") from e
    return _stream(by_file, quant, scales, next(model.parameters()).dtype)


def _stream(
    by_file: dict[Path, list[str]], quant: fp8.Fp8Quantization | None, scales: dict[str, Path], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for n in names:
                yield n, fp8.read_tensor(f, file, n, quant, scales, dtype)


def checksums(model: CausalLM) -> dict[str, str]:
    """HF name -> tensor_checksum, in the Hub layout (per-expert MoE tensors, no tied lm_head)."""
    return tensor_checksums(iter_hf_tensors(model))


def piece_checksums(
    model: CausalLM, boxes: dict[str, list[list[int]]], *, tensors: dict[str, torch.Tensor] | None = None
) -> dict[str, str]:
    """`piece_key` -> tensor_checksum of each box (``[lo0, hi0, lo1, hi1, ...]``) of each named HF tensor; an
    unknown name is a KeyError, a box outside its tensor a ValueError (both name the tensor). `tensors`: the HF
    tensors to read instead of `model`'s (a tensor-parallel engine's, assembled)."""
    tensors = dict(iter_hf_tensors(model)) if tensors is None else tensors
    pieces: list[tuple[str, torch.Tensor]] = []
    for name, flat_boxes in boxes.items():
        if name not in tensors:
            raise KeyError(f"no HF tensor {name!r} in this model")
        t = tensors[name]
        for flat in flat_boxes:
            dims = parse_box(flat, list(t.shape), "boxes", name)
            pieces.append((piece_key(name, dims), t[tuple(slice(lo, hi) for lo, hi in dims)]))
    return tensor_checksums(pieces)


def eos_token_ids(config_eos: int | tuple[int, ...] | None, model_path: str | None) -> frozenset[int]:
    """EOS ids: config.json's plus generation_config.json's (SGLang takes both)."""
    ids: set[int] = set()
    for src in (config_eos, _generation_eos(model_path)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(x) for x in src)
    return frozenset(ids)


def _generation_eos(model_path: str | None) -> object:
    if model_path is None:
        return None
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, AttributeError):
        logging.getLogger(__name__).warning("%s is not valid JSON; ignoring its eos_token_id", path)
        return None


def recording(named: Iterable[tuple[str, torch.Tensor]], applied: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, noting names as they are handed on (so a failed update still knows it started)."""
    for name, t in named:
        applied.append(name)
        yield name, t
