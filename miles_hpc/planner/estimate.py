"""Planning estimates for ``miles-hpc plan``: parameters, memory and weight-sync times (stage: sync; docs/design.md sections 6 and 8).

Everything here is a pure function of an HF ``config.json`` dict and a few cluster numbers; the only import of
ours is :mod:`miles_hpc.planner.transfer` (pure too), so the p2p estimate is the transfer plan the p2p strategy runs.

Units: bytes and seconds; GB = 1e9 bytes, GB/s = 1e9 bytes/s; a NIC's line rate in Gb/s is 8x its GB/s.

Invariants.
- :func:`model_tensors` names tensors as HF checkpoints do (DeepSeek-V3/MLA naming for Kimi-K2, GLM-5's
  ``glm_moe_dsa`` with its DSA indexer, Llama/Qwen/GLM-4.5 GQA); MTP (``num_nextn_predict_layers``) layers are
  left out: rollouts here do not speculate, so they are neither counted nor synced.
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

from miles_hpc.planner.transfer import EngineRank, engine_layout, fsdp_layout, plan_transfers

Shape = tuple[int, ...]
Shapes = dict[str, Shape]

# Defaults. Each is an assumption unless a measurement is named; `assumptions()` prints them with the output.
LINK_GBITS = 200.0  # per-GPU NIC line rate, Gb/s: 200 Gb/s HDR InfiniBand / Slingshot-11 (assumption)
DELTA_RATIO = 0.0112  # delta bytes / full bytes, measured at lr 1e-6 (docs/weight_sync.md, bench_weight_sync.py)
ENCODE_GBPS = 0.07  # delta encode, GB of full tensor per s, measured on 1 CPU thread (docs/weight_sync.md)
DECODE_GBPS = 0.09  # delta decode, same measurement
GPU_MEM_GB = 141.0  # H200 (assumption)
TRAIN_BYTES_PER_PARAM = 2 + 4 + 4 + 8  # bf16 param + fp32 master + fp32 grad + Adam m and v (fp32)
ROLLOUT_BYTES = 2  # bf16 weights on the engines
MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class ModelSpecError(ValueError):
    """The model config lacks a field the estimate needs, or has a bad value; the message names the field."""


def _get(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelSpecError(f"{key}: expected a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ModelTensors:
    """HF tensor shapes: ``top`` by full name; ``layers[i]`` by name relative to ``model.layers.{i}.``."""

    top: Shapes
    layers: tuple[Shapes, ...]

    def all(self) -> Shapes:
        """Full HF name -> shape, in checkpoint order."""
        out = dict(self.top)
        for i, layer in enumerate(self.layers):
            out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
        return out


def _linear(out: int, inp: int, prefix: str, bias: bool = False) -> Shapes:
    return {f"{prefix}.weight": (out, inp), **({f"{prefix}.bias": (out,)} if bias else {})}


def _attention(cfg: Mapping[str, Any], layer: int) -> Shapes:
    """``self_attn.*``: MLA (DeepSeek-V3, Kimi-K2, GLM-5 + DSA indexer) when ``kv_lora_rank`` is set, else GQA."""
    hidden, heads = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads")
    bias, p = bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")), "self_attn."
    if cfg.get("kv_lora_rank"):
        nope, rope, v = _get(cfg, "qk_nope_head_dim"), _get(cfg, "qk_rope_head_dim"), _get(cfg, "v_head_dim")
        kv_rank, q_rank = _get(cfg, "kv_lora_rank"), cfg.get("q_lora_rank")
        if q_rank:  # low-rank queries: down-projection, norm, up-projection
            out = _linear(q_rank, hidden, p + "q_a_proj", bias)
            out[p + "q_a_layernorm.weight"] = (q_rank,)
            out.update(_linear(heads * (nope + rope), q_rank, p + "q_b_proj"))
        else:
            out = _linear(heads * (nope + rope), hidden, p + "q_proj")
        out.update(_linear(kv_rank + rope, hidden, p + "kv_a_proj_with_mqa", bias))
        out[p + "kv_a_layernorm.weight"] = (kv_rank,)
        out.update(_linear(heads * (nope + v), kv_rank, p + "kv_b_proj"))
        out.update(_linear(hidden, heads * v, p + "o_proj", bias))
        if _has_indexer(cfg, layer):  # DeepSeek sparse attention's lightning indexer
            n, d, ip = _get(cfg, "index_n_heads"), _get(cfg, "index_head_dim"), p + "indexer."
            out.update(_linear(n * d, _get(cfg, "q_lora_rank"), ip + "wq_b"))
            out.update(_linear(d, hidden, ip + "wk"))
            out.update({ip + "k_norm.weight": (d,), ip + "k_norm.bias": (d,)})  # a LayerNorm, with bias
            out.update(_linear(n, hidden, ip + "weights_proj"))
        return out
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    o_bias = bias and cfg.get("model_type") not in ("qwen2", "glm4_moe")  # those have q/k/v biases only
    out = _linear(heads * head_dim, hidden, p + "q_proj", bias)
    out.update(_linear(kv * head_dim, hidden, p + "k_proj", bias))
    out.update(_linear(kv * head_dim, hidden, p + "v_proj", bias))
    out.update(_linear(hidden, heads * head_dim, p + "o_proj", o_bias))
    if cfg.get("model_type") in ("qwen3", "qwen3_moe") or cfg.get("use_qk_norm"):
        out.update({p + "q_norm.weight": (head_dim,), p + "k_norm.weight": (head_dim,)})
    return out


def _has_indexer(cfg: Mapping[str, Any], layer: int) -> bool:
    """GLM-5.2 IndexShare: only "full" layers carry DSA indexer weights (schedule as vLLM derives it)."""
    if not cfg.get("index_n_heads"):
        return False
    if (types := cfg.get("indexer_types")) is not None:
        return types[layer] == "full"
    freq, offset = int(cfg.get("index_topk_freq", 1)), int(cfg.get("index_skip_topk_offset", 2))
    return max(layer - offset + 1, 0) % freq == 0


def _num_experts(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)


def _is_moe(cfg: Mapping[str, Any], layer: int) -> bool:
    if not _num_experts(cfg):
        return False
    if (types := cfg.get("mlp_layer_types")) is not None:
        return types[layer] == "sparse"
    if "first_k_dense_replace" in cfg:  # DeepSeek-V3 / Kimi-K2 / GLM
        return layer >= cfg["first_k_dense_replace"] and layer % int(cfg.get("moe_layer_freq", 1)) == 0
    step = int(cfg.get("decoder_sparse_step", 1))  # Qwen3-MoE
    return layer not in cfg.get("mlp_only_layers", []) and (layer + 1) % step == 0


def _mlp(hidden: int, inter: int, prefix: str) -> Shapes:
    return {
        **_linear(inter, hidden, prefix + "gate_proj"),
        **_linear(inter, hidden, prefix + "up_proj"),
        **_linear(hidden, inter, prefix + "down_proj"),
    }


def _moe(cfg: Mapping[str, Any]) -> Shapes:
    hidden, n, inter = _get(cfg, "hidden_size"), _num_experts(cfg), _get(cfg, "moe_intermediate_size")
    out: Shapes = {"mlp.gate.weight": (n, hidden)}
    if cfg.get("topk_method") == "noaux_tc" or cfg.get("model_type") in ("glm4_moe", "glm_moe_dsa"):
        out["mlp.gate.e_score_correction_bias"] = (n,)
    for j in range(n):
        out.update(_mlp(hidden, inter, f"mlp.experts.{j}."))
    if shared := int(cfg.get("n_shared_experts") or 0):
        out.update(_mlp(hidden, inter * shared, "mlp.shared_experts."))
    return out


def model_tensors(cfg: Mapping[str, Any]) -> ModelTensors:
    """The HF tensor names and shapes of a decoder-only model (MTP layers excluded)."""
    hidden, vocab = _get(cfg, "hidden_size"), _get(cfg, "vocab_size")
    layers = []
    for i in range(_get(cfg, "num_hidden_layers")):
        mlp = _moe(cfg) if _is_moe(cfg, i) else _mlp(hidden, _get(cfg, "intermediate_size"), "mlp.")
        layers.append(
            {
                "input_layernorm.weight": (hidden,),
                **_attention(cfg, i),
                "post_attention_layernorm.weight": (hidden,),
                **mlp,
            }
        )
    top = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.get("tie_word_embeddings", False):
        top["lm_head.weight"] = (vocab, hidden)
    return ModelTensors(top=top, layers=tuple(layers))


def hf_tensor_shapes(cfg: Mapping[str, Any]) -> Shapes:
    """Full HF name -> shape, in checkpoint order (embeddings and final norm, layers, lm_head)."""
    return model_tensors(cfg).all()


def element_bytes(name: str, rollout_bytes: int = ROLLOUT_BYTES) -> int:
    """Bytes per element on the engines: ``rollout_bytes`` (2: bf16, 1: fp8) for linear weights; the router's
    correction bias stays fp32 and, under fp8, the other tensors (norms, embeddings, gates) stay bf16, as in FP8
    checkpoints. FP8 block scales (4 B per 128x128 block, 0.02%) are left out."""
    if name.endswith("e_score_correction_bias"):
        return 4
    return rollout_bytes if rollout_bytes >= 2 or name.endswith("proj.weight") else 2


def param_counts(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(total, active) parameters. Active = everything but the routed experts, plus ``num_experts_per_tok`` of
    them per MoE layer; both embedding tables count (the input one is a lookup: subtract it for a FLOP view)."""
    t, top_k = model_tensors(cfg), int(cfg.get("num_experts_per_tok") or 0)
    total = active = sum(math.prod(s) for s in t.top.values())
    for layer in t.layers:
        experts: Counter[str] = Counter()  # expert index -> its parameters in this layer
        for name, shape in layer.items():
            n = math.prod(shape)
            total += n
            if m := _EXPERT.search("." + name):
                experts[m.group(1)] += n
            else:
                active += n
        if experts:
            active += top_k * max(experts.values())
    return total, active


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
    kv_heads = None if cfg.get("kv_lora_rank") else cfg.get("num_key_value_heads")
    experts = _num_experts(cfg) or None
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
    rollout_bytes: int = ROLLOUT_BYTES  # 2: bf16, 1: fp8 linear weights
    delta_ratio: float = DELTA_RATIO
    encode_gbps: float = ENCODE_GBPS
    decode_gbps: float = DECODE_GBPS

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

    @property
    def link_gbps(self) -> float:
        """GB/s per GPU link."""
        return self.link_gbits / 8


