"""Planning estimates for ``miles-hpc plan``: parameters, memory and weight-sync times (stage: sync; docs/design.md sections 6 and 8).

Everything here is a function of an HF ``config.json`` dict and a few cluster numbers. The model's tensors, its
activations and its KV cache come from :mod:`miles_hpc.planner.accounting`, which builds the implemented model
(:mod:`miles_hpc.models`) on the meta device, so the plan counts what the code holds; the p2p estimate is the
transfer plan the p2p strategy runs (:mod:`miles_hpc.planner.transfer`).

Units: bytes and seconds; GB = 1e9 bytes, GB/s = 1e9 bytes/s; a NIC's line rate in Gb/s is 8x its GB/s.

Invariants.
- :func:`hf_tensor_shapes` is what the implemented model loads, saves and syncs, in HF checkpoint names (Llama,
  Qwen2/3, Qwen3-MoE, GLM-4.5 GQA; DeepSeek-V3/Kimi-K2 MLA; DeepSeek-V3.2 and GLM-5 MLA with the DSA indexer),
  multi-token-prediction (``num_nextn_predict_layers``) layers included: they are counted in the total
  parameters, the weights and every sync, though not in the active parameters (rollouts do not speculate, and
  the trainer's loss does not run them).
- :func:`p2p_bytes` equals ``summarize(plan_transfers(...))`` over the whole model (a test checks it on a small
  config), but plans only a representative subset: one layer of each kind, and within it one tensor per distinct
  (shape, element size, engine boxes). Every trainer rank holds a tensor's dim-0 FSDP chunk whatever the tensor's
  name, so tensors equal in those three move equal bytes over equal links; each element has one holder, so R engine
  replicas cost each trainer rank R times the bytes of one.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_hpc.models import ModelConfig
from miles_hpc.planner import sync_time
from miles_hpc.planner.accounting import (
    ACT_BYTES,
    Activations,
    ModelSpecError,
    ModelTensors,
    Shape,
    Shapes,
    activations,
    kv_bytes_per_token,
    model_config,
    model_tensors,
)
from miles_hpc.planner.measure import family_notes, recurrent_state_bytes
from miles_hpc.planner.transfer import EngineRank, engine_layout, fsdp_layout, plan_transfers

# Defaults. Each is an assumption unless a measurement is named; `assumptions()` prints them with the output.
LINK_GBITS = 200.0  # per-GPU NIC line rate, Gb/s: 200 Gb/s HDR InfiniBand / Slingshot-11 (assumption)
DELTA_RATIO = 0.0112  # delta bytes / full bytes, measured at lr 1e-6 (docs/weight_sync.md, bench_weight_sync.py)
ENCODE_GBPS = 0.07  # delta encode, GB of full tensor per s, measured on 1 CPU thread (docs/weight_sync.md)
DECODE_GBPS = 0.09  # delta decode, same measurement
GPU_MEM_GB = 141.0  # H200 (assumption)
TRAIN_BYTES_PER_PARAM = 2 + 4 + 4 + 8  # bf16 param + fp32 master + fp32 grad + Adam m and v (fp32)
ROLLOUT_BYTES = 2  # bf16 weights on the engines
MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"

SEQ_LEN = 4096  # tokens per training sequence: train.max_tokens_per_microbatch's default (assumption)
MICRO_BATCH = 1  # sequences per training micro-batch (assumption)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def hf_tensor_shapes(cfg: Mapping[str, Any]) -> Shapes:
    """Full HF name -> shape of every tensor the implemented model holds (top-level tensors, then the layers, MTP
    layers last)."""
    return model_tensors(cfg).all()


def element_bytes(name: str, rollout_bytes: int = ROLLOUT_BYTES) -> int:
    """Bytes per element on the engines: ``rollout_bytes`` (2: bf16, 1: fp8) for linear weights; the router's
    correction bias stays fp32 and, under fp8, the other tensors (norms, embeddings, gates) stay bf16, as in FP8
    checkpoints. FP8 block scales (4 B per 128x128 block, 0.02%) are left out."""
    if name.endswith("e_score_correction_bias"):
        return 4
    return rollout_bytes if rollout_bytes >= 2 or name.endswith("proj.weight") else 2


def param_counts(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(total, active) parameters. Total: every tensor the model holds, MTP layers included (as ``sum(p.numel())``
    of the built model). Active: the decoder's tensors but its routed experts, plus ``num_experts_per_tok`` of
    them per MoE layer; MTP layers are not active (nothing runs them here); both embedding tables count (the
    input one is a lookup: subtract it for a FLOP view)."""
    t, top_k = model_tensors(cfg), model_config(cfg).num_experts_per_tok
    total = active = sum(math.prod(s) for s in t.top.values())
    for i, layer in enumerate(t.layers):
        experts: Counter[str] = Counter()  # expert index -> its parameters in this layer
        for name, shape in layer.items():
            n = math.prod(shape)
            total += n
            if i >= t.decoder_layers:
                continue
            if m := _EXPERT.search("." + name):
                experts[m.group(1)] += n
            else:
                active += n
        if experts:
            active += top_k * max(experts.values())
    return total, active


