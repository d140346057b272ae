"""A decode step as few kernels: the `CausalLM` forward for one new token per sequence, fused.

Stage: engine (`cuda_graphs.DecodeRunner` captures it; on CPU it runs with `TorchDecodeOps` as a reference).

It reads the model's own parameters (no copies), so weight updates (in-place `copy_`) apply to it and to the
graphs that captured it. To run q/k/v and gate/up as one GEMM each, construction re-seats those parameters as views
of one buffer per layer (`fuse_projections`: same values, same Parameter objects, one allocation). Per layer: fused
add + RMSNorm, the qkv GEMM, one fused QK-norm + RoPE + KV-cache write, the paged-decode attention kernel, o_proj,
fused add + RMSNorm, the gate_up GEMM, fused SiLU * up, down. Same math and roundings as `CausalLM.forward` with
`PagedAttention` (decode_ops.py's contract). An MoE layer runs its own block (router, routed experts, shared
experts) and writes the chosen expert ids to `KVCache.routing` at the row's slot, as the eager step does for R3.

Invariants: no host sync and no data-dependent shapes (CUDA-graph safe) as long as the MoE blocks have none (the
torch experts, `moe.grouped_mix`, read the expert counts on the host: the runner captures MoE models only with
`triton_moe`'s fused experts); the KV of row i goes to slot `block_tables[i, p // block_size] * block_size +
p % block_size` at its position p; logits of every row. Not for "dynamic" RoPE (its frequencies depend on the
largest position, read on the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_hpc.models import CausalLM
from miles_hpc.models.layers import SwiGLUMLP

from .decode_ops import DecodeOps
from .kv_cache import KVCache


def unsupported_reason(model: CausalLM) -> str | None:
    """Why `DecodeForward` cannot run `model` (None when it can)."""
    if model.config.is_hybrid:
        return "linear-attention layers (their recurrent state runs through the eager forward)"
    if model.config.is_mla:
        return "MLA attention (latent projections; K and V of different widths)"
    if model.config.rotary_dim != model.config.head_dim:
        return "partial rotary embedding (the fused RoPE kernel rotates whole heads)"
    if model.rotary.dynamic:
        return "dynamic RoPE (frequencies depend on the largest position)"
    if not all(isinstance(layer.mlp, SwiGLUMLP) for layer in model.model.layers if not layer.is_moe):
        return "a non-SwiGLU MLP"
    return None


@torch.no_grad()
def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Re-seat the weights (and biases) of `linears` as row blocks of one new buffer; returns (weight, bias) of the
    fused linear. The Parameters stay the same objects with the same values, so loading, weight updates (in-place)
    and checksums by name are unaffected; a later copy into one of them is a copy into the fused buffer."""
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) != all(has_bias):
        raise ValueError("cannot fuse linears where only some have a bias")
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears if lin.bias is not None]) if all(has_bias) else None
    o = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[o : o + n]
        if bias is not None and lin.bias is not None:
            lin.bias.data = bias[o : o + n]
        o += n
    return weight, bias


class DecodeForward:
    """`(ids [n], positions [n], block_tables [n, W] int32, logits_out [n, vocab]) -> None`."""

    def __init__(self, model: CausalLM, cache: KVCache, ops: DecodeOps) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"DecodeForward does not support this model: {reason}")
        self.model, self.cache, self.ops = model, cache, ops
        self.block_size = cache.block_size
        self.silu = model.config.hidden_act in ("silu", "swish")
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.gate_up: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []  # None: an MoE layer
        self.moe_index = {layer_idx: j for j, layer_idx in enumerate(model.moe_layer_ids)}  # column of routing
        if self.moe_index and cache.routing is None:
            raise ValueError("an MoE model's decode needs the cache's routing rows (KVCache(num_moe_layers=...))")
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.qkv.append(fuse_linears([att.q_proj, att.k_proj, att.v_proj]))
            self.gate_up.append(None if layer.is_moe else fuse_linears([mlp.gate_proj, mlp.up_proj]))

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, logits_out: torch.Tensor
    ) -> None:
        m, ops, bs = self.model, self.ops, self.block_size
        n = ids.shape[0]
        slots = block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).to(torch.int64) * bs + positions % bs
        context_lens = (positions + 1).to(torch.int32)
        residual = m.model.embed_tokens(ids)
        cos, sin = m.rotary(positions[None], residual.dtype)
        cos, sin = cos[0], sin[0]
        layers = m.model.layers
        first = layers[0].input_layernorm
        h = ops.rms_norm(residual, first.weight, first.eps)
        for i, layer in enumerate(layers):
            att = layer.self_attn
            kc, vc = self.cache.flat(i)
            qn, kn = att.q_norm, att.k_norm
            qkv = F.linear(h, *self.qkv[i])
            nq, nkv = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
            q = ops.qk_norm_rope_store(
                qkv[:, :nq],
                qkv[:, nq : nq + nkv],
                qkv[:, nq + nkv :],
                None if qn is None else qn.weight,
                None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps,
                cos,
                sin,
                kc,
                vc,
                slots,
            )
            o = ops.attention(q, kc, vc, block_tables, context_lens, block_size=bs, scale=att.scale)
            o = att.o_proj(o.view(n, att.num_heads * att.head_dim))
            post = layer.post_attention_layernorm
            h = ops.add_rms_norm(residual, o, post.weight, post.eps)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else m.model.norm
            h = ops.add_rms_norm(residual, self._mlp(i, layer.mlp, h, slots), nxt.weight, nxt.eps)
        head = m.lm_head
        if head.bias is None:
            torch.mm(h, head.weight.t(), out=logits_out)
        else:
            logits_out.copy_(head(h))

    def _mlp(self, i: int, mlp: nn.Module, h: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP of the normed rows h [n, H]; an MoE layer also records its expert ids at `slots`."""
        gate_up = self.gate_up[i]
        if gate_up is None:
            out, ids = mlp(h[None])  # [1, n, H], [n, top_k]
            routing = self.cache.routing
            assert routing is not None
            routing[slots, self.moe_index[i]] = ids.to(routing.dtype)
            return out[0]
        x = F.linear(h, *gate_up)
        inter = x.shape[1] // 2
        gate, up = x[:, :inter], x[:, inter:]
        return mlp.down_proj(self.ops.silu_mul(gate, up) if self.silu else mlp.act(gate) * up)
