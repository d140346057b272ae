"""Activation bytes of the hybrid families' and the FAMILY_MODULES families' layers, measured: each distinct layer
of the implemented model runs once on the meta device (no memory, no arithmetic) under ``saved_tensors_hooks``, and
what autograd keeps for backward is counted storage by storage. Issue 29: the Gated DeltaNet and Mamba-2 scans
keep per-chunk tensors and states that a closed formula would have to track through every line of deltanet.py /
mamba2.py; running that code is exact by construction and cannot drift from it.

Stage: sync (planning; accounting.py calls it for the hybrid and FAMILY_MODULES models). Imports only
:mod:`miles_hpc.models`.

Invariants:
- The layer is built as `CausalLM` builds it (transformer.DecoderLayer or mixer_blocks.MixerBlock) in the compute
  dtype and fed what the trainer feeds it: one packed row of ``micro_batch`` sequences of ``seq_len`` tokens
  (``cu_seqlens``), RoPE's cos and sin; each sequence's recurrent state starts at zero. The attention kernel is a
  stand-in that keeps what CUDA's flash / memory-efficient kernels keep (q, k and v unexpanded, the output, a
  float32 log-sum-exp per query and head: accounting.py's assumption for every family), since torch's meta SDPA
  would keep its math fallback's. MoE routing on meta spreads the rows evenly over the experts (moe.grouped_mix): the bytes kept do not
  depend on the spread, since every routed row keeps the same tensors whichever expert takes it.
- Counted: storages alive after the forward (a saved tensor whose node nothing downstream reaches is freed, as
  in a real forward), each once, the layer's parameters and its input excluded.
- Split: ``mlp`` is the post-attention norm and MLP / MoE half (Qwen hybrids), or an "E" / "-" block (Nemotron-H);
  ``recurrent`` a DeltaNet or Mamba-2 mixer with its norm; ``attention`` a full-attention one.
- DeepSeek-V4 and Inkling (families.FAMILY_MODULES): each distinct layer kind of the backbone the family module
  builds, run as its ``run`` runs it (positions, ``cu_seqlens``, the token ids; DeepSeek-V4's ``hc_mult`` streams,
  its first layer's a view of the embedding), the layer's input counted when the layer keeps it (``layer_inputs``).
  Neither calls the pluggable attention backend. DeepSeek-V4 computes attention eagerly (window, compressed entries,
  sink): its code runs as it is, no stand-in, and an H100 run of the tiny model kept exactly the bytes counted here.
  Inkling calls SDPA with an additive relative-logit mask that needs a gradient (CUDA: the memory-efficient kernel;
  CPU: the math fallback): ``_MaskedKeeps`` keeps what the CUDA kernel keeps (on an H100 the tiny model's count came
  within 0.3%: CPU's and meta's ``log_sigmoid`` keep a buffer CUDA's does not). The parts outside the layers
  (embedding, DeepSeek-V4's ``hc_head``, final norm, head input) are measured the same way (``family_ends_kept``).
- ``family_state``: the engine's decode state of those families from their ``state_bytes`` (dsv4_state.py,
  inkling_state.py), a per-token rate and a per-sequence bound.
"""

from __future__ import annotations

import math
import weakref
from functools import lru_cache
from typing import Any

import torch

from miles_hpc.models import ModelConfig
from miles_hpc.models.attention import check_cu_seqlens
from miles_hpc.models.rope import RotaryEmbedding