def mtp_params(cfg: Mapping[str, Any]) -> int:
    """Parameters of the multi-token-prediction layers (part of :func:`param_counts`' total)."""
    t = model_tensors(cfg)
    return sum(math.prod(s) for layer in t.layers[t.decoder_layers :] for s in layer.values())


def model_bytes(cfg: Mapping[str, Any], rollout_bytes: int = ROLLOUT_BYTES) -> int:
    """Bytes of one full copy of the weights in the rollout dtype (what a broadcast moves)."""
    return sum(math.prod(s) * element_bytes(n, rollout_bytes) for n, s in hf_tensor_shapes(cfg).items())


@dataclass(frozen=True, slots=True)
class P2PBytes:
    """What the p2p plan moves per link (bytes); a rank that moves nothing is absent, as in ``summarize``."""

    send: dict[int, int]  # bytes per trainer rank that sends anything
    recv: dict[EngineRank, int]  # bytes per engine rank that receives anything (= the weights it holds)

    @property
    def max_send(self) -> int:
        return max(self.send.values(), default=0)

    @property
    def max_recv(self) -> int:
        return max(self.recv.values(), default=0)

    @property
    def total(self) -> int:
        return sum(self.send.values())


def _groups(t: ModelTensors) -> list[tuple[int, Shapes]]:
    """(count, full-named shapes of one representative): the non-layer tensors once, then one layer per kind."""
    kinds: dict[tuple[tuple[str, Shape], ...], list[int]] = defaultdict(list)
    for i, layer in enumerate(t.layers):
        kinds[tuple(layer.items())].append(i)
    out = [(1, dict(t.top))]
    for members in kinds.values():
        i = members[0]
        out.append((len(members), {f"model.layers.{i}.{k}": v for k, v in t.layers[i].items()}))
    return out


