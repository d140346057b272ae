"""Weight-sync times as Miles runs them, calibrated on its published figures (stage: sync; docs/planning.md).

:func:`miles_hpc.planner.estimate.estimate`'s ``broadcast.seconds`` and ``p2p.seconds`` are wire lower bounds. This
module models what dominates in practice, for the two paths of Miles' Megatron trainer
(``update_weight_from_distributed``): both first all-gather each bucket of a pipeline stage over its TP and EP
groups and convert it to HF names, then

- **broadcast**: the stage's source rank (DP = TP = 0) broadcasts every tensor over NCCL to every rank of every
  engine. One lock (a Ray actor) serializes the buckets of all pipeline stages, so the broadcasts run one at a time
  while the other stages gather and convert;
- **p2p**: every trainer rank loads the gathered tensors into a CPU replica of one engine rank's shard, once per
  engine rank it serves (the replica's memory is reused, one target after another), and RDMA-writes that shard.

Inputs are the model (HF config), the trainer's Megatron layout (TP, PP, CP, EP), the engines (count, GPUs each,
EP, DP attention), the NIC and the bucket size. Every constant below is an assumption with its reason, or fitted
on one named published figure; `miles_hpc/planner/published.py` holds the figures and refits both to check them.

Invariants: times grow with the bytes, the engine ranks and the bucket count, and shrink with the link rate; no
published time enters a prediction (only the two fitted constants, which the tests recompute).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles_hpc.planner.accounting import ModelSpecError, model_config, model_tensors

# A priori constants (assumptions, not fitted).
NCCL_EFFICIENCY = 0.95  # share of a NIC's line rate one large NCCL or RDMA stream reaches (nccl-tests on 400G IB)
NVLINK_GBPS = 450.0  # H100 NVLink 4 per GPU and direction, GB/s (900 GB/s both ways, NVIDIA's H100 datasheet)
CONVERT_GBPS = 1000.0  # trainer GPU: HF conversion (and fp8 quantization) reads bf16 at ~1/3 of H100 HBM's 3.35 TB/s
TENSOR_HOST_S = 20e-6  # per HF tensor on the source: Python dispatch and kernel launches of gather and convert
NCCL_OP_S = 10e-6  # per broadcast call: NCCL launch and ring start (one call per HF tensor, as Miles issues them)
BUCKET_S = 2e-3  # per bucket: the lock actor's acquire/release and the engines' metadata RPC round trip (Ray)
HOP_S = 5e-6  # per ring hop, once per bucket: Miles waits for every engine after each bucket, so the ring drains
RDMA_OP_S = 20e-6  # per RDMA write (one per engine tensor and target): Mooncake submit and completion
FP8_SCALE_BLOCK = 128  # fp8 rollouts: one fp32 scale per 128 x 128 block, sent as its own tensor

# Fitted constants (docs/planning.md, "Calibrated weight-sync model"; published.py refits them).
MLA_LOAD_S = 4.0e-4  # broadcast: engine-side load per HF weight in the MLA (DeepSeek-family) loader; GLM-5 fit
REPLICA_GBPS = 262.0  # p2p: one pass of the CPU replica over a stage's weights (rollout dtype), GB/s; Qwen3 fit

_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncLayout:
    """The trainer's Megatron layout, the engines and the hardware one sync runs on."""

    train_gpus: int
    train_tp: int = 1
    train_pp: int = 1
    train_cp: int = 1
    train_ep: int = 1
    engines: int = 1
    engine_gpus: int = 8  # GPUs (TP ranks) per engine
    engine_ep: int = 1
    engine_dp_attention: bool = False  # SGLang DP attention: non-expert weights whole on every engine rank
    gpus_per_node: int = 8
    link_gbits: float = 400.0  # NIC line rate per GPU, Gb/s
    rollout_bytes: int = 2  # 2: bf16, 1: fp8 linear weights
    bucket_gb: float = 1.0  # Miles' --update-weight-buffer-size, GB

    def __post_init__(self) -> None:
        for key in ("train_gpus", "train_tp", "train_pp", "train_cp", "train_ep", "engines", "engine_gpus"):
            if getattr(self, key) < 1:
                raise ModelSpecError(f"{key}: must be >= 1, got {getattr(self, key)}")
        for key in ("engine_ep", "gpus_per_node"):
            if getattr(self, key) < 1:
                raise ModelSpecError(f"{key}: must be >= 1, got {getattr(self, key)}")
        dense = self.train_tp * self.train_pp * self.train_cp
        if self.train_gpus % dense:
            raise ModelSpecError(f"train_tp x train_pp x train_cp = {dense} must divide train_gpus {self.train_gpus}")
        if self.train_gpus % (self.train_ep * self.train_pp):
            raise ModelSpecError(
                f"train_ep x train_pp = {self.train_ep * self.train_pp} must divide train_gpus {self.train_gpus}"
            )
        if self.engine_gpus % self.engine_ep:
            raise ModelSpecError(f"engine_ep {self.engine_ep} must divide engine_gpus {self.engine_gpus}")
        if self.link_gbits <= 0 or self.bucket_gb <= 0:
            raise ModelSpecError("link_gbits and bucket_gb must be > 0")
        if self.rollout_bytes not in (1, 2):
            raise ModelSpecError(f"rollout_bytes: 2 (bf16) or 1 (fp8), got {self.rollout_bytes}")

    @property
    def link_gbps(self) -> float:
        """GB/s one NCCL or RDMA stream gets out of one GPU's NIC."""
        return self.link_gbits / 8 * NCCL_EFFICIENCY

    @property
    def engine_ranks(self) -> int:
        return self.engines * self.engine_gpus

    @property
    def stage_gpus(self) -> int:
        return self.train_gpus // self.train_pp


