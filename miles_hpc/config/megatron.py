"""The `megatron` section of a run config (`train.backend: megatron`; train/megatron.py, docs/megatron.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from miles_hpc.config.loader import meta as _help
from miles_hpc.config.loader import require as _require

__all__ = ["MegatronConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronConfig:
    """`train.backend: megatron` (train/megatron.py): megatron-core's parallel layout over the trainer ranks."""

    tensor_parallel: int = field(default=1, metadata=_help("TP: ranks that split each layer (consecutive ranks)"))
    pipeline_parallel: int = field(
        default=1, metadata=_help("PP: pipeline stages (megatron's 1F1B schedule; they split the layers evenly)")
    )
    virtual_pipeline: int = field(
        default=1,
        metadata=_help(
            "virtual pipeline stages: model chunks per stage (megatron's interleaved schedule; a smaller bubble, "
            "more activations in flight); needs pipeline_parallel >= 3"
        ),
    )
    expert_parallel: int = field(
        default=1,
        metadata=_help("EP: ranks of a pipeline stage (of TP x CP x DP) that split the MoE experts (expert TP 1)"),
    )
    context_parallel: int = field(
        default=1,
        metadata=_help("CP: ranks that split each packed row (all-gather attention; not with the DSA indexer loss)"),
    )
    distributed_optimizer: bool = field(
        default=True, metadata=_help("shard fp32 master weights and Adam state over data-parallel ranks")
    )
    optimizer_offload_fraction: float = field(
        default=0.0,
        metadata=_help(
            "share of the optimizer states (and their Adam step) on the host: megatron's CPU offload (0: off)"
        ),
    )
    precision_aware_optimizer: bool = field(
        default=False,
        metadata=_help("megatron's precision-aware optimizer: with offload, no fp32 master copy left on the GPU"),
    )
    main_grads_dtype: Literal["fp32", "bf16"] = field(
        default="fp32", metadata=_help("gradient buffer dtype (bf16 needs precision_aware_optimizer)")
    )
    recompute_granularity: Literal["full", "selective"] = field(
        default="full",
        metadata=_help(
            "with train.activation_checkpointing: full (each layer keeps its input) or selective (megatron's "
            "core_attn: the attention scores and softmax are recomputed)"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "virtual_pipeline", "expert_parallel", "context_parallel"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require(
            self.virtual_pipeline == 1 or self.pipeline_parallel >= 3,
            "virtual_pipeline",
            f"{self.virtual_pipeline} virtual stages need pipeline_parallel >= 3 (they split each stage's layers; at "
            "2 stages megatron-core's interleaved schedule crosses activations and gradients between the two ranks)",
        )
        f = self.optimizer_offload_fraction
        _require(0.0 <= f <= 1.0, "optimizer_offload_fraction", f"must be in [0, 1], got {f}")
        needs_dist = f > 0 or self.precision_aware_optimizer
        _require(
            self.distributed_optimizer or not needs_dist,
            "distributed_optimizer",
            "optimizer_offload_fraction > 0 and precision_aware_optimizer need megatron's distributed optimizer",
        )
        _require(
            not self.precision_aware_optimizer or f > 0,
            "precision_aware_optimizer",
            "without offload megatron's precision-aware optimizer needs Transformer Engine's FusedAdam, which this "
            "backend does not use: set optimizer_offload_fraction > 0 or precision_aware_optimizer=false",
        )
        _require(
            self.main_grads_dtype == "fp32" or self.precision_aware_optimizer,
            "main_grads_dtype",
            "bf16 gradients need precision_aware_optimizer=true (megatron keeps fp32 gradients otherwise)",
        )