def assumptions(c: Cluster) -> list[str]:
    """Every assumption behind :func:`estimate`, as printed with its output."""
    dtype = (
        "weights move in bf16 (2 B/element)"
        if c.rollout_bytes == 2
        else "linear weights move in fp8 (1 B/element, block scales ignored; norms, embeddings, router in bf16; "
        "quantizing on the trainer not timed)"
    )
    return [
        (
            f"link: {c.link_gbits:g} Gb/s = {c.link_gbps:g} GB/s per GPU, each direction (full duplex); latency, "
            "protocol overhead and congestion ignored, so times are lower bounds"
        ),
        f"{dtype}; router correction bias fp32; MTP layers are not synced",
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
            f"delta: {c.delta_ratio:g} of the full bytes (measured for bf16 at lr 1e-6 on a 25M model: larger "
            f"steps change more); encode {c.encode_gbps:g} GB/s and decode {c.decode_gbps:g} GB/s per process "
            "(measured on one CPU thread; GPU not measured); each trainer rank encodes its own shard and each "
            "engine rank decodes its slice, in parallel (today's delta strategy encodes on trainer rank 0: see "
            "encode_rank0_s); the delta moves like a broadcast; encode, transfer and decode do not overlap; "
            "breakeven_codec_gbps is the codec speed (encode = decode) at which delta would match broadcast"
        ),
        (
            f"train memory: {TRAIN_BYTES_PER_PARAM} B/param (bf16 param + fp32 master + fp32 grad + Adam m, v) / "
            "train GPUs, FSDP full sharding; activations, buffers and the gathered layer excluded"
        ),
        f"rollout memory: weights only, busiest engine rank; KV cache excluded; GPU memory {c.gpu_mem_gb:g} GB",
        "GB = 1e9 bytes",
    ]