def p2p_bytes(
    cfg: Mapping[str, Any], *, train_gpus: int, engines: int, tp: int, ep: int = 1, rollout_bytes: int = ROLLOUT_BYTES
) -> P2PBytes:
    """Bytes each trainer rank sends and each engine rank receives under the p2p plan (module doc: how)."""
    mc = model_config(cfg)
    kv_heads = None if mc.is_mla else mc.num_key_value_heads
    experts = mc.num_experts or None
    send: dict[int, int] = defaultdict(int)
    recv: dict[EngineRank, int] = defaultdict(int)
    for count, shapes in _groups(model_tensors(cfg)):
        needs = engine_layout(shapes, tp, 1, ep_size=ep, kv_heads=kv_heads, num_experts=experts)
        weight: dict[str, int] = {}  # representative tensor -> how many tensors of the model it stands for
        seen: dict[tuple[Any, ...], str] = {}
        for name, shape in shapes.items():
            key = (shape, element_bytes(name, rollout_bytes), tuple(sorted(needs.get(name, {}).items())))
            rep = seen.setdefault(key, name)
            weight[rep] = weight.get(rep, 0) + count
        reps = {n: shapes[n] for n in weight}
        plan = plan_transfers(
            reps,
            fsdp_layout(reps, train_gpus),
            {n: needs[n] for n in reps if n in needs},
            {n: element_bytes(n, rollout_bytes) for n in reps},
        )
        for tr in plan:
            send[tr.src_rank] += weight[tr.name] * tr.nbytes * engines
            for replica in range(engines):
                recv[EngineRank(replica, tr.dst.rank)] += weight[tr.name] * tr.nbytes
    return P2PBytes(send=dict(send), recv=dict(recv))


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """The cluster a plan is for. Bandwidths are per GPU: a NIC shared by k GPUs gives each 1/k of it."""

    train_gpus: int = 32
    engines: int = 4
    engine_tp: int = 8
    engine_ep: int = 1
    link_gbits: float = LINK_GBITS  # Gb/s per GPU
    gpu_mem_gb: float = GPU_MEM_GB
    rollout_bytes: int = ROLLOUT_BYTES  # 2: bf16, 1: fp8 linear weights (and KV cache)
    delta_ratio: float = DELTA_RATIO
    encode_gbps: float = ENCODE_GBPS
    decode_gbps: float = DECODE_GBPS
    # The trainer's megatron layout and the nodes, for the calibrated sync model (planner/sync_time.py)
    train_tp: int = 1
    train_pp: int = 1
    train_cp: int = 1
    train_ep: int = 1
    gpus_per_node: int = 8
    bucket_gb: float = 1.0  # bytes gathered per bucket before each send (Miles' --update-weight-buffer-size)
    engine_dp_attention: bool = False  # SGLang DP attention: each engine rank holds the non-expert weights whole

    def __post_init__(self) -> None:
        for key in ("train_gpus", "engines", "engine_tp", "engine_ep"):
            if getattr(self, key) < 1:
                raise ModelSpecError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.engine_tp % self.engine_ep:
            raise ModelSpecError(f"engine_ep: {self.engine_ep} must divide engine_tp {self.engine_tp}")
        for key in ("link_gbits", "gpu_mem_gb", "encode_gbps", "decode_gbps"):
            if getattr(self, key) <= 0:
                raise ModelSpecError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.rollout_bytes not in (1, 2):
            raise ModelSpecError(f"rollout_bytes: 2 (bf16) or 1 (fp8), got {self.rollout_bytes}")
        if not 0 <= self.delta_ratio <= 1:
            raise ModelSpecError(f"delta_ratio: must be in [0, 1], got {self.delta_ratio}")
        self.sync_layout()  # validates the trainer layout

    def sync_layout(self) -> sync_time.SyncLayout:
        """The calibrated sync model's inputs."""
        return sync_time.SyncLayout(
            train_gpus=self.train_gpus,
            train_tp=self.train_tp,
            train_pp=self.train_pp,
            train_cp=self.train_cp,
            train_ep=self.train_ep,
            engines=self.engines,
            engine_gpus=self.engine_tp,
            engine_ep=self.engine_ep,
            engine_dp_attention=self.engine_dp_attention,
            gpus_per_node=self.gpus_per_node,
            link_gbits=self.link_gbits,
            rollout_bytes=self.rollout_bytes,
            bucket_gb=self.bucket_gb,
        )

    @property
    def link_gbps(self) -> float:
        """GB/s per GPU link."""
        return self.link_gbits / 8


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainBatch:
    """The training micro-batch a plan's activations are for: ``micro_batch`` packed sequences of ``seq_len``
    tokens (``train.max_tokens_per_microbatch`` = their product), ``train.activation_checkpointing``."""

    seq_len: int = SEQ_LEN
    micro_batch: int = MICRO_BATCH
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for key in ("seq_len", "micro_batch"):
            if getattr(self, key) < 1:
                raise ModelSpecError(f"{key}: must be >= 1, got {getattr(self, key)}")

    @property
    def tokens(self) -> int:
        """Tokens in one training micro-batch."""
        return self.seq_len * self.micro_batch


