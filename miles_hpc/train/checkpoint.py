"""Trainer checkpoints: sharded model + optimizer (torch.distributed.checkpoint), LR schedule, RNG, loop state.

Stage: train. Layout of one checkpoint (docs/design.md section 3: ``RUN/checkpoints/step_N/``):

    step_N/dcp/            FSDP: DCP shards of {"model", "optim"} (each rank writes its own shards; resharding on
                           load to another world size is DCP's job)
    step_N/trainer.pt      FSDP: {"scheduler": LambdaLR state, "step": optimizer steps}   (rank 0)
    step_N/adapter/        LoRA (backend "fsdp-lora"): the adapter in PEFT's format; the base weights are not saved
    step_N/adapter_optim.pt LoRA: {"optim": AdamW state of the adapter, "scheduler", "step"} (rank 0; replicated)
    step_N/mcore/          megatron: megatron's dist_checkpointing of {"model", "optimizer"} (train/megatron.py)
    step_N/megatron.json   megatron: {"step", "tensor_parallel", "pipeline_parallel", "expert_parallel",
                           "data_parallel", "model": the HF config (a load of another model is refused)}
    step_N/rng_rank{r}.pt  torch CPU (+ CUDA) RNG state of rank r
    step_N/extra.json      the loop's state (step, data position, weight version, ...): JSON, inspectable
    step_N/meta.json       {"format", "step", "world_size", "backend"}: written last, before the rename

Invariants:
- Atomic: everything is written to ``step_N.partial/`` and renamed to ``step_N/`` by rank 0 once every rank has
  finished, so a crash mid-save never leaves a directory that looks complete; `latest_checkpoint` ignores
  ``.partial`` directories and directories without ``meta.json``.
- save and load are collectives over the trainer world; the directory must be on a filesystem all ranks share.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "checkpoint_path",
    "read_checkpoint",
    "write_checkpoint",
    "save_adapter_checkpoint",
    "load_adapter_checkpoint",
    "CHECKPOINT_FORMAT",
    "CheckpointDamagedError",
    "reading",
]

CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointDamagedError(ValueError):
    """A checkpoint file that exists but cannot be read (truncated, corrupted): names the file and what to do."""


@contextlib.contextmanager
def reading(root: Path, part: str | Path) -> Iterator[None]:
    """Any failure to read `part` of the checkpoint at `root` as a `CheckpointDamagedError` naming it (a truncated
    torch file, bad JSON, a short DCP shard otherwise fail with the library's words and no path)."""
    try:
        yield
    except CheckpointDamagedError:
        raise
    except Exception as e:
        raise CheckpointDamagedError(
            f"{root / part}: the checkpoint cannot be read ({type(e).__name__}: {str(e)[:300]}); if the file is "
            f"damaged, move {root} aside to resume from the checkpoint before it"
        ) from e


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``RUN/checkpoints``, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir() and (p / "meta.json").is_file()
    ]
    return max(found)[1] if found else None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_adapter_checkpoint(
    path: str | Path,
    adapter: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    step: int,
    extra: dict[str, Any],
    base_model: str,
) -> Path:
    """LoRA RL: the adapter (PEFT files) and its optimizer state only; every rank holds them whole, rank 0 writes."""
    from miles_hpc.models.lora import save_adapter

    def write_state(tmp: Path) -> None:
        if dist.get_rank() == 0:
            save_adapter(tmp / "adapter", adapter, base_model=base_model)
            state = {"optim": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step}
            torch.save(state, tmp / "adapter_optim.pt")

    return write_checkpoint(path, step=step, extra=extra, backend="fsdp-lora", write_state=write_state)


def load_adapter_checkpoint(
    path: str | Path, adapter: Any, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> tuple[int, dict[str, Any]]:
    """Restore a LoRA checkpoint into `adapter` (same spec: the file names the mismatch) and its optimizer."""
    from miles_hpc.models.lora import load_adapter

    root, extra = read_checkpoint(path, "fsdp-lora")
    spec, tensors = load_adapter(root / "adapter", device=next(adapter.parameters()).device)
    if spec != adapter.spec:
        raise ValueError(f"{root / 'adapter'}: adapter {spec} differs from this run's lora config {adapter.spec}")
    adapter.load_peft_state(tensors, source=str(root / "adapter"))
    with reading(root, "adapter_optim.pt"):
        state = torch.load(root / "adapter_optim.pt", weights_only=True, map_location=next(adapter.parameters()).device)
    optimizer.load_state_dict(state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"]), extra


def write_checkpoint(
    path: str | Path, *, step: int, extra: dict[str, Any], backend: str, write_state: Callable[[Path], None]
) -> Path:
    """Write a checkpoint to `path` atomically (collective): `write_state(dir)` writes the backend's own files on
    every rank (itself collective), then the RNG of each rank, the loop's `extra` (JSON) and `meta.json`."""
    final = Path(path)
    tmp = final.with_name(final.name + ".partial")
    rank = dist.get_rank()
    try:
        extra_text = json.dumps(extra, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint extra state must be JSON-serialisable: {e}") from None
    if rank == 0:
        if tmp.exists():  # left by a crashed save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    write_state(tmp)
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp / "extra.json").write_text(extra_text + "\n")
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": dist.get_world_size(), "backend": backend}
        (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
        if final.exists():  # re-saving the same step: move the old one aside first, never leave neither
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    _barrier()
    return final


def read_checkpoint(path: str | Path, backend: str) -> tuple[Path, dict[str, Any]]:
    """Check that `path` is a complete checkpoint of `backend`, restore this rank's RNG; returns (dir, extra)."""
    root = Path(path)
    if not (root / "meta.json").is_file():
        raise FileNotFoundError(f"{root}: not a complete checkpoint (no meta.json)")
    with reading(root, "meta.json"):
        meta = json.loads((root / "meta.json").read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{root}: checkpoint format {meta.get('format')}, this code reads {CHECKPOINT_FORMAT}")
    saved = meta.get("backend", "fsdp")  # checkpoints before the megatron backend are FSDP's
    if saved != backend:
        raise ValueError(
            f"{root}: written by the {saved} backend, this run uses train.backend={backend} (export it "
            "to HF format with `miles-hpc export` and start from that instead)"
        )
    rng_file = root / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved: those ranks keep their seed
        with reading(root, rng_file.name):
            rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    with reading(root, "extra.json"):
        return root, json.loads((root / "extra.json").read_text())


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    step: int,
    extra: dict[str, Any],
) -> Path:
    """Write an FSDP checkpoint to `path` atomically (collective). `extra` must be JSON-serialisable."""

    def write_state(tmp: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        if dist.get_rank() == 0:
            torch.save({"scheduler": scheduler.state_dict(), "step": step}, tmp / "trainer.pt")

    return write_checkpoint(path, step=step, extra=extra, backend="fsdp", write_state=write_state)


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer, scheduler and this rank's RNG from `path` (collective); returns (step, extra)."""
    root, extra = read_checkpoint(path, "fsdp")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with reading(root, "dcp"):
        dcp.load(state, checkpoint_id=str(root / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with reading(root, "trainer.pt"):
        trainer = torch.load(root / "trainer.pt", weights_only=True)
    scheduler.load_state_dict(trainer["scheduler"])
    return int(trainer["step"]), extra