class _FlashKeeps(torch.autograd.Function):
    """Meta stand-in for one sequence's attention: the output and what a flash kernel keeps for backward."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:  # noqa: E501
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError("a planning stand-in: never differentiated")


def _flash_keeps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_idx: int, scale: float, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """An `AttentionBackend` with sdpa_attention's structure (one call per packed sequence, outputs concatenated)."""
    del layer_idx, scale
    bounds = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2]) if cu_seqlens is not None else [0, q.shape[2]]
    parts = [_FlashKeeps.apply(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in zip(bounds, bounds[1:]) if e > s]
    return torch.cat(parts, dim=2)


def _kept(run: object, params: set[int], skip: set[int]) -> int:
    """Bytes of the storages autograd keeps after ``run()``, excluding ``params`` and ``skip`` (storage ids)."""
    return sum(_live(run, params | skip).values())


def _live(run: object, exclude: set[int]) -> dict[int, int]:
    """Storage id -> bytes of each storage autograd keeps after ``run()``, but those in ``exclude``."""
    saved: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()  # type: ignore[operator]
    live: dict[int, int] = {}
    for ref in saved:
        t = ref()
        if t is not None:
            st = t.untyped_storage()
            live[st._cdata] = st.nbytes()
    del out
    return {key: n for key, n in live.items() if key not in exclude}


def layer_kept(mc: ModelConfig, layer: int, seq_len: int, micro_batch: int, dtype: torch.dtype) -> dict[str, int]:
    """What layer ``layer`` of ``mc`` keeps for backward for one micro-batch, by term (module docstring); layers of
    one kind keep the same, so each kind is measured once (its first layer)."""
    kind = _kind(mc, layer)
    first = next(i for i in range(mc.num_hidden_layers) if _kind(mc, i) == kind)
    return dict(_measure(mc, first, seq_len, micro_batch, dtype))


def _kind(mc: ModelConfig, layer: int) -> tuple[str, bool]:
    return mc.layer_types[layer], mc.is_moe_layer(layer)


@lru_cache(maxsize=64)
def _measure(mc: ModelConfig, layer: int, seq_len: int, micro_batch: int, dtype: torch.dtype) -> dict[str, int]:
    from miles_hpc.models.mixer_blocks import MixerBlock
    from miles_hpc.models.transformer import DecoderLayer

    tokens = seq_len * micro_batch
    with torch.device("meta"):
        block: Any = (MixerBlock if mc.model_type == "nemotron_h" else DecoderLayer)(mc, layer)
        block.to(dtype)
        x = torch.empty(1, tokens, mc.hidden_size, dtype=dtype, requires_grad=True)
        positions = (torch.arange(tokens) % seq_len).unsqueeze(0)
    cos, sin = RotaryEmbedding(mc)(positions, dtype)
    cu = torch.arange(micro_batch + 1, dtype=torch.int32) * seq_len
    params = {p.untyped_storage()._cdata for p in block.parameters()}
    skip = {t.untyped_storage()._cdata for t in (x, cos, sin)}  # the input; RoPE's cos, sin: counted once, outside
    whole = _kept(lambda: block(x, cos, sin, _flash_keeps, cu, None)[0], params, skip)
    if mc.model_type == "nemotron_h":
        kind = {"linear_attention": "recurrent", "full_attention": "attention"}.get(block.kind, "mlp")
        return {kind: whole}
    mlp = _kept(lambda: _mlp_half(block, x), params, skip)
    return {"recurrent" if block.is_linear else "attention": whole - mlp, "mlp": mlp}


def _mlp_half(block: Any, x: torch.Tensor) -> torch.Tensor:
    """A Qwen hybrid layer's second half on ``x``: its post-attention norm and MLP (or MoE), as the layer runs it."""
    h = block.post_attention_layernorm(x)
    return block.mlp(h)[0] if block.is_moe else block.mlp(h)


def recurrent_state_bytes(mc: ModelConfig, dtype_bytes: int) -> int:
    """Per sequence, what an engine keeps for the recurrent layers (engine/recurrent_state.py): each layer's
    convolution inputs in the model dtype and its scan state in float32; a FAMILY_MODULES model's per-sequence
    bound (`family_state`)."""
    from miles_hpc.models.hybrid import linear_dims
    from miles_hpc.models.nemotron import mamba_dims

    if mc.spec is not None:  # DeepSeek-V4's and Inkling's bounded part (windows, partial blocks, convolutions)
        return family_state(mc, dtype_bytes)[1]
    per_layer = 0
    if mc.model_type == "nemotron_h":
        m = mamba_dims(mc)
        per_layer = m.conv_channels * (m.conv_width - 1) * dtype_bytes + 4 * m.heads * m.head_dim * m.state
    elif mc.is_hybrid:
        d = linear_dims(mc)
        per_layer = d.conv_channels * (d.conv_width - 1) * dtype_bytes + 4 * d.value_heads * d.key_dim * d.value_dim
    return per_layer * sum(mc.is_linear_layer(i) for i in range(mc.num_hidden_layers))


# ---------------------------------------------------------------- families.FAMILY_MODULES families
class _MaskedKeeps(torch.autograd.Function):
    """Meta stand-in for Inkling's SDPA call with its additive relative-logit mask (which needs a gradient): what
    CUDA's memory-efficient kernel keeps (seen on an H100): q, k, v, the mask (a copy padded to 8 keys when its
    width is not a multiple of 8), the output (laid out [B, L, H, D]) and a float32 log-sum-exp per head and query,
    padded to 32 queries."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, heads, length, _ = q.shape
        out = q.new_empty(b, length, heads, v.shape[-1]).transpose(1, 2)
        lse = torch.empty(b, heads, -(-length // 32) * 32, dtype=torch.float32, device=q.device)
        keys = mask.shape[-1]
        if keys % 8:
            mask = mask.new_empty(*mask.shape[:-1], keys + 8 - keys % 8)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError("a planning stand-in: never differentiated")


class _InklingSdpa:
    """torch.nn.functional as inkling_attention.py sees it during a measurement: SDPA is `_MaskedKeeps`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        del scale
        return _MaskedKeeps.apply(q, k, v, attn_mask)


def family_layer_kept(
    mc: ModelConfig, layer: int, seq_len: int, micro_batch: int, dtype: torch.dtype
) -> dict[str, int]:
    """What layer ``layer`` of a FAMILY_MODULES model (DeepSeek-V4, Inkling) keeps for backward for one micro-batch:
    ``attention`` (with DeepSeek-V4's attention hyper-connection), ``mlp`` (its MLP / MoE half, with the FFN
    hyper-connection and the stream it reads; Inkling's with its residual convolution) and ``layer_inputs`` (the
    layer's input when the layer itself keeps it: DeepSeek-V4's ``hc_mult`` streams). Measured once per kind."""
    kind = _family_kind(mc, layer)
    first = next(i for i in range(mc.num_hidden_layers) if _family_kind(mc, i) == kind)
    return dict(_measure_family(mc, first, seq_len, micro_batch, dtype))


def _family_kind(mc: ModelConfig, layer: int) -> tuple[str, str, bool]:
    s = mc.spec  # DeepSeek-V4's first layer reads the embedding broadcast over the streams (a view), the rest
    return s.layer_types[layer], s.mlp_layer_types[layer], mc.model_type == "deepseek_v4" and layer == 0


@lru_cache(maxsize=4)
def _backbone(mc: ModelConfig, dtype: torch.dtype) -> Any:
    """The family's backbone (``model.*``) and LM head on the meta device, in the compute dtype."""
    from miles_hpc.models.families import family_module

    with torch.device("meta"):
        backbone = family_module(mc.model_type).backbone(mc)
        head = torch.nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
    backbone.to(dtype)
    head.to(dtype)
    return backbone, head


def _feed(mc: ModelConfig, seq_len: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Token ids and positions [1, T] (meta) and the host cu_seqlens, as CausalLM hands them to ``run``."""
    tokens = seq_len * micro_batch
    with torch.device("meta"):
        ids = torch.zeros(1, tokens, dtype=torch.long)
        positions = (torch.arange(tokens) % seq_len).unsqueeze(0)
    return ids, positions, torch.arange(micro_batch + 1, dtype=torch.int32) * seq_len


@lru_cache(maxsize=64)
def _measure_family(mc: ModelConfig, layer: int, seq_len: int, micro_batch: int, dtype: torch.dtype) -> dict[str, int]:
    backbone, _ = _backbone(mc, dtype)
    block = backbone.layers[layer]
    params = {p.untyped_storage()._cdata for p in backbone.parameters()}
    ids, positions, cu = _feed(mc, seq_len, micro_batch)
    tokens, h = seq_len * micro_batch, mc.hidden_size
    n = mc.spec.hc_mult if mc.model_type == "deepseek_v4" else 1
    with torch.device("meta"):
        x = torch.empty(1, tokens, h if layer == 0 else n * h, dtype=dtype, requires_grad=True)
        mid = torch.empty(1, tokens, n * h, dtype=dtype, requires_grad=True)
    if mc.model_type == "deepseek_v4":
        from miles_hpc.models.dsv4_blocks import hc_merge

        ropes = {kind: rope.on(torch.device("meta")) for kind, rope in backbone.ropes.items()}
        pos = positions.expand(1, tokens)

        def whole() -> torch.Tensor:
            streams = x.view(1, tokens, 1, h).expand(1, tokens, n, h) if layer == 0 else x.view(1, tokens, n, h)
            return block(streams, ids, pos, ropes, cu, None, False)[0]

        def half() -> torch.Tensor:
            streams = mid.view(1, tokens, n, h)
            post, comb, y = block.ffn_hc(streams)
            out = block.mlp(block.post_attention_layernorm(y), ids, None, False)[0]
            return hc_merge(streams, out, post, comb)
    else:
        from unittest import mock

        from miles_hpc.models import inkling_attention
        from miles_hpc.models.inkling_attention import Segments

        seg = Segments.build(tokens, cu, positions)

        def whole() -> torch.Tensor:
            with mock.patch.object(inkling_attention, "F", _InklingSdpa()):
                return block(x, seg, None, False)[0]

        def half() -> torch.Tensor:
            y = block.post_attention_layernorm(mid)
            out = block.mlp(y)[0] if block.is_moe else block.mlp(y)
            return mid + block.mlp_sconv(out, seg)

    everything, mlp = _live(whole, params), _live(half, params)
    inputs = everything.get(x.untyped_storage()._cdata, 0)
    return {
        "attention": sum(everything.values()) - sum(mlp.values()) - inputs,
        "mlp": sum(mlp.values()),
        "layer_inputs": inputs,
    }


@lru_cache(maxsize=16)
def family_ends_kept(mc: ModelConfig, seq_len: int, micro_batch: int, dtype: torch.dtype) -> int:
    """What a FAMILY_MODULES model keeps outside its layers for one micro-batch: the token ids and the embedding
    (Inkling's RMS-normed one), DeepSeek-V4's final collapse of the streams (``hc_head``, with the last layer's
    output it reads), the final norm and the head's input (the logits are accounting.py's)."""
    backbone, head = _backbone(mc, dtype)
    params = {p.untyped_storage()._cdata for p in (*backbone.parameters(), *head.parameters())}
    ids, _, _ = _feed(mc, seq_len, micro_batch)
    tokens, h = seq_len * micro_batch, mc.hidden_size
    n = mc.spec.hc_mult if mc.model_type == "deepseek_v4" else 1
    with torch.device("meta"):
        last = torch.empty(1, tokens, n * h, dtype=dtype, requires_grad=True)

    def top() -> torch.Tensor:
        y = backbone.hc_head(last.view(1, tokens, n, h)) if mc.model_type == "deepseek_v4" else last
        return head(backbone.norm(y))

    return sum(_live(lambda: backbone.embed_tokens(ids), params).values()) + sum(_live(top, params).values())


def family_state(mc: ModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """(bytes per token, bytes per sequence) of the decode state our engine keeps for a sequence of DeepSeek-V4 or
    Inkling (engine/family_states.py; dsv4_state.py / inkling_state.py ``state_bytes``, the exact size after L
    tokens): per token, the growth past the windows (compressed entries; global layers' keys and values), rounded
    up; per sequence, the most the rest holds (windows, partial blocks, convolution inputs). So that
    ``state_bytes(L) <= per_sequence + per_token * L`` for every L (equal at some L when per_token is exact)."""
    from miles_hpc.models import dsv4_state, inkling_state

    s = mc.spec
    if mc.model_type == "deepseek_v4":
        size, window = dsv4_state.state_bytes, s.sliding_window
        period = math.lcm(*({s.compress_rate(kind) for kind in s.layer_types} - {0}))  # lcm() is 1
    else:
        size, window, period = inkling_state.state_bytes, s.sliding_window_size, 1
    start = window + period  # past the window and the first overlap block: periodic from here on
    per_token = -(-(size(mc, start + period, dtype_bytes) - size(mc, start, dtype_bytes)) // period)
    per_sequence = max(size(mc, n, dtype_bytes) - per_token * n for n in range(start + period))
    return per_token, per_sequence


def family_notes(mc: ModelConfig | None) -> list[str]:
    """The plan's assumptions particular to a FAMILY_MODULES family (none for the others, or with no model)."""
    if mc is None or mc.spec is None:
        return []
    attention = (
        "its attention is computed eagerly (no kernel: [heads, S, S + compressed entries] logits and probabilities "
        "per sequence, quadratic in the length), its layers keep their hc_mult streams"
        if mc.model_type == "deepseek_v4"
        else "its SDPA call takes the relative logits as an additive [heads, 1024-query chunk, keys] mask that "
        "needs a gradient: CUDA's memory-efficient kernel keeps it (quadratic in the length)"
    )
    return [
        f"{mc.model_type}: activations measured on the meta device, layer kind by layer kind, as its backbone runs "
        f"them (planner/measure.py); {attention}",
        f"{mc.model_type} rollout: our engine's per-sequence decode state (no SGLang, no TP, no paging): "
        "rollout_kv_bytes_per_token is what it grows by per token (compressed entries, global layers' keys and "
        "values), rollout_state_bytes_per_seq the most the rest holds (windows, partial blocks, convolution inputs); "
        "rollout_kv_tokens_per_gpu counts the per-token part only",
    ]
