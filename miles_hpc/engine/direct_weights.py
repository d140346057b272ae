"""Direct weight writes for a colocated trainer (stage: engine, weight sync; our extension, docs/engine.md).

The fastest way new weights reach an engine on the trainer's GPU is for the trainer to write them straight into the
engine's parameters: one cast-copy per tensor, no staging buffer, no per-bucket HTTP call or IPC handle to open.
This module builds what the trainer needs for that, once per engine process (`/weights_ipc_handles`):
- every parameter of the model as a CUDA IPC handle (the `colocated` strategy's pickle format: a list of
  ``(name, tensor)``, the GPU named by its UUID), and
- for every HF tensor name the engine accepts (the Hub layout: per-expert names map into the fused expert tensors),
  where it lies: ``[hf_name, parameter index, shape, stride, storage offset]``, so the trainer rebuilds the view
  with ``as_strided`` on the opened parameter and copies into it.

The write itself is bracketed by `Engine.begin_direct_write` (paused engines only; weights half-updated until the
commit) and `Engine.commit_direct_write` (prefix cache flushed, version set). A tied `lm_head.weight` is not an
entry: the engine fills it from the embedding, as `weights.apply_named` skips it.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_hpc.models import CausalLM, hf_target, iter_hf_tensors

__all__ = ["handle_entries", "weight_handles"]


def handle_entries(model: CausalLM) -> tuple[list[tuple[str, torch.Tensor]], list[list[Any]]]:
    """(parameters to share as (name, tensor), one entry per HF name: [hf_name, param index, shape, stride,
    storage offset]). Every HF view lies in exactly one parameter's storage."""
    named = [(n, p.data) for n, p in model.named_parameters()]
    by_storage = {p.untyped_storage().data_ptr(): i for i, (_, p) in enumerate(named)}
    params = dict(model.named_parameters())
    entries: list[list[Any]] = []
    for hf_name, _ in iter_hf_tensors(model):
        view = hf_target(model, hf_name, params)
        owner = by_storage.get(view.untyped_storage().data_ptr())
        if owner is None:  # a view outside every parameter would be a bug of hf_target
            raise RuntimeError(f"HF tensor {hf_name!r} is not a view of a parameter")
        entries.append([hf_name, owner, list(view.shape), list(view.stride()), view.storage_offset()])
    return named, entries


def weight_handles(model: CausalLM, instance_id: str) -> dict[str, Any]:
    """The `/weights_ipc_handles` answer: {instance, payload (base64 pickle of the parameters' handles), entries}."""
    from miles_hpc.sync.wire.tensor_pickle import serialize_named

    if not next(model.parameters()).is_cuda:
        raise ValueError("weight handles need an engine on a GPU (CUDA IPC)")
    named, entries = handle_entries(model)
    uuids: dict[int, str] = {}

    def gpu_uuid(index: int) -> str:
        if index not in uuids:
            uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
        return uuids[index]

    return {"instance": instance_id, "payload": serialize_named(named, gpu_uuid), "entries": entries}
