"""megatron-core on a CPU-only torch (stage: train): what `train.backend=megatron` with `train.device=cpu` needs.

megatron-core's forward, pipeline schedule and MoE dispatcher call CUDA-only helpers that do nothing a CPU run
needs: `torch.cuda.current_device()` (the device of its global memory buffer, of RoPE's inverse frequencies and of
the MoE router's weight: here the CPU), the CUDA RNG tracker's `fork` (dropout under tensor parallelism; our
configs have none), the CUDA RNG state that activation recompute saves and restores, the MoE all-to-all
dispatcher's side stream and its numpy conversion of split sizes (done only for GPU tensors), and the pipeline
schedule's device syncs and "cuda" tensors, and RoPE's per-CP-rank slice (its indices in pinned memory). `enable()` replaces exactly those, process-wide, and only in a process
whose torch has no CUDA device: there each call would raise, so nothing that worked before changes. A process with
a GPU is refused (megatron would place its buffers on it).

Invariant: called before the first megatron model is built in the process; calling it again changes nothing.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

_enabled = False


def enable() -> None:
    """Let megatron-core's training step run on this process's CPU (see the module docstring)."""
    global _enabled
    if _enabled:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "train.device=cpu with train.backend=megatron on a machine with a CUDA device: megatron-core places its "
            "buffers on the current CUDA device; set train.device=cuda (or hide the GPUs: CUDA_VISIBLE_DEVICES=)"
        )
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher

    import miles_hpc.train.mcore_model  # noqa: F401  (its import-time fixes for megatron-core 0.16 without TE)

    cuda: Any = torch.cuda  # patched through Any: the stand-ins do not have the CUDA functions' types
    tensor: Any = torch.Tensor
    tracker: Any = mrandom.CudaRNGStatesTracker
    cuda.current_device = lambda: "cpu"
    tracker.fork = lambda self, name=None: contextlib.nullcontext()
    # Activation recompute saves and restores the CUDA RNG state around a layer; a CPU run has none (its CPU state
    # is saved and restored beside it).
    mrandom_any: Any = mrandom
    mrandom_any._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom_any._set_cuda_rng_state = lambda *args, **kwargs: None
    # The MoE all-to-all dispatcher moves its split sizes to the host on a side CUDA stream: one stand-in stream
    # that is also the current one makes that a plain copy (the tensors are on the CPU already).
    done = types.SimpleNamespace(synchronize=lambda: None)
    stream = types.SimpleNamespace(
        wait_stream=lambda other: None, synchronize=lambda: None, record_event=lambda *args: done
    )
    cuda.Stream = lambda *args, **kwargs: stream
    cuda.current_stream = lambda *args, **kwargs: stream
    cuda.stream = lambda s: contextlib.nullcontext()
    # ... and converts them to numpy only when they come from a GPU; all_to_all_single wants sequences.
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    # Pipeline stages: the schedule counts tokens in a tensor it makes on "cuda", the p2p exchange synchronises the
    # device after its batched sends, and the tied embedding's first sync moves the weight with `.cuda()`.
    schedules.torch = _CpuTorch("torch")
    cuda.synchronize = lambda *args, **kwargs: None
    tensor.cuda = lambda self, *args, **kwargs: self
    # Context parallelism: RoPE's per-rank slice builds its chunk indices in pinned memory (CUDA's).
    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):  # each imported it by name
        patched: Any = module
        patched.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    _enabled = True


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """megatron-core's `get_pos_emb_on_this_cp_rank` (rope_utils.py) without pinned memory: the chunks r and
    2 CP - 1 - r of 2 CP equal ones along `seq_dim`."""
    cp, r = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
    picked = chunks.index_select(seq_dim, torch.tensor([r, 2 * cp - 1 - r], device=pos_emb.device))
    return picked.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 1 :])


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


class _CpuTorch(types.ModuleType):
    """torch as megatron's pipeline schedule sees it: tensors it asks for on "cuda" are made on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