@dataclass(frozen=True, slots=True)
class Weights:
    """What one sync moves (bytes in the rollout dtype, ``*_bf16`` as the trainer gathers them) and how many HF
    tensors it has (fp8: each quantized weight adds its scale tensor)."""

    expert: int
    other: int
    expert_bf16: int
    other_bf16: int
    tensors: int
    expert_tensors: int
    moe_layers: int
    hf_weights: int  # HF tensors without fp8 scales
    mla: bool

    @property
    def total(self) -> int:
        return self.expert + self.other

    @property
    def total_bf16(self) -> int:
        return self.expert_bf16 + self.other_bf16


def weights(cfg: Mapping[str, Any], rollout_bytes: int = 2) -> Weights:
    """Split the model's HF tensors into routed experts and the rest (:mod:`estimate`'s element sizes, plus fp8
    block scales)."""
    from miles_hpc.planner.estimate import element_bytes  # estimate imports this module

    t = model_tensors(cfg)
    sums = {"expert": 0, "other": 0, "expert_bf16": 0, "other_bf16": 0}
    tensors, expert_tensors, moe_layers = 0, 0, 0
    for name, shape in t.all().items():
        n = math.prod(shape)
        size = element_bytes(name, rollout_bytes)
        part = "expert" if _EXPERT.search("." + name) else "other"
        scaled = rollout_bytes == 1 and size == 1 and len(shape) == 2
        if scaled:
            size_scales = 4 * math.ceil(shape[0] / FP8_SCALE_BLOCK) * math.ceil(shape[1] / FP8_SCALE_BLOCK)
            sums[part] += size_scales
        sums[part] += n * size
        sums[part + "_bf16"] += n * (4 if size == 4 else 2)
        tensors += 2 if scaled else 1
        expert_tensors += (2 if scaled else 1) if part == "expert" else 0
    for layer in t.layers:
        moe_layers += any(_EXPERT.search("." + k) for k in layer)
    return Weights(
        tensors=tensors,
        expert_tensors=expert_tensors,
        moe_layers=moe_layers,
        hf_weights=len(t.all()),
        mla=model_config(cfg).is_mla,
        **sums,
    )


def _gather_s(w: Weights, s: SyncLayout) -> float:
    """One stage's TP/EP all-gather, every rank ending with the whole stage in bf16: the expert bytes that cross
    nodes enter each node over all its NICs; the rest moves over NVLink."""
    stage_experts = w.expert_bf16 / s.train_pp
    ep_nodes = math.ceil(s.train_ep / s.gpus_per_node)
    nics = min(s.train_ep, s.gpus_per_node)
    inter = stage_experts * (1 - 1 / ep_nodes) / (nics * s.link_gbps * 1e9)
    intra = w.total_bf16 / s.train_pp / (NVLINK_GBPS * 1e9)
    return inter + intra


def _convert_s(w: Weights, s: SyncLayout) -> float:
    """One stage's HF conversion (and fp8 quantization) on the GPU, plus the host cost per tensor."""
    return (w.total_bf16 / (CONVERT_GBPS * 1e9) + w.tensors * TENSOR_HOST_S) / s.train_pp


