"""Megatron training layouts: the GPU and host memory of one trainer rank for a (TP, PP, EP, CP, DP) layout and the
memory options, and the search for the layouts that fit a cluster (stage: planner; `miles-hpc plan --layouts`,
`miles-hpc prepare`; docs/planning.md, "Megatron layouts").

Invariants.
- What a rank holds is counted from `planner/mcore_layout.mcore_rules`, the tensors the megatron trainer builds
  (expert TP 1: a routed expert whole on one EP rank; TP splits rows or columns; the vocabulary padded to a
  multiple of 128 x TP; pipeline stages split the decoder layers evenly, the embedding on the first, the final
  norm, output layer and MTP layers on the last). Per layer the tensors are summed by (replicated | TP-split |
  expert) x (trained | frozen): one layout costs O(layers); `rank_elements` = the sum of `mcore_boxes` (tested).
- Bytes per element (megatron-core 0.16 without Transformer Engine): weights in bf16 (`train.mixed_precision` on a
  GPU), gradients in the DDP buffer in fp32 (`grad_reduce_in_fp32`) or bf16 (`megatron.main_grads_dtype`), and per
  trained element of the optimizer's shard (the data-parallel group with CP for dense tensors, the expert
  data-parallel group for experts, with the distributed optimizer; every element without it) fp32 master + Adam's
  two moments, 12 B. Offloaded (`megatron.optimizer_offload_fraction` f, megatron's HybridDeviceOptimizer): a
  fraction f of the shard's elements lives on the host as fp32 master, fp32 gradient copy and two fp32 moments
  (16 B); without `megatron.precision_aware_optimizer` the GPU keeps the fp32 master of the offloaded part too.
- Activations of one micro-batch follow `accounting.layer_saved` (what our model keeps, per token) split over
  TP (sequence parallelism) and CP, plus, where the core attention is a masked softmax (under CP; DSA's), its
  float32 output and bf16 copy, [heads / TP, S / CP, S] per sequence and layer (SDPA per sequence without CP keeps
  none: `accounting.sdpa_core_attention`). Under 1F1B stage s holds PP - s micro-batches in flight; interleaved
  (VPP virtual stages) 2 (PP - s - 1) + (VPP - 1) PP + 1 chunk forwards, i.e. (1 + (PP - 1) / (PP VPP)) times
  1F1B's activations on stage 0; the last stage also the logits. Full recompute: a layer keeps its input, one
  layer's whole set the largest temporary; selective (megatron's core_attn): all but the softmax, one layer's
  softmax the temporary. A DSA full layer's selection (int32 [S, min(index_topk, S)] per sequence) is held per
  micro-batch in flight in every mode, as is one layer's attention backward: d(probabilities) and d(scores) in
  float32 and d(probabilities) in bf16, [heads / TP, S / CP, S] each (an H100's step of 16 heads at 4,096 tokens
  peaked there: 3.25 GB in autograd; docs/benchmarks.md).
- Nothing is measured here; `assumptions()` lists what the figures rest on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

from miles_hpc.models import ModelConfig
from miles_hpc.planner.accounting import (
    ACT_BYTES,
    F32,
    ModelSpecError,
    layer_saved,
    model_config,
    model_tensors,
    sdpa_core_attention,
)
from miles_hpc.planner.mcore_layout import (
    INDEXER_SCORE_ELEMENTS,
    StageLayout,
    is_frozen,
    layout_limits,
    mcore_rules,
    padded_vocab_size,
)

GB = 1e9
USABLE = 0.9  # of a GPU's and a node's memory: CUDA context, NCCL buffers, fragmentation; the OS, pinned limits
MASTER_ADAM = 12  # fp32 master + Adam m + v, bytes per trained element of the optimizer's shard
HOST_ADAM = 16  # offloaded: fp32 master, fp32 gradient copy, m, v on the host
Recompute = Literal["none", "selective", "full"]
RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}  # the search tries them in this order


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One node of the training cluster: GPUs, memory per GPU, host memory usable for optimizer states."""

    name: str
    gpus: int
    gpu_mem_gb: float
    host_mem_gb: float
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("gpus", "gpu_mem_gb", "host_mem_gb"):
            if getattr(self, key) <= 0:
                raise ModelSpecError(f"{key}: must be > 0, got {getattr(self, key)}")

    @property
    def gpu_bytes(self) -> float:
        """What a plan may fill of one GPU (`USABLE` of it)."""
        return USABLE * self.gpu_mem_gb * GB

    @property
    def host_bytes(self) -> float:
        """What a plan may fill of one node's host memory (`USABLE` of it)."""
        return USABLE * self.host_mem_gb * GB


