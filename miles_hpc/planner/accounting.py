"""The implemented model's accounting for ``miles-hpc plan``: its HF tensors (the model built on the meta device),
the activations a training micro-batch keeps for backward, and the rollout engines' KV-cache bytes per token.

Stage: sync (planning; docs/planning.md). Imports only :mod:`miles_hpc.models`.

Invariants.
- :func:`model_tensors` is ``expected_hf_shapes`` of ``CausalLM(ModelConfig.from_hf_dict(cfg))`` built on the meta
  device (no memory, experts fused: well under a second for GLM-5.2), grouped by layer: the planner names, counts
  and plans exactly the tensors the model holds, loads, saves and syncs, multi-token-prediction (MTP) layers
  ``model.layers.{N + j}`` included. A family the models package does not implement is a :class:`ModelSpecError`.
- :func:`activations` counts the bytes autograd keeps for backward in the trainer's default forward (models/*.py:
  packed sequences, no engine hooks; MTP layers do not run), tensor by tensor as the layer code creates them, in
  bf16 compute with the float32 parts where the code upcasts; each saved storage once, parameters excluded.
  ``tests/test_plan_estimate.py`` checks the sum against ``saved_tensors_hooks`` on tiny built models of every
  family. The CUDA attention kernels keep what the CPU one keeps (q, k, v, output, float32 log-sum-exp, and the
  mask a DSA layer passes, as an additive mask in the compute dtype). The hybrids' and the FAMILY_MODULES families'
  (DeepSeek-V4, Inkling) layers, and the latter's parts outside them, are measured on the meta device instead
  (measure.py); ``tests/test_plan_families.py`` checks those two the same way.
- :func:`kv_bytes_per_token` is the cache SGLang keeps per token: MLA's latent (``kv_lora_rank`` +
  ``qk_rope_head_dim``), whole on every TP rank, plus DSA's indexer key (``index_head_dim``) on layers that run
  their indexer; GQA's K and V heads, split over TP ranks (replicated below one head per rank). DeepSeek-V4 and
  Inkling: what our engine's per-sequence decode state grows by per token (measure.family_state).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from miles_hpc.models import CausalLM, ModelConfig, expected_hf_shapes
from miles_hpc.models.families import logits_width, text_model

Shape = tuple[int, ...]
Shapes = dict[str, Shape]

ACT_BYTES = 2  # bf16 compute (train.mixed_precision, the GPU default)
_DTYPES = {2: torch.bfloat16, 4: torch.float32}
F32, I64 = 4, 8
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SENTINEL = "<model config>"


class ModelSpecError(ValueError):
    """The model config lacks a field the estimate needs, or has a bad value; the message names the field."""


def _get(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelSpecError(f"{key}: expected a positive integer, got {value!r}")
    return value


def model_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """The models package's config of an HF ``config.json`` dict (a multimodal checkpoint's text model). The fields
    that set the shapes must be written out (transformers would default a missing ``hidden_size``; a plan must
    not)."""
    cfg = text_model(cfg)
    counted = ("hidden_size", "vocab_size", "num_attention_heads")  # Nemotron-H's layer count is its pattern's
    for key in counted if cfg.get("model_type") == "nemotron_h" else (*counted, "num_hidden_layers"):
        _get(cfg, key)
    try:
        mc = ModelConfig.from_hf_dict(cfg, source=_SENTINEL)
    except ValueError as e:
        raise ModelSpecError(str(e).removeprefix(f"{_SENTINEL}: ")) from None
    if mc.spec is not None:  # a families.FAMILY_MODULES family: its module checked its keys
        return mc
    keys = []
    if mc.is_mla:
        keys += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    if mc.is_dsa:
        keys += ["q_lora_rank", "index_n_heads", "index_head_dim"]
    if mc.num_experts:
        keys.append("moe_intermediate_size")
        if not any(cfg.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts")):
            raise ModelSpecError("n_routed_experts: a MoE config must give its number of experts")
    if any(not mc.is_moe_layer(i) for i in range(mc.num_hidden_layers)):
        keys.append("intermediate_size")  # the dense layers' width
    for key in keys:
        _get(cfg, key)
    return mc


@dataclass(frozen=True, slots=True)
class ModelTensors:
    """HF tensor shapes: ``top`` by full name; ``layers[i]`` by name relative to ``model.layers.{i}.``; the layers
    from ``decoder_layers`` on are the MTP layers. Shared by every caller of :func:`model_tensors` (cached): read
    only."""

    top: Shapes
    layers: tuple[Shapes, ...]
    decoder_layers: int

    def all(self) -> Shapes:
        """Full HF name -> shape: the top-level tensors, then the layers in order."""
        out = dict(self.top)
        for i, layer in enumerate(self.layers):
            out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
        return out


def model_tensors(cfg: Mapping[str, Any]) -> ModelTensors:
    """The HF tensors of the implemented model of ``cfg`` (MTP layers included), built once per distinct config."""
    return _tensors(json.dumps(cfg, sort_keys=True, default=str))


@lru_cache(maxsize=16)
def _tensors(key: str) -> ModelTensors:
    mc = model_config(json.loads(key))
    with torch.device("meta"):
        model = CausalLM(mc)
    top: Shapes = {}
    layers: list[Shapes] = [{} for _ in range(mc.num_hidden_layers + mc.num_nextn_predict_layers)]
    for name, shape in expected_hf_shapes(model).items():
        if m := _LAYER.match(name):
            layers[int(m.group(1))][m.group(2)] = shape
        else:
            top[name] = shape
    return ModelTensors(top=top, layers=tuple(layers), decoder_layers=mc.num_hidden_layers)


# ---------------------------------------------------------------- activations
@dataclass(frozen=True, slots=True)
class Activations:
    """Activation bytes of one training micro-batch on one trainer GPU. ``saved``: kept for backward, all at once;
    ``transient``: temporaries that exist one at a time, on top of it."""

    saved: dict[str, int]
    transient: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.saved.values()) + max(self.transient.values(), default=0)


def _norm(width: int, a: int) -> int:
    """RMSNorm per row: its float32 input, 1/rms, the normalised row in the compute dtype (models/layers.py)."""
    return F32 * width + F32 + a * width


def _attention(mc: ModelConfig, a: int) -> tuple[int, int]:
    """(bytes per token of the attention sub-layer but K and V, K and V the kernel keeps): input norm and its
    output, the latent norms (MLA) or QK-norms, q, the kernel's output and float32 log-sum-exp, o_proj's input."""
    h, heads = mc.hidden_size, mc.num_attention_heads
    out = _norm(h, a) + a * h  # the normed input, which the projections keep
    if mc.is_mla:
        qk, v, kv = heads * mc.qk_head_dim, heads * mc.v_head_dim, heads * (mc.qk_head_dim + mc.v_head_dim)
        if mc.q_lora_rank:  # q_a_layernorm and its output (q_b_proj's input)
            out += _norm(mc.q_lora_rank, a) + a * mc.q_lora_rank
        out += _norm(mc.kv_lora_rank, a) + a * mc.kv_lora_rank  # kv_a_layernorm and its output
    else:
        d, kv_heads = mc.head_dim, mc.num_key_value_heads
        qk, v, kv = heads * d, heads * d, 2 * kv_heads * d  # GQA: the kernel keeps K and V unexpanded
        if mc.qk_norm:  # per-head norms; RoPE, which reads their outputs, keeps nothing of them
            out += (F32 * d + F32 + a * d) * (heads + kv_heads)
    return out + a * qk + 2 * a * v + F32 * heads, a * kv  # q, output, o_proj's input (a copy), lse


def _mlp(mc: ModelConfig, layer: int, a: int) -> int:
    """Bytes per token of the MLP sub-layer: post-attention norm and output, then the dense SwiGLU or the MoE."""
    h, k, e = mc.hidden_size, mc.num_experts_per_tok, mc.num_experts
    out = _norm(h, a) + a * h
    if not mc.is_moe_layer(layer):
        return out + 4 * a * mc.intermediate_size  # gate, up, act(gate), act(gate) * up
    # The router: float32 input (group router) and scores or probabilities, the chosen ids. What only led to the
    # choice (the group top-k, the group mask) is freed with it: nothing downstream holds its graph.
    out += (F32 * h if mc.group_router else 0) + F32 * e + I64 * k
    if mc.norm_topk_prob:  # the top-k weights and their sum
        out += F32 * k + F32
    out += 3 * I64 * k + a * k + a * k * h  # sort order, token of each pair, inverse; sorted weights and rows
    out += a * k * (4 * mc.moe_intermediate_size + h)  # per routed row: gate|up, act, product, expert output
    if mc.n_shared_experts:
        out += 4 * a * mc.moe_intermediate_size * mc.n_shared_experts
    return out


def layer_saved(
    mc: ModelConfig, layer: int, *, seq_len: int, micro_batch: int, act_bytes: int = ACT_BYTES
) -> dict[str, int]:
    """Bytes decoder layer ``layer`` keeps for backward, by term: ``attention`` (all but K/V), ``attention_kv``
    (for MLA the expanded per-head K and V), ``dsa_mask`` (the [S, S] mask of each sequence), ``mlp`` (with the
    router's float32 weight copy)."""
    tokens, a = seq_len * micro_batch, act_bytes
    if mc.is_hybrid or mc.spec is not None:  # measured on the meta device (measure.py): the recurrent scans'
        from .measure import family_layer_kept, layer_kept  # per-chunk tensors; DeepSeek-V4's and Inkling's layers

        kept = family_layer_kept if mc.spec is not None else layer_kept
        return kept(mc, layer, seq_len, micro_batch, _DTYPES[a])
    attn, kv = _attention(mc, a)
    mlp = _mlp(mc, layer, a) * tokens
    if mc.is_moe_layer(layer) and mc.group_router:
        mlp += F32 * mc.num_experts * mc.hidden_size  # F.linear(x.float(), W.float()) keeps W.float()
    mask = micro_batch * seq_len * seq_len * a if mc.is_dsa else 0
    return {"attention": attn * tokens, "attention_kv": kv * tokens, "dsa_mask": mask, "mlp": mlp}


def indexer_peak(mc: ModelConfig, *, seq_len: int, micro_batch: int) -> int:
    """Temporary bytes of a DSA layer running its indexer (no grad): float32 queries, key and head weights of the
    micro-batch, and two float32 [S, H, S] score tensors of one sequence (``relu(q k^T * scale)``: the product
    and its scaled copy exist together, dsa.py ``index_scores``)."""
    if not mc.is_dsa:
        return 0
    heads, d = mc.index_n_heads, mc.index_head_dim
    tokens = seq_len * micro_batch
    return F32 * tokens * (heads * d + d + heads) + 2 * F32 * heads * seq_len * seq_len


def activations(
    mc: ModelConfig, *, seq_len: int, micro_batch: int, checkpointing: bool = False, act_bytes: int = ACT_BYTES
) -> Activations:
    """What one micro-batch of ``micro_batch`` packed sequences of ``seq_len`` tokens keeps on a trainer GPU, by
    term (docs/planning.md: the terms). With ``checkpointing`` (train.activation_checkpointing) each decoder
    layer keeps its input (and a DSA layer the top-k selection it is handed) and is recomputed in backward."""
    n, s, a = micro_batch, seq_len, act_bytes
    t = n * s
    layers = [layer_saved(mc, i, seq_len=s, micro_batch=n, act_bytes=a) for i in range(mc.num_hidden_layers)]
    full = [mc.indexer_full(i) for i in range(mc.num_hidden_layers)]
    other = _other(mc, s, n, a)
    # The logits the log-prob kernel keeps (a padded vocabulary's storage whole: CausalLM's trim is a view), with
    # its float32 log-sum-exp and entropy and the int64 targets; their gradient, and a trimmed one's padded copy.
    logits = t * (a * mc.vocab_size + 2 * F32 + I64)
    width = logits_width(mc)
    transient = {"logits_grad": t * a * (mc.vocab_size + (width if width < mc.vocab_size else 0))}
    scores = indexer_peak(mc, seq_len=s, micro_batch=n)
    if not checkpointing:
        terms = dict.fromkeys(k for layer in layers for k in layer)  # a hybrid's: attention, recurrent, mlp
        saved = {k: sum(layer.get(k, 0) for layer in layers) for k in terms}
        if mc.is_dsa:
            transient["indexer_scores"] = scores
        return Activations(saved={**saved, "logits": logits, "other": other}, transient=transient)
    topk = min(mc.index_topk, s)
    handed = sum(full[:-1]) if mc.is_dsa else 0  # selections passed on to a later layer's checkpoint
    saved = {
        "layer_inputs": sum(_input_width(mc, i) for i in range(mc.num_hidden_layers)) * t * a,
        "dsa_selections": handed * n * s * topk * 4,  # int32 [S, top-k] per sequence
        "logits": logits,
        "other": other,
    }
    # A recomputed layer's input is the checkpoint's (above), not counted again.
    sums = [sum(v for k, v in layer.items() if k != "layer_inputs") for layer in layers]
    transient["recompute"] = max(v + (scores if f else 0) for v, f in zip(sums, full, strict=True))
    return Activations(saved=saved, transient=transient)


def _other(mc: ModelConfig, seq_len: int, micro_batch: int, a: int) -> int:
    """Bytes outside the layers and the logits: token ids, RoPE's cos and sin (shared by every layer), the final
    norm and its output (the head's input); a FAMILY_MODULES model's measured (measure.family_ends_kept: no shared
    RoPE, an embedding norm, DeepSeek-V4's final stream collapse)."""
    t, h = seq_len * micro_batch, mc.hidden_size
    if mc.spec is not None:
        from .measure import family_ends_kept

        return family_ends_kept(mc, seq_len, micro_batch, _DTYPES[a])
    other = t * (I64 + 2 * a * mc.rotary_dim + _norm(h, a) + a * h)
    if mc.is_hybrid:  # their final norm multiplies in float32: it keeps the float32 normalised row (not a
        other += t * (F32 - a) * h + F32 * h  # compute-dtype one) and the float32 weight it multiplies by
    return other


def _input_width(mc: ModelConfig, layer: int) -> int:
    """Elements per token of a decoder layer's input: DeepSeek-V4's hc_mult streams (its first layer's, the
    embedding broadcast over them: a view), else the hidden state."""
    wide = mc.model_type == "deepseek_v4" and layer > 0
    return mc.hidden_size * (mc.spec.hc_mult if wide else 1)


# ---------------------------------------------------------------- rollout KV cache
def kv_bytes_per_token(mc: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes per token on one engine rank of a TP-``tp`` engine (``tp=1``: one whole copy); decoder
    layers only (no speculative decoding, so MTP layers cache nothing), a hybrid's full-attention ones only (its
    recurrent layers keep a state per sequence instead: measure.recurrent_state_bytes). DeepSeek-V4 and Inkling:
    what our engine's decode state grows by per token (measure.family_state; its bounded part is per sequence),
    whole on the engine (it runs them without TP)."""
    if mc.spec is not None:
        from .measure import family_state

        return family_state(mc, dtype_bytes)[0]
    layers = [i for i in range(mc.num_hidden_layers) if not mc.is_hybrid or mc.layer_types[i] == "full_attention"]
    if mc.is_mla:
        elements = len(layers) * (mc.kv_lora_rank + mc.head_dim)
        elements += sum(mc.indexer_full(i) for i in layers) * mc.index_head_dim if mc.is_dsa else 0
    else:
        elements = len(layers) * 2 * max(mc.num_key_value_heads // tp, 1) * mc.head_dim
    return elements * dtype_bytes


__all__ = [
    "Activations",
    "ModelSpecError",
    "ModelTensors",
    "activations",
    "indexer_peak",
    "kv_bytes_per_token",
    "layer_saved",
    "model_config",
    "model_tensors",
    "sdpa_core_attention",
]


def sdpa_core_attention(is_dsa: bool, cp: int) -> bool:
    """Whether the megatron trainer's core attention is SDPA per packed sequence (train/mcore_attention.py, flash or
    memory-efficient on a GPU: no [heads, S, S] probabilities kept): without context parallelism, and not for the
    DSA families (their core attention, and the CP one, attend under the row's mask)."""
    return cp == 1 and not is_dsa
