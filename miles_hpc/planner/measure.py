"""Activation bytes of the hybrid families' layers, measured: each distinct layer of the implemented model runs once
on the meta device (no memory, no arithmetic) under ``saved_tensors_hooks``, and what autograd keeps for backward
is counted storage by storage. Issue 29: the Gated DeltaNet and Mamba-2 scans keep per-chunk tensors and states
that a closed formula would have to track through every line of deltanet.py / mamba2.py; running that code is
exact by construction and cannot drift from it.

Stage: sync (planning; accounting.py calls it for hybrid models). Imports only :mod:`miles_hpc.models`.

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
"""

from __future__ import annotations

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
    return sum(n for key, n in live.items() if key not in params | skip)


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
    convolution inputs in the model dtype and its scan state in float32."""
    from miles_hpc.models.hybrid import linear_dims
    from miles_hpc.models.nemotron import mamba_dims

    per_layer = 0
    if mc.model_type == "nemotron_h":
        m = mamba_dims(mc)
        per_layer = m.conv_channels * (m.conv_width - 1) * dtype_bytes + 4 * m.heads * m.head_dim * m.state
    elif mc.is_hybrid:
        d = linear_dims(mc)
        per_layer = d.conv_channels * (d.conv_width - 1) * dtype_bytes + 4 * d.value_heads * d.key_dim * d.value_dim
    return per_layer * sum(mc.is_linear_layer(i) for i in range(mc.num_hidden_layers))
