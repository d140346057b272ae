"""The `Trainer` protocol (stage: train; docs/design.md section 5): the five verbs the loop and weight sync use.

Every trainer rank runs the same object; the controller (rank 0) broadcasts each rank its command and the
`TrainBatch` (see :mod:`miles_hpc.train.dist`), then every rank calls the same method. Invariants:

- Every method is a COLLECTIVE over the trainer world: all ranks call it, in the same order, with the same batch.
- Results are complete on rank 0 (metrics reduced across ranks, log-probs gathered for all samples); other ranks
  get the same metrics and may get an empty or partial list of log-probs.
- Tensor names are HF names (`miles_hpc.models.iter_hf_tensors`), the interface to checkpoints and weight sync.
- Per-token log-probs are aligned with the tokens: entry t is log p(token t | tokens < t); entry 0 is 0.0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from miles_hpc.train.batch import TrainBatch

__all__ = ["Trainer"]


@runtime_checkable
class Trainer(Protocol):
    """A training backend (FSDP2, Megatron): holds the policy weights, optimizer and LR schedule of one rank."""

    @property
    def rank(self) -> int:
        """This process's rank in the trainer world (0 = controller)."""
        ...

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        ...

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (counts every mini-batch update; restored by `load`)."""
        ...

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-token log-probs of every sample under the current weights (float32 math, no grad).

        Returns on rank 0 one list per sample of the batch, in batch order, `len(batch.tokens[i])` entries each,
        entry 0 = 0.0 (the first token has no logits before it). Other ranks return [].
        """
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step on `batch`: `updates_per_step` optimizer steps over mini-batches of it.

        Checks every sample's `token_hash` first (TITO) and raises `ValueError` naming the sample on mismatch.
        Returns metrics reduced across ranks (identical on every rank): at least `loss`, `pg_loss`, `clip_frac`,
        `grad_norm` (pre-clip), `lr`, `entropy`, `kl`, `tokens`, `mismatch/max_abs_logprob_diff`,
        `mismatch/mean_abs_logprob_diff`.
        """
        ...

    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights as (HF name, tensor), in `iter_hf_tensors` order. COLLECTIVE: every rank must
        iterate it to the end, in step. Rank 0 yields real tensors (on the trainer's device); other ranks may yield
        nothing or the same tensors (FSDPTrainer yields the same on every rank)."""
        ...

    def checksums(self, dtype: torch.dtype | None = None) -> dict[str, str]:
        """HF name -> `tensor_checksum(tensor.to(dtype))` of the full weights (dtype None = as held). COLLECTIVE;
        complete on rank 0, {} elsewhere."""
        ...

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write model, optimizer, scheduler, RNG and `extra` (the loop's JSON-able state) to `path`, atomically
        (a temp dir renamed when complete). COLLECTIVE. Returns the final path."""
        ...

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore everything `save` wrote; returns its `extra`. COLLECTIVE."""
        ...