def _buckets(w: Weights, s: SyncLayout) -> int:
    """Buckets of all stages: each stage fills ``bucket_gb`` of gathered bf16, experts and the rest apart."""
    return math.ceil(w.total_bf16 / (s.bucket_gb * 1e9)) + 2 * s.train_pp


def broadcast(cfg: Mapping[str, Any], s: SyncLayout, w: Weights | None = None) -> dict[str, float]:
    """Seconds of one NCCL broadcast update and its terms. The locked section (every stage's buckets, one at a
    time): each tensor from its source rank to all engine ranks over NCCL's pipelined ring at the source NIC's
    rate, one NCCL call per tensor; per bucket the lock and RPC and the ring's drain (Miles waits for every
    engine); every engine rank then loads every weight of the bucket (MLA families: ``MLA_LOAD_S`` each). A stage's
    own gather and conversion overlap the other stages' broadcasts; the update takes the longer of the locked
    section and one stage's whole sequence (gather, convert, its share of the locked section)."""
    w = w or weights(cfg, s.rollout_bytes)
    n_buckets = _buckets(w, s)
    wire = w.total / (s.link_gbps * 1e9)
    ops = w.tensors * NCCL_OP_S
    buckets = n_buckets * (BUCKET_S + (s.engine_ranks + 1) * HOP_S)
    load = w.hf_weights * MLA_LOAD_S if w.mla else 0.0
    locked = wire + ops + buckets + load
    gather, convert = _gather_s(w, s), _convert_s(w, s)
    stage = gather + convert + locked / s.train_pp
    return {
        "seconds": max(locked, stage),
        "wire_s": wire,
        "ops_s": ops,
        "buckets_s": buckets,
        "engine_load_s": load,
        "locked_s": locked,
        "stage_s": stage,
        "gather_s": gather,
        "convert_s": convert,
        "buckets": n_buckets,
    }


def engine_rank_bytes(w: Weights, s: SyncLayout) -> float:
    """Bytes one engine rank holds: its experts (``1 / engine_ep``) and the rest whole under DP attention, else
    split over the engine's GPUs."""
    return w.expert / s.engine_ep + w.other / (1 if s.engine_dp_attention else s.engine_gpus)


def p2p(cfg: Mapping[str, Any], s: SyncLayout, w: Weights | None = None) -> dict[str, float]:
    """Seconds of one p2p (RDMA) update and its terms, on the busiest trainer rank; all stages run at once. After
    the same gather and conversion, the rank serves ``targets`` engine ranks one after another: for each, one pass
    of the CPU replica over the stage's weights (at REPLICA_GBPS), then the target's stage share over the NIC,
    one RDMA write per engine tensor."""
    w = w or weights(cfg, s.rollout_bytes)
    sources = s.stage_gpus  # every rank of a stage holds the gathered stage and sends
    targets = math.ceil(s.engine_ranks / sources)
    stage_bytes = w.total / s.train_pp
    replica = targets * stage_bytes / (REPLICA_GBPS * 1e9)
    send_bytes = targets * engine_rank_bytes(w, s) / s.train_pp
    wire = send_bytes / (s.link_gbps * 1e9)
    # engine tensors per stage: the non-expert HF tensors (fusions ignored) and 2 fused expert tensors per MoE layer
    per_stage = (w.tensors - w.expert_tensors + 2 * w.moe_layers) / s.train_pp
    writes = targets * per_stage * RDMA_OP_S
    gather, convert = _gather_s(w, s), _convert_s(w, s)
    return {
        "seconds": gather + convert + replica + wire + writes,
        "gather_s": gather,
        "convert_s": convert,
        "replica_s": replica,
        "wire_s": wire,
        "writes_s": writes,
        "targets_per_rank": targets,
        "max_send_gb": send_bytes / 1e9,
    }


def model(cfg: Mapping[str, Any], s: SyncLayout) -> dict[str, Any]:
    """Both paths for one layout (what ``estimate``'s ``sync`` shows as ``model``)."""
    w = weights(cfg, s.rollout_bytes)
    return {"broadcast": broadcast(cfg, s, w), "p2p": p2p(cfg, s, w), "weights_gb": w.total / 1e9}


def constants() -> dict[str, float]:
    """Every constant of the model, by name (printed with the calibration table)."""
    names = (
        "NCCL_EFFICIENCY NVLINK_GBPS CONVERT_GBPS TENSOR_HOST_S NCCL_OP_S BUCKET_S HOP_S RDMA_OP_S FP8_SCALE_BLOCK "
        "MLA_LOAD_S REPLICA_GBPS"
    ).split()
    return {n: float(globals()[n]) for n in names}