def assumptions(c: Cluster, cfg: Mapping[str, Any] | None = None, batch: TrainBatch | None = None) -> list[str]:
    """Every assumption behind :func:`estimate`, as printed with its output (``cfg``: the family's own too)."""
    mc = model_config(cfg) if cfg is not None else None
    dtype = (
        "weights move in bf16 (2 B/element)"
        if c.rollout_bytes == 2
        else "linear weights move in fp8 (1 B/element, block scales ignored; norms, embeddings, router in bf16; "
        "quantizing on the trainer not timed)"
    )
    out = [
        (
            f"link: {c.link_gbits:g} Gb/s = {c.link_gbps:g} GB/s per GPU, each direction (full duplex); latency, "
            "protocol overhead and congestion ignored, so times are lower bounds"
        ),
        f"{dtype}; router correction bias fp32; MTP layers are synced (and counted in the total, not the active)",
        (
            "broadcast: trainer rank 0 sends every byte once over its one link; NCCL's pipelined ring/tree "
            "broadcast then costs about bytes / link bandwidth whatever the number of receivers; the FSDP gather "
            "into rank 0 is assumed overlapped (it uses the other direction of the link, and NVLink inside a node)"
        ),
        (
            "p2p: planner/transfer.py's plan (FSDP2 dim-0 shards -> engine TP/EP slices); time = busiest trainer or "
            "engine link's bytes / link bandwidth, all links in parallel, no fabric bottleneck"
        ),
        (
            f"'as Miles runs it' (planner/sync_time.py, docs/planning.md): trainer {c.train_tp}/{c.train_pp}/"
            f"{c.train_cp}/{c.train_ep} (TP/PP/CP/EP), {c.gpus_per_node} GPUs per node, buckets of {c.bucket_gb:g} GB, "
            f"NIC at {sync_time.NCCL_EFFICIENCY:g} of line rate; broadcast: the stages' buckets one at a time from "
            "each stage's source over NCCL's ring, per-bucket lock/RPC/drain, every engine rank loading every weight "
            f"(MLA families {sync_time.MLA_LOAD_S * 1e6:g} us each, fitted on GLM-5); p2p: every trainer rank "
            f"serves its engine ranks one after another, a CPU-replica pass over its stage at "
            f"{sync_time.REPLICA_GBPS:g} GB/s (fitted on Qwen3-235B) per target, then RDMA; checked against Miles' "
            "three published H100 figures (miles-hpc plan --published)"
        ),
        (
            f"delta: {c.delta_ratio:g} of the full bytes (measured for bf16 at lr 1e-6 on a 25M model: larger "
            f"steps change more); encode {c.encode_gbps:g} GB/s and decode {c.decode_gbps:g} GB/s per process "
            "(measured on one CPU thread; GPU not measured); each trainer rank encodes its own shard and each "
            "engine rank decodes its slice, in parallel (today's delta strategy encodes on trainer rank 0 and "
            "decodes whole tensors on each engine's rank 0: see encode_rank0_s, decode_rank0_s); the delta moves "
            "like a broadcast; encode, transfer and decode do not overlap; "
            "breakeven_codec_gbps is the codec speed (encode = decode) at which delta would match broadcast"
        ),
        (
            f"train memory: {TRAIN_BYTES_PER_PARAM} B/param (bf16 param + fp32 master + fp32 grad + Adam m, v) / "
            "train GPUs, FSDP full sharding, MTP layers included (the loss trains none: their grad and Adam "
            "state, 12 of the 18 B, are an overcount); the gathered layer and NCCL buffers excluded"
        ),
        *_activation_assumptions(batch or TrainBatch(), mc),
        (
            "rollout memory: weights of the busiest engine rank; KV cache as SGLang keeps it, in the rollout "
            "dtype: MLA's latent (kv_lora_rank + qk_rope_head_dim per layer) whole on every TP rank, GQA's K and V "
            "split over TP ranks; no MTP (no speculative decoding); rollout_kv_tokens_per_gpu = the GPU memory the "
            "weights leave / KV bytes per token (an upper bound: SGLang's static memory fraction, CUDA graphs and "
            f"activations take a share); GPU memory {c.gpu_mem_gb:g} GB"
        ),
        "GB = 1e9 bytes",
    ]
    return out