def estimate(cfg: Mapping[str, Any], cluster: Cluster, *, name: str = "model", source: str = "") -> dict[str, Any]:
    """The plan: model size, per-GPU memory, and the three strategies' sync times (units in the key names)."""
    c, gb = cluster, 1e9
    total, active = param_counts(cfg)
    full = model_bytes(cfg, c.rollout_bytes)
    p2p = p2p_bytes(
        cfg, train_gpus=c.train_gpus, engines=c.engines, tp=c.engine_tp, ep=c.engine_ep, rollout_bytes=c.rollout_bytes
    )
    bw, mem = c.link_gbps * gb, c.gpu_mem_gb * gb
    train_per_gpu = total * TRAIN_BYTES_PER_PARAM / c.train_gpus
    delta = full * c.delta_ratio
    encode_s = full / c.train_gpus / (c.encode_gbps * gb)  # each trainer rank encodes its shard
    decode_s = p2p.max_recv / (c.decode_gbps * gb)  # each engine rank decodes its slice
    coded = full / c.train_gpus + p2p.max_recv  # bytes through the codec on the critical path
    spare = (full - delta) / bw  # what a delta saves on the wire, against a broadcast
    model = {
        "name": name,
        "source": source,
        "architecture": (cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        "layers": cfg["num_hidden_layers"],
        "routed_experts": _num_experts(cfg),
        "params_total": total,
        "params_active": active,
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
        "gpu_mem_gb": c.gpu_mem_gb,
    }
    memory = {
        "train_per_gpu_gb": train_per_gpu / gb,
        "train_fits": train_per_gpu <= mem,
        "train_min_gpus": math.ceil(total * TRAIN_BYTES_PER_PARAM / mem),
        "rollout_per_engine_gb": full / gb,
        "rollout_per_gpu_gb": p2p.max_recv / gb,
        "rollout_fits": p2p.max_recv <= mem,
    }
    sync = {
        "broadcast": {"bytes_gb": full / gb, "seconds": full / bw},
        "p2p": {
            "max_send_gb": p2p.max_send / gb,
            "max_recv_gb": p2p.max_recv / gb,
            "total_gb": p2p.total / gb,
            "seconds": max(p2p.max_send, p2p.max_recv) / bw,
        },
        "delta": {
            "ratio": c.delta_ratio,
            "bytes_gb": delta / gb,
            "transfer_s": delta / bw,
            "encode_s": encode_s,
            "decode_s": decode_s,
            "seconds": encode_s + delta / bw + decode_s,
            "encode_rank0_s": full / (c.encode_gbps * gb),
            "breakeven_codec_gbps": coded / spare / gb if spare > 0 else None,  # None: no codec speed is enough
        },
    }
    return {"model": model, "cluster": cluster_out, "memory": memory, "sync": sync, "assumptions": assumptions(c)}


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


def format_table(report: Mapping[str, Any]) -> str:
    """The report as aligned text lines (the CLI's default output)."""
    m, c, mem, s = report["model"], report["cluster"], report["memory"], report["sync"]
    fits = {True: "fits", False: "DOES NOT FIT"}
    bc, p2p, d = s["broadcast"], s["p2p"], s["delta"]
    engines = f"{c['engines']} x TP{c['engine_tp']} EP{c['engine_ep']} = {c['rollout_gpus']} GPUs"
    link = f"{c['link_gbits']:g} Gb/s ({c['link_gbps']:g} GB/s) per GPU"
    train = f"{fits[mem['train_fits']]} in {c['gpu_mem_gb']:g} GB; >= {mem['train_min_gpus']} GPUs needed"
    busiest = _gb(max(p2p["max_send_gb"], p2p["max_recv_gb"]))
    codec = f"encode {_secs(d['encode_s'])} + decode {_secs(d['decode_s'])}"
    breakeven = "no codec" if d["breakeven_codec_gbps"] is None else f"{d['breakeven_codec_gbps']:.2f} GB/s"
    wire = f"transfer {_secs(d['transfer_s'])}"
    rows = [
        ("model", f"{m['name']} ({m['architecture']}, {m['layers']} layers, {m['routed_experts']} routed experts)"),
        ("parameters", f"{_si(m['params_total'], '', 'B')} total, {_si(m['params_active'], '', 'B')} active"),
        (f"weights ({c['rollout_dtype']})", _gb(m["weights_gb"])),
        ("cluster", f"{c['train_gpus']} train GPUs; engines: {engines}; {link}"),
        ("train memory/GPU", f"{_gb(mem['train_per_gpu_gb'])} ({train})"),
        ("rollout memory/GPU", f"{_gb(mem['rollout_per_gpu_gb'])} of weights ({fits[mem['rollout_fits']]})"),
        ("sync: broadcast", f"{_secs(bc['seconds']):>10}  ({_gb(bc['bytes_gb'])} over rank 0's link)"),
        ("sync: p2p", f"{_secs(p2p['seconds']):>10}  (busiest link {busiest}; {_gb(p2p['total_gb'])} in all)"),
        ("sync: delta", f"{_secs(d['seconds']):>10}  ({_gb(d['bytes_gb'])}: {wire} + {codec})"),
        ("  delta codec", f"on rank 0 alone: encode {_secs(d['encode_rank0_s'])}; {breakeven} would match broadcast"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["assumptions:"] + [f"  - {a}" for a in report["assumptions"]]
    return "\n".join(lines)


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