# Vendors' figures (the source says which); a site's nodes may differ: override with --gpu-mem-gb / --host-mem-gb.
NODES: dict[str, Node] = {
    n.name: n
    for n in (
        Node(name="h200", gpus=8, gpu_mem_gb=141, host_mem_gb=2048, source="DGX H200: 8 x 141 GB, 2 TB system memory"),
        Node(
            name="b300",
            gpus=8,
            gpu_mem_gb=288,
            host_mem_gb=2048,
            source="HGX / DGX B300: 8 x 288 GB; 2 TB host memory assumed (vendors' configurations differ)",
        ),
        Node(
            name="gb300",
            gpus=4,
            gpu_mem_gb=288,
            host_mem_gb=944,
            source="GB300 NVL72 compute tray: 4 Blackwell Ultra GPUs of 288 GB, 2 Grace CPUs; up to 17 TB LPDDR5X per "
            "18-tray rack = 944 GB per tray",
        ),
        Node(
            name="mi300x",
            gpus=8,
            gpu_mem_gb=192,
            host_mem_gb=1986,
            source="8 x MI300X of 192 GB; 1,850 GiB host memory as Azure's ND MI300X v5 (sites differ)",
        ),
    )
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Megatron's parallel sizes: TP x CP x DP x PP = trainer ranks; experts split over EP inside TP x CP x DP
    (expert tensor parallelism 1, expert data parallelism the rest)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int = 1  # virtual pipeline stages: model chunks per stage (megatron's interleaved schedule)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.cp * self.dp // self.ep

    def __str__(self) -> str:
        vpp = f" (VPP {self.vpp})" if self.vpp > 1 else ""
        return f"TP {self.tp} x PP {self.pp}{vpp} x EP {self.ep} x CP {self.cp} x DP {self.dp}"

    def stage_layers(self, num_layers: int, stage: int) -> list[int]:
        """The decoder layers pipeline `stage` holds (its model chunks' under virtual stages: `StageLayout`)."""
        per = num_layers // (self.pp * self.vpp)
        return [c * per + k for c in range(stage, self.pp * self.vpp, self.pp) for k in range(per)]

    def chunks_in_flight(self, stage: int) -> int:
        """Micro-batch x model-chunk forwards whose activations `stage` holds at the peak: PP - stage under 1F1B;
        under the interleaved schedule its warm-up, 2 (PP - stage - 1) + (VPP - 1) PP, plus one (megatron's
        `get_pp_rank_microbatches` with its default group of PP micro-batches; enough micro-batches assumed)."""
        if self.vpp == 1:
            return self.pp - stage
        return 2 * (self.pp - stage - 1) + (self.vpp - 1) * self.pp + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryOptions:
    """The megatron memory options (`megatron.*` keys; `recompute`: `train.activation_checkpointing` with
    `megatron.recompute_granularity`)."""

    distributed_optimizer: bool = True
    offload_fraction: float = 0.0
    precision_aware: bool = False
    main_grads_bf16: bool = False
    recompute: Recompute = "none"
    mixed_precision: bool = True  # bf16 weights (a GPU run); fp32 weights otherwise

    def __post_init__(self) -> None:
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ModelSpecError(f"offload_fraction: must be in [0, 1], got {self.offload_fraction}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """One training micro-batch: `micro_batch` packed sequences of `seq_len` tokens."""

    seq_len: int = 4096
    micro_batch: int = 1


@dataclass(frozen=True, slots=True)
class _LayerSums:
    """Elements of one megatron module group (a decoder layer, or the first / last stage's extras) by kind."""

    replicated: tuple[int, int] = (0, 0)  # (trained, frozen)
    split: tuple[int, int] = (0, 0)  # TP-split rows or columns: / tp
    expert: tuple[int, int] = (0, 0)  # all routed experts of the group: / ep
    vocab: tuple[int, int] = (0, 0)  # (rows, width) of a vocabulary-parallel tensor (padded per TP)
    split_dims: frozenset[int] = frozenset()  # sizes TP must divide


@dataclass(frozen=True, slots=True)
class RankElements:
    """Elements one rank of a pipeline stage holds (TP rank 0, EP rank 0: the largest share)."""

    dense_trained: int
    dense_frozen: int
    expert_trained: int
    expert_frozen: int

    @property
    def total(self) -> int:
        return self.dense_trained + self.dense_frozen + self.expert_trained + self.expert_frozen


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes on one GPU (its busiest pipeline stage) and on the host for that GPU."""

    stage: int
    elements: RankElements
    weights: int
    grads: int
    optimizer_gpu: int
    optimizer_host: int
    activations: int
    activation_terms: dict[str, int] = field(default_factory=dict)

    @property
    def gpu(self) -> int:
        return self.weights + self.grads + self.optimizer_gpu + self.activations


def _key(cfg: Mapping[str, Any]) -> str:
    import json

    return json.dumps(dict(cfg), sort_keys=True, default=str)


@lru_cache(maxsize=8)
def _sums(key: str) -> tuple[tuple[_LayerSums, ...], _LayerSums, _LayerSums]:
    """(per decoder layer, the first stage's extras, the last stage's extras: final norm, output layer, MTP)."""
    import json

    cfg = json.loads(key)
    mc = model_config(cfg)
    shapes = model_tensors(cfg).all()
    layers: list[dict[str, Any]] = [_empty() for _ in range(mc.num_hidden_layers)]
    first, last = _empty(), _empty()
    layout = StageLayout(1, mc.num_hidden_layers)
    for rule in mcore_rules(mc):
        numel = sum(math.prod(shapes[n]) for n in rule.hf)
        frozen = int(is_frozen(rule.mcore))
        m = layout.layer_of(rule.mcore)
        group = layers[m] if m is not None else first if rule.mcore.startswith("embedding.") else last
        if rule.expert is not None:
            group["expert"][frozen] += numel
        elif rule.kind == "replicated":
            group["replicated"][frozen] += numel
        elif rule.kind == "vocab":
            group["vocab"] = (mc.vocab_size, shapes[rule.hf[0]][1])
            group["vocab_frozen"] = frozen
        else:
            group["split"][frozen] += numel
            dim = mc.num_key_value_heads if rule.kind == "qkv" else shapes[rule.hf[0]][1 if rule.kind == "cols" else 0]
            group["dims"].add(dim)
    return tuple(_freeze(g) for g in layers), _freeze(first), _freeze(last)


def _empty() -> dict[str, Any]:
    return {"replicated": [0, 0], "split": [0, 0], "expert": [0, 0], "vocab": (0, 0), "dims": set()}


def _freeze(g: dict[str, Any]) -> _LayerSums:
    return _LayerSums(
        tuple(g["replicated"]), tuple(g["split"]), tuple(g["expert"]), tuple(g["vocab"]), frozenset(g["dims"])
    )


def layout_problems(cfg: Mapping[str, Any], layout: Layout, *, limits: bool = True) -> list[str]:
    """Why megatron cannot build `cfg` in `layout` (empty: it can), each naming the size and what it must divide;
    with `limits`, also what the trainer does not implement yet (`mcore_layout.layout_limits`)."""
    mc = model_config(cfg)
    out = []
    if mc.num_hidden_layers % (layout.pp * layout.vpp):
        vpp = f" x VPP {layout.vpp}" if layout.vpp > 1 else ""
        out.append(f"PP {layout.pp}{vpp} does not divide the {mc.num_hidden_layers} decoder layers")
    if layout.vpp > 1 and layout.pp < 3:
        out.append(f"VPP {layout.vpp} needs PP >= 3 (megatron-core's interleaved schedule; train/mcore_pipeline.py)")
    layers, first, last = _sums(_key(cfg))
    dims = sorted({d for g in (*layers, first, last) for d in g.split_dims if d % layout.tp})
    if dims:
        out.append(f"TP {layout.tp} does not divide the split dimension(s) {', '.join(map(str, dims))}")
    if mc.num_experts:
        if mc.num_experts % layout.ep:
            out.append(f"EP {layout.ep} does not divide the {mc.num_experts} routed experts")
        if (layout.tp * layout.cp * layout.dp) % layout.ep:
            out.append(f"EP {layout.ep} does not divide TP x CP x DP = {layout.tp * layout.cp * layout.dp}")
    elif layout.ep > 1:
        out.append(f"EP {layout.ep} on a dense model")
    return out + (layout_limits(mc, pp=layout.pp, vpp=layout.vpp) if limits else [])


def rank_elements(cfg: Mapping[str, Any], layout: Layout, stage: int) -> RankElements:
    """Elements that TP rank 0 / EP rank 0 of pipeline `stage` holds (TP ranks hold equal shares but the last
    vocabulary rows; EP ranks equal shares)."""
    mc = model_config(cfg)
    layers, first, last = _sums(_key(cfg))
    groups = [layers[i] for i in layout.stage_layers(mc.num_hidden_layers, stage)]
    if stage == 0:
        groups.append(first)
    if stage == layout.pp - 1:
        groups.append(last)
        if mc.tie_word_embeddings and layout.pp > 1:  # the last stage's copy of the embedding
            groups.append(replace(first, replicated=(0, 0), split=(0, 0), expert=(0, 0)))
    dense, expert = [0, 0], [0, 0]
    for g in groups:
        for f in (0, 1):
            dense[f] += g.replicated[f] + g.split[f] // layout.tp
            expert[f] += g.expert[f] // layout.ep
        rows, width = g.vocab
        if rows:
            dense[0] += padded_vocab_size(rows, layout.tp) // layout.tp * width
    return RankElements(dense[0], dense[1], expert[0], expert[1])


def _activations(mc: ModelConfig, layout: Layout, opts: MemoryOptions, batch: Batch, stage: int) -> dict[str, int]:
    """Activation bytes of `stage`'s rank: `Layout.chunks_in_flight` forwards of one of its model chunks held, the
    stage's layers' share of them (its layers x in flight / VPP; docstring)."""
    a, n, s = ACT_BYTES if opts.mixed_precision else F32, batch.micro_batch, batch.seq_len
    split = layout.tp * layout.cp
    ids = layout.stage_layers(mc.num_hidden_layers, stage)
    per = len(ids)
    heads = mc.num_attention_heads // layout.tp
    scores = 0 if sdpa_core_attention(mc.is_dsa, layout.cp) else n * heads * (s // layout.cp) * s  # [heads, S, S]
    probs = scores * (F32 + a)  # the softmax's float32 output and a bf16 copy
    layer_sets = [sum(layer_saved(mc, i, seq_len=s, micro_batch=n, act_bytes=a).values()) // split + probs for i in ids]
    in_flight, vpp = layout.chunks_in_flight(stage), layout.vpp
    out: dict[str, int] = {}
    if opts.recompute == "none":
        out["layers"] = in_flight * sum(layer_sets) // vpp
    elif opts.recompute == "selective":
        out["layers"] = in_flight * sum(x - probs for x in layer_sets) // vpp
        out["recompute"] = probs
    else:
        out["layer_inputs"] = in_flight * per * n * s * mc.hidden_size * a // split // vpp
        out["recompute"] = max(layer_sets) + (_indexer_peak(mc, s, n) if any(mc.indexer_full(i) for i in ids) else 0)
    out["attention_backward"] = scores * (2 * F32 + a)  # one layer's: d(probs), d(scores) float32, d(probs) bf16
    if mc.is_dsa:  # each full layer's selection, held for its micro-batch's backward (train/mcore_dsa.py)
        full = sum(mc.indexer_full(i) for i in ids)
        out["dsa_selections"] = in_flight * full * n * s * min(mc.index_topk, s) * 4 // vpp
    if stage == layout.pp - 1:
        vocab = padded_vocab_size(mc.vocab_size, layout.tp) // layout.tp
        out["logits"] = 2 * n * (s // layout.cp) * vocab * a  # the logits and their gradient
    return out


def _indexer_peak(mc: ModelConfig, seq_len: int, micro_batch: int) -> int:
    """Temporary bytes of the megatron trainer's DSA indexer selecting (no grad, the whole row on every rank):
    float32 queries, keys and head weights of the row, and the float32 scores of one chunk of query rows
    (`INDEXER_SCORE_ELEMENTS`), three copies (the product, its relu, the weighted one)."""
    if not mc.is_dsa:
        return 0
    heads, d = mc.index_n_heads, mc.index_head_dim
    chunk = min(INDEXER_SCORE_ELEMENTS, seq_len * heads * seq_len)
    return F32 * seq_len * micro_batch * (heads * d + d + heads) + 3 * F32 * chunk


def rank_memory(cfg: Mapping[str, Any], layout: Layout, opts: MemoryOptions, batch: Batch) -> RankMemory:
    """The memory of the busiest pipeline stage's rank (most GPU bytes)."""
    mc = model_config(cfg)
    best: RankMemory | None = None
    for stage in range(layout.pp):
        el = rank_elements(cfg, layout, stage)
        w = 2 if opts.mixed_precision else 4
        g = 2 if opts.main_grads_bf16 else 4
        trained_dense, trained_expert = el.dense_trained, el.expert_trained
        shard = (
            trained_dense / (layout.dp * layout.cp) + trained_expert / layout.expert_dp
            if opts.distributed_optimizer
            else trained_dense + trained_expert
        )
        f = opts.offload_fraction
        master_adam = MASTER_ADAM if opts.mixed_precision else MASTER_ADAM - 4  # fp32 weights are their own master
        gpu_opt = (1 - f) * master_adam * shard + (0 if opts.precision_aware else f * 4 * shard)
        acts = _activations(mc, layout, opts, batch, stage)
        mem = RankMemory(
            stage=stage,
            elements=el,
            weights=w * el.total,
            grads=g * (trained_dense + trained_expert),
            optimizer_gpu=int(gpu_opt),
            optimizer_host=int(f * HOST_ADAM * shard),
            activations=sum(acts.values()),
            activation_terms=acts,
        )
        if best is None or mem.gpu > best.gpu:
            best = mem
    assert best is not None
    return best


@dataclass(frozen=True, slots=True)
class Candidate:
    """One layout with the options that make it fit (or the smallest shortfall, `short`)."""

    layout: Layout
    options: MemoryOptions
    memory: RankMemory | None
    problems: tuple[str, ...] = ()
    short_gb: float = 0.0  # GPU bytes short per GPU + host bytes short per node (inf: the layout is invalid)

    @property
    def fits(self) -> bool:
        return not self.problems

    def summary(self, node: Node) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": str(self.layout), "fits": self.fits, "problems": list(self.problems)}
        if self.memory is not None:
            m = self.memory
            out.update(
                offload_fraction=self.options.offload_fraction,
                precision_aware=self.options.precision_aware,
                main_grads_bf16=self.options.main_grads_bf16,
                recompute=self.options.recompute,
                stage=m.stage,
                gpu_gb=m.gpu / GB,
                weights_gb=m.weights / GB,
                grads_gb=m.grads / GB,
                optimizer_gpu_gb=m.optimizer_gpu / GB,
                activations_gb=m.activations / GB,
                host_per_node_gb=m.optimizer_host * node.gpus / GB,
            )
        return out


def evaluate(
    cfg: Mapping[str, Any], layout: Layout, opts: MemoryOptions, batch: Batch, node: Node, *, limits: bool = True
) -> Candidate:
    """`layout` with exactly `opts`: fits, or the resources it is short of and by how much (`limits`:
    `layout_problems`)."""
    problems = layout_problems(cfg, layout, limits=limits)
    if opts.recompute == "selective" and limits:
        problems += layout_limits(model_config(cfg), recompute="selective")
    if problems:
        return Candidate(layout, opts, None, tuple(problems), math.inf)
    mem = rank_memory(cfg, layout, opts, batch)
    short, gpu_short = [], max(0.0, (mem.gpu - node.gpu_bytes) / GB)
    host_short = max(0.0, (mem.optimizer_host * node.gpus - node.host_bytes) / GB)
    if gpu_short:
        short.append(f"GPU memory short by {gpu_short:.1f} GB per GPU")
    if host_short:
        short.append(f"host memory short by {host_short:.1f} GB per node")
    return Candidate(layout, opts, mem, tuple(short), gpu_short + host_short)


def fit_options(
    cfg: Mapping[str, Any],
    layout: Layout,
    batch: Batch,
    node: Node,
    base: MemoryOptions | None = None,
    *,
    limits: bool = True,
) -> Candidate:
    """The cheapest options that fit `layout` on `node`, trying in turn: `base` as it is; selective recompute
    (where the trainer builds it for the family); full recompute; full recompute and the smallest optimizer offload
    fraction (steps of 0.05, precision-aware) that fits the GPU, if the host holds it; the same with bf16 main
    gradients. Without a fit: the last of these, with its shortfall."""
    base = base or MemoryOptions()
    problems = layout_problems(cfg, layout, limits=limits)
    if problems:
        return Candidate(layout, base, None, tuple(problems), math.inf)
    c = evaluate(cfg, layout, base, batch, node, limits=limits)
    if c.fits:
        return c
    recompute = base
    for mode in ("selective", "full"):
        if RECOMPUTE_COST[mode] <= RECOMPUTE_COST[base.recompute]:
            continue
        if limits and layout_limits(model_config(cfg), recompute=mode):  # not built for this family
            continue
        recompute = replace(base, recompute=mode)
        c = evaluate(cfg, layout, recompute, batch, node, limits=limits)
        if c.fits:
            return c
    for bf16_grads in (base.main_grads_bf16, True):
        opts = replace(recompute, precision_aware=True, main_grads_bf16=bf16_grads, offload_fraction=1.0)
        f = min_offload(cfg, layout, opts, batch, node)
        c = evaluate(cfg, layout, replace(opts, offload_fraction=f), batch, node, limits=limits)
        if c.fits:
            return c
    return c


def min_offload(cfg: Mapping[str, Any], layout: Layout, opts: MemoryOptions, batch: Batch, node: Node) -> float:
    """The smallest offload fraction (a multiple of 0.05) with which `opts` fit the GPU (1.0 when none does)."""
    gpu = node.gpu_bytes
    none = rank_memory(cfg, layout, replace(opts, offload_fraction=0.0), batch)
    spare = gpu - (none.gpu - none.optimizer_gpu)  # room for optimizer states on the GPU
    need = none.optimizer_gpu
    if need <= 0 or spare >= need:
        return 0.0
    step = math.ceil(20 * (1 - max(spare, 0) / need) - 1e-9)
    for k in range(step, 21):  # GPU bytes fall with f; the busiest stage may change: check each step up
        if rank_memory(cfg, layout, replace(opts, offload_fraction=k / 20), batch).gpu <= gpu:
            return k / 20
    return 1.0


def layouts(cfg: Mapping[str, Any], gpus: int, node: Node, *, max_cp: int = 1) -> Iterable[Layout]:
    """Every layout of `gpus` ranks: TP a power of two within a node, PP dividing the layers, EP dividing the
    experts and TP x CP x DP, CP a power of two up to `max_cp`."""
    mc = model_config(cfg)
    tps = [t for t in (1, 2, 4, 8, 16) if t <= node.gpus and gpus % t == 0]
    for tp in tps:
        for pp in (p for p in range(1, mc.num_hidden_layers + 1) if mc.num_hidden_layers % p == 0):
            for cp in (c for c in (1, 2, 4, 8) if c <= max_cp):
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                eps = [e for e in range(1, tp * cp * dp + 1) if (tp * cp * dp) % e == 0] if mc.num_experts else [1]
                for ep in eps:
                    if not mc.num_experts or mc.num_experts % ep == 0:
                        yield Layout(tp=tp, pp=pp, ep=ep, cp=cp, dp=dp)


def _cost(c: Candidate) -> tuple[Any, ...]:
    """Cheaper first: fits (else the smaller shortfall); less recompute; fp32 gradients; less offloaded; fewer
    pipeline stages (bubble); smaller TP (its all-reduces); smaller CP (its all-gathers); then fewer GPU bytes."""
    m = c.memory
    return (
        not c.fits,
        c.short_gb,
        RECOMPUTE_COST[c.options.recompute],
        c.options.main_grads_bf16,
        c.options.offload_fraction,
        c.layout.pp,
        c.layout.tp,
        c.layout.cp,
        m.gpu if m else math.inf,
    )


def search(
    cfg: Mapping[str, Any],
    gpus: int,
    node: Node,
    batch: Batch,
    base: MemoryOptions | None = None,
    *,
    limits: bool = True,
    max_cp: int = 1,
) -> list[Candidate]:
    """Every valid layout of `gpus` ranks (CP up to `max_cp`) with its cheapest fitting options, best first
    (`_cost`); those that do not fit follow, with their shortfall. `limits=False`: as if the trainer built every
    layout and option (what the missing pieces would buy)."""
    layouts_ = layouts(cfg, gpus, node, max_cp=max_cp)
    found = [fit_options(cfg, layout, batch, node, base, limits=limits) for layout in layouts_]
    return sorted(found, key=_cost)


def assumptions(node: Node, batch: Batch) -> list[str]:
    return [
        f"node: {node.name}, {node.gpus} GPUs of {node.gpu_mem_gb:g} GB, {node.host_mem_gb:g} GB host memory for "
        f"optimizer states ({node.source or 'given'}); a plan fills at most {USABLE:.0%} of either (CUDA context, "
        "NCCL buffers and fragmentation; the OS and pinned-memory limits)",
        f"micro-batch: {batch.micro_batch} packed sequence(s) of {batch.seq_len} tokens; 1F1B keeps PP - s "
        "micro-batches in flight on stage s (at least PP micro-batches per step)",
        "weights bf16; gradients fp32 (bf16 with main_grads bf16); fp32 master + Adam m, v = 12 B per trained "
        "element of the optimizer's shard; offloaded: 16 B on the host (master, gradient copy, m, v), and the GPU "
        "keeps the fp32 master unless precision-aware",
        "activations: our model's saved tensors per token over TP x CP, plus, where the core attention is a "
        "masked softmax (CP > 1, the DSA families), its float32 softmax + bf16 copy per score and one layer's "
        "attention backward (float32 gradients of the probabilities and scores, a bf16 one); SDPA per sequence "
        "(no CP) keeps none; frozen tensors (MTP, indexers) hold weights only; NCCL buffers, the allocator's "
        "fragmentation and CUDA context excluded",
        "search: TP within a node (power of two), PP dividing the layers, EP dividing the experts and TP x CP x DP, "
        "CP up to --max-cp (default 1; all-gather attention: a rank's probabilities [heads / TP, S / CP, S]); "
        "offload in steps of 0.05",
    ]


__all__ = [
    "NODES",
    "Batch",
    "Candidate",
    "Layout",
    "MemoryOptions",
    "Node",
    "RankElements",
    "RankMemory",
    "assumptions",
    "evaluate",
    "fit_options",
    "layout_problems",
    "layouts",
    "min_offload",
    "rank_elements",
    "rank_memory",
    "search",
]