def _activation_assumptions(c: TrainBatch, mc: ModelConfig | None) -> list[str]:
    ckpt = (
        "on: each decoder layer keeps its input (a DSA layer also the top-k selection handed to it) and is "
        "recomputed in backward, one layer's whole set (and its indexer scores) being the largest temporary"
        if c.activation_checkpointing
        else "off"
    )
    out = [
        (
            f"train activations: one micro-batch of {c.micro_batch} packed sequence(s) of {c.seq_len} tokens per "
            f"trainer GPU (no sequence or context parallelism), bf16 compute ({ACT_BYTES} B) with the float32 parts "
            "the code upcasts: the tensors autograd keeps in models/*.py's forward (checked byte for byte against "
            "saved_tensors_hooks on tiny models), the log-prob kernel's logits, plus the largest temporary (the "
            "logits' gradient, or a DSA layer's indexer scores); activation checkpointing "
            f"{ckpt}; flash or memory-efficient attention (no [S, S] probabilities); MTP layers do not run; "
            "backward's gradient temporaries and allocator fragmentation not counted"
        )
    ]
    if mc is not None and mc.is_dsa:
        out.append(
            "DSA: the trainer's default path (dsa.py) scores each sequence whole: two float32 [S, index_n_heads, S] "
            "tensors at once in a layer that runs its indexer (temporary, no grad); every DSA layer's attention "
            "keeps its [S, S] mask per sequence, as the additive mask SDPA makes of it (compute dtype); indexer "
            "keys cached by the engines on the layers that run their indexer (index_head_dim each)"
        )
    return out + family_notes(mc)


def _memory(
    cfg: Mapping[str, Any], c: Cluster, b: TrainBatch, total: int, full: int, weights_per_gpu: int
) -> dict[str, Any]:
    """The ``memory`` section: trainer states and activations per GPU, engine weights and KV cache per GPU."""
    gb, mem = 1e9, c.gpu_mem_gb * 1e9
    mc = model_config(cfg)
    act: Activations = activations(
        mc, seq_len=b.seq_len, micro_batch=b.micro_batch, checkpointing=b.activation_checkpointing
    )
    states = total * TRAIN_BYTES_PER_PARAM
    train = states / c.train_gpus + act.peak
    kv = kv_bytes_per_token(mc, c.rollout_bytes, c.engine_tp)
    return {
        "train_per_gpu_gb": states / c.train_gpus / gb,  # weights, gradients and optimizer states
        "train_activations_gb": act.peak / gb,
        "train_activation_terms_gb": {k: v / gb for k, v in {**act.saved, **act.transient}.items()},
        "train_activation_transient": sorted(act.transient),
        "train_tokens": b.tokens,
        "train_total_per_gpu_gb": train / gb,
        "train_fits": train <= mem,
        "train_min_gpus": math.ceil(states / (mem - act.peak)) if act.peak < mem else None,  # None: never
        "rollout_per_engine_gb": full / gb,
        "rollout_per_gpu_gb": weights_per_gpu / gb,
        "rollout_fits": weights_per_gpu <= mem,
        "rollout_kv_bytes_per_token": kv,  # on each engine GPU
        "rollout_kv_bytes_per_token_engine": kv_bytes_per_token(mc, c.rollout_bytes),  # one copy, unsplit
        "rollout_kv_tokens_per_gpu": max(int(mem - weights_per_gpu), 0) // max(kv, 1),  # 0: only bounded state
        "rollout_state_bytes_per_seq": recurrent_state_bytes(mc, c.rollout_bytes),
    }


def estimate(
    cfg: Mapping[str, Any],
    cluster: Cluster,
    *,
    name: str = "model",
    source: str = "",
    batch: TrainBatch | None = None,
) -> dict[str, Any]:
    """The plan: model size, per-GPU memory, and the three strategies' sync times (units in the key names)."""
    c, b, gb = cluster, batch or TrainBatch(), 1e9
    mc = model_config(cfg)
    total, active = param_counts(cfg)
    full = model_bytes(cfg, c.rollout_bytes)
    p2p = p2p_bytes(
        cfg, train_gpus=c.train_gpus, engines=c.engines, tp=c.engine_tp, ep=c.engine_ep, rollout_bytes=c.rollout_bytes
    )
    bw = c.link_gbps * gb
    delta = full * c.delta_ratio
    encode_s = full / c.train_gpus / (c.encode_gbps * gb)  # each trainer rank encodes its shard
    decode_s = p2p.max_recv / (c.decode_gbps * gb)  # each engine rank decodes its slice
    coded = full / c.train_gpus + p2p.max_recv  # bytes through the codec on the critical path
    spare = (full - delta) / bw  # what a delta saves on the wire, against a broadcast
    model = {
        "name": name,
        "source": source,
        "architecture": (cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        "layers": mc.num_hidden_layers,
        "mtp_layers": mc.num_nextn_predict_layers,
        "attention": ("MLA + DSA" if mc.is_dsa else "MLA") if mc.is_mla else "GQA",
        "routed_experts": mc.num_experts,
        "params_total": total,
        "params_active": active,
        "params_mtp": mtp_params(cfg),
        "weights_gb": full / gb,
    }
    cluster_out = {
        "train_gpus": c.train_gpus,
        "engines": c.engines,
        "engine_tp": c.engine_tp,
        "engine_ep": c.engine_ep,
        "rollout_gpus": c.engines * c.engine_tp,
        "rollout_dtype": "bf16" if c.rollout_bytes == 2 else "fp8",
        "link_gbits": c.link_gbits,
        "link_gbps": c.link_gbps,
        "train_layout": f"TP{c.train_tp} PP{c.train_pp} CP{c.train_cp} EP{c.train_ep}",
        "gpus_per_node": c.gpus_per_node,
        "bucket_gb": c.bucket_gb,
        "engine_dp_attention": c.engine_dp_attention,
        "gpu_mem_gb": c.gpu_mem_gb,
        "seq_len": b.seq_len,
        "micro_batch": b.micro_batch,
        "activation_checkpointing": b.activation_checkpointing,
    }
    modelled = sync_time.model(cfg, c.sync_layout())  # Miles' paths, calibrated (planner/sync_time.py)
    sync = {
        "broadcast": {"bytes_gb": full / gb, "seconds": full / bw, "model": modelled["broadcast"]},
        "p2p": {
            "max_send_gb": p2p.max_send / gb,
            "max_recv_gb": p2p.max_recv / gb,
            "total_gb": p2p.total / gb,
            "seconds": max(p2p.max_send, p2p.max_recv) / bw,
            "model": modelled["p2p"],
        },
        "delta": {
            "ratio": c.delta_ratio,
            "bytes_gb": delta / gb,
            "transfer_s": delta / bw,
            "encode_s": encode_s,
            "decode_s": decode_s,
            "seconds": encode_s + delta / bw + decode_s,
            "encode_rank0_s": full / (c.encode_gbps * gb),
            "decode_rank0_s": full / (c.decode_gbps * gb),
            "breakeven_codec_gbps": coded / spare / gb if spare > 0 else None,  # None: no codec speed is enough
        },
    }
    memory = _memory(cfg, c, b, total, full, p2p.max_recv)
    notes = assumptions(c, cfg, b)
    return {"model": model, "cluster": cluster_out, "memory": memory, "sync": sync, "assumptions": notes}


def _si(x: float, unit: str, giga: str = "G") -> str:
    """``x`` (in base units) with a decimal prefix: 1.5e9 -> "1.5 G" + unit (parameters say "B" for giga)."""
    for scale, prefix in ((1e12, "T"), (1e9, giga), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:,.{2 if prefix == 'T' else 1}f} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def _gb(x: float) -> str:
    return _si(x * 1e9, "B")


def _secs(x: float) -> str:
    return f"{x:,.1f} s" if x >= 0.1 else f"{x * 1e3:.2f} ms" if x >= 1e-4 else f"{x * 1e6:.2f} us"


_TERMS = {
    "attention": "attention",
    "attention_kv": "K/V",
    "dsa_mask": "DSA masks",
    "mlp": "MLP/MoE",
    "recurrent": "recurrent (DeltaNet/Mamba)",
    "layer_inputs": "layer inputs",
    "dsa_selections": "DSA top-k",
    "logits": "logits",
    "other": "other",
    "logits_grad": "logits grad",
    "indexer_scores": "indexer scores",
    "recompute": "one layer recomputed",
}


def _memory_rows(m: Mapping[str, Any], c: Mapping[str, Any], mem: Mapping[str, Any]) -> list[tuple[str, str]]:
    fits = {True: "fits", False: "DOES NOT FIT"}
    if mem["train_min_gpus"] is None:
        gpus = "the activations alone exceed it: no number of GPUs is enough"
    else:
        gpus = f">= {mem['train_min_gpus']} GPUs needed"
    train = f"{fits[mem['train_fits']]} in {c['gpu_mem_gb']:g} GB; {gpus}"
    terms, transient = mem["train_activation_terms_gb"], mem["train_activation_transient"]
    kv_name = "MLA K/V" if m["attention"].startswith("MLA") else "K/V"
    saved = ", ".join(
        f"{_TERMS[k].replace('K/V', kv_name)} {_gb(v)}" for k, v in terms.items() if k not in transient and v
    )
    top = max(transient, key=lambda k: terms[k])
    ckpt = ", checkpointed" if c["activation_checkpointing"] else ""
    batch = f"{c['micro_batch']} x {c['seq_len']:,} tokens{ckpt}"
    kv, kv_copy = mem["rollout_kv_bytes_per_token"], mem["rollout_kv_bytes_per_token_engine"]
    room = f"room for {mem['rollout_kv_tokens_per_gpu']:,} tokens per GPU"
    per_seq = mem.get("rollout_state_bytes_per_seq")  # a hybrid's recurrent layers, per running sequence
    state = f"; + per-sequence state {_si(per_seq, 'B')} per sequence per engine copy" if per_seq else ""
    return [
        (
            "train memory/GPU",
            f"{_gb(mem['train_total_per_gpu_gb'])} = {_gb(mem['train_per_gpu_gb'])} states + "
            f"{_gb(mem['train_activations_gb'])} activations ({train})",
        ),
        ("  activations", f"{batch}: {saved}; + {_TERMS[top]} {_gb(terms[top])} (largest temporary)"),
        ("rollout memory/GPU", f"{_gb(mem['rollout_per_gpu_gb'])} of weights ({fits[mem['rollout_fits']]})"),
        ("  KV cache", f"{_si(kv, 'B')}/token per GPU ({_si(kv_copy, 'B')}/token per engine copy); {room}{state}"),
    ]


def format_table(report: Mapping[str, Any]) -> str:
    """The report as aligned text lines (the CLI's default output)."""
    m, c, mem, s = report["model"], report["cluster"], report["memory"], report["sync"]
    bc, p2p, d = s["broadcast"], s["p2p"], s["delta"]
    engines = f"{c['engines']} x TP{c['engine_tp']} EP{c['engine_ep']} = {c['rollout_gpus']} GPUs"
    link = f"{c['link_gbits']:g} Gb/s ({c['link_gbps']:g} GB/s) per GPU"
    busiest = _gb(max(p2p["max_send_gb"], p2p["max_recv_gb"]))
    codec = f"encode {_secs(d['encode_s'])} + decode {_secs(d['decode_s'])}"
    breakeven = "no codec" if d["breakeven_codec_gbps"] is None else f"{d['breakeven_codec_gbps']:.2f} GB/s"
    wire = f"transfer {_secs(d['transfer_s'])}"
    mtp = f" + {m['mtp_layers']} MTP" if m["mtp_layers"] else ""
    in_mtp = f" ({_si(m['params_mtp'], '', 'B')} in MTP)" if m["mtp_layers"] else ""
    arch = f"{m['architecture']}, {m['attention']}, {m['layers']}{mtp} layers, {m['routed_experts']} routed experts"
    rows = [
        ("model", f"{m['name']} ({arch})"),
        ("parameters", f"{_si(m['params_total'], '', 'B')} total{in_mtp}, {_si(m['params_active'], '', 'B')} active"),
        (f"weights ({c['rollout_dtype']})", _gb(m["weights_gb"])),
        ("cluster", f"{c['train_gpus']} train GPUs; engines: {engines}; {link}"),
        *_memory_rows(m, c, mem),
        ("sync: broadcast", f"{_secs(bc['seconds']):>10}  ({_gb(bc['bytes_gb'])} over rank 0's link; lower bound)"),
        ("  as Miles runs it", f"{_secs(bc['model']['seconds']):>10}  ({_bc_terms(bc['model'])}; calibrated)"),
        ("sync: p2p", f"{_secs(p2p['seconds']):>10}  (busiest link {busiest}; {_gb(p2p['total_gb'])} in all)"),
        ("  as Miles runs it", f"{_secs(p2p['model']['seconds']):>10}  ({_p2p_terms(p2p['model'])}; calibrated)"),
        ("sync: delta", f"{_secs(d['seconds']):>10}  ({_gb(d['bytes_gb'])}: {wire} + {codec})"),
        (
            "  delta codec",
            f"on rank 0 alone: encode {_secs(d['encode_rank0_s'])}, decode {_secs(d['decode_rank0_s'])}; "
            f"{breakeven} would match broadcast",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["assumptions:"] + [f"  - {a}" for a in report["assumptions"]]
    return "\n".join(lines)


def _bc_terms(m: Mapping[str, Any]) -> str:
    return (
        f"wire {_secs(m['wire_s'])} + engine load {_secs(m['engine_load_s'])} + {m['buckets']} buckets "
        f"{_secs(m['buckets_s'])} + calls {_secs(m['ops_s'])}"
    )


def _p2p_terms(m: Mapping[str, Any]) -> str:
    return (
        f"gather {_secs(m['gather_s'])} + convert {_secs(m['convert_s'])} + replica x{m['targets_per_rank']} "
        f"{_secs(m['replica_s'])} + wire {_secs(m['wire_s'])}"
    )


def load_model_config(spec: str | Path) -> tuple[dict[str, Any], str]:
    """(config dict, source path) of a name in ``configs/models/`` (``kimi_k2``), a config.json or a checkpoint dir."""
    path = Path(spec)
    if not path.exists() and (MODELS_DIR / f"{spec}.json").is_file():
        path = MODELS_DIR / f"{spec}.json"
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MODELS_DIR.glob("*.json")))
        raise ModelSpecError(f"{spec}: not a model config file, checkpoint directory or known model ({known})")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"{path}: cannot read a JSON model config: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelSpecError(f"{path}: top level must be a JSON object")
    return cfg, str(path)


def check_spec(cfg: Mapping[str, Any], source: str) -> None:
    """Fail early, naming the file and field, on what :func:`model_tensors` would trip over."""
    try:
        model_tensors(cfg)
    except ModelSpecError as e:
        raise ModelSpecError(f"{source}: {e}") from None
    except (KeyError, IndexError, TypeError) as e:
        raise ModelSpecError(f"{source}: malformed model config ({type(e).__name__}: {e})") from None
