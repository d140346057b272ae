"""Multi-head latent attention (MLA) of the DeepSeek-V3 family (also Kimi-K2), as transformers 5.24 computes it.

Stage: shared model code (the trainer's forward; the engine serves it from a latent cache, engine/latent_cache.py).

Per token: the query is `q_proj(x)` or, with `q_lora_rank`, `q_b_proj(RMSNorm(q_a_proj(x)))`, split per head into a
part without position (`qk_nope_head_dim`) and a rotary part (`qk_rope_head_dim` = `config.head_dim`).
`kv_a_proj_with_mqa(x)` gives the compressed latent (`kv_lora_rank`, RMS-normed) and ONE rotary key part shared by
all heads; `kv_b_proj(latent)` expands it per head into the key's nope part and the value (`v_head_dim`). Keys are
[nope | rope], queries likewise, so q.k spans qk_head_dim = nope + rope; values are narrower. RoPE rotates either
the two halves (as Llama) or interleaved pairs (`rope_interleave`, DeepSeek's released layout). The softmax scale is
qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn RoPE (transformers' `yarn_apply_mscale`).

Parameter names are the HF ones: `q_proj` | `q_a_proj`, `q_a_layernorm`, `q_b_proj`; `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`. The two latent norms use RMSNorm's default eps 1e-6, not `rms_norm_eps`
(transformers builds them so for every MLA family).

DSA families (deepseek_v32, glm_moe_dsa; dsa.py): each query's keys are the indexer's top-k; a layer with an
indexer returns its selection, which GLM-5.2's "shared" layers take as `shared`.

Backend hooks (optional methods of the attention backend object, found by name; the trainer's backends have none,
so its results are those of the default path):
- `mla_attention(q_nope [B, H, T, nope], q_rot [B, H, T, rope], latent [B, T, kv_lora_rank], k_rot [B, 1, T, rope],
  *, kv_b_proj, layer_idx, scale, selection) -> [B, H, T, v_head_dim]`: the layer hands over the kv_a_layernorm-ed
  latent and the rotated shared key part BEFORE kv_b_proj expands them (queries rotated, scale as above, `selection`
  the DSA top-k or None), so a paged cache can store kv_lora_rank + rope values per token instead of
  heads * (qk_head_dim + v_head_dim); the backend applies `kv_b_proj` (the module: hooks and batch-invariant
  forwards apply) to whatever it expands. The engine's `LatentAttention` implements it.
- DSA (dsa.py): `dsa_select(iq, ik, iw, *, layer_idx, topk, scale) -> Selection` instead of the uncached top-k, and,
  on the default path only, `dsa_attention(q, k, v, *, layer_idx, scale, selection)` instead of the uncached sparse
  attention.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import dsa
from .attention import AttentionBackend
from .config import ModelConfig
from .layers import RMSNorm
from .rope import apply_rotary

LATENT_NORM_EPS = 1e-6


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...; the output lists the rotated evens, then the odds (what
    transformers' `apply_rotary_pos_emb_interleave` returns). cos/sin: [B, T, D] halves-duplicated as usual."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def softmax_scale(config: ModelConfig) -> float:
    scale = config.qk_head_dim**-0.5
    rs = config.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        factor = rs.factor or 1.0
        m = 1.0 if factor <= 1 else 0.1 * rs.mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.interleave = config.rope_interleave
        self.scale = softmax_scale(config)
        h, qk = config.hidden_size, self.num_heads * (self.nope + self.rope)
        bias = config.qkv_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.dsa = config.is_dsa
        self.index_topk = config.index_topk
        if config.indexer_full(layer_idx):
            self.indexer = dsa.Indexer(config, layer_idx)
        # The indexer loss (dsa.indexer_kl): None = off, "sparse" / "dense" = on in training forwards, which leave
        # this layer's KL sum over its query rows in `indexer_kl` (CausalLM.set_indexer_loss / take_indexer_kl).
        self.indexer_loss: str | None = None
        self.indexer_kl: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
        shared: dsa.Selection | None = None,
        replay: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dsa.Selection | None]:
        """(output [B, T, hidden], this layer's DSA selection or None); `shared`: the selection a "shared" DSA
        layer reuses; `replay` [B, T, K]: a full layer's recorded key positions (dsa.replay_selection), whose
        stats are then in `self.replay_stats`. A backend with `mla_attention` (the engine's latent cache) gets the latent before its
        expansion (module docstring); otherwise keys and values are expanded here and go to `backend`."""
        b, t, _ = x.shape
        q_resid = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(b, t, self.num_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        k_rot = k_rot.view(b, 1, t, self.rope)
        if self.interleave:
            q_rot, k_rot = rope_interleaved(q_rot, cos, sin), rope_interleaved(k_rot, cos, sin)
        else:
            q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)
        latent = self.kv_a_layernorm(latent)
        selection = None
        if self.dsa:
            assert q_resid is not None
            selection = self._select(x, q_resid, cos, sin, backend, cu_seqlens) if hasattr(self, "indexer") else shared
            if replay is not None and selection is not None and hasattr(self, "indexer"):
                bounds = dsa.host_bounds(cu_seqlens, b, t)
                selection, self.replay_stats = dsa.replay_selection(selection, replay, bounds)
            if selection is None:
                raise ValueError(
                    f"layer {self.layer_idx}: a shared DSA layer needs the selection of an earlier full layer"
                )
        cached = getattr(backend, "mla_attention", None)
        if cached is not None:  # the engine: caches the latent, applies kv_b_proj itself
            out = cached(
                q_nope,
                q_rot,
                latent,
                k_rot,
                kv_b_proj=self.kv_b_proj,
                layer_idx=self.layer_idx,
                scale=self.scale,
                selection=selection,
            )
        else:
            out, q, k = self._expanded(q_nope, q_rot, latent, k_rot, backend, cu_seqlens, selection)
            if self.indexer_loss is not None and hasattr(self, "indexer") and torch.is_grad_enabled():
                assert q_resid is not None and selection is not None
                self.indexer_kl = self._indexer_kl(x, q_resid, cos, sin, q, k, cu_seqlens, selection)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim)), selection

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
        selection: dsa.Selection | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The default path: per-head keys [nope | rope] and values from the normed latent, then attention
        (`backend`, or DSA's sparse attention over `selection`): (out [B, H, T, v_head_dim], q, k)."""
        b, t, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, t, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        v = v.contiguous()
        if selection is None:
            return backend(q, k, v, layer_idx=self.layer_idx, scale=self.scale, cu_seqlens=cu_seqlens), q, k
        attend = dsa.backend_hook(backend, "dsa_attention")
        if attend is not None:
            return attend(q, k, v, layer_idx=self.layer_idx, scale=self.scale, selection=selection), q, k
        bounds = dsa.host_bounds(cu_seqlens, b, t)
        return dsa.sparse_attention(q, k, v, scale=self.scale, bounds=bounds, selection=selection), q, k

    def _indexer_kl(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        selection: dsa.Selection,
    ) -> torch.Tensor:
        """This layer's indexer loss (dsa.indexer_kl): the indexer re-projected with autograd from the detached
        layer input and compressed query, against this forward's attention queries and keys."""
        iq, ik, iw = self.indexer.project_with_grad(x.detach(), q_resid.detach(), cos, sin)
        return dsa.indexer_kl(
            iq,
            ik,
            iw,
            q,
            k,
            index_scale=self.indexer.scale,
            attn_scale=self.scale,
            bounds=dsa.host_bounds(cu_seqlens, x.shape[0], x.shape[1]),
            selection=selection if self.indexer_loss == "sparse" else None,
        )

    def _select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        cu_seqlens: torch.Tensor | None,
    ) -> dsa.Selection:
        iq, ik, iw = self.indexer.project(x, q_resid, cos, sin)
        select = dsa.backend_hook(backend, "dsa_select")
        if select is not None:  # the engine: scores against its cached indexer keys too
            return select(iq, ik, iw, layer_idx=self.layer_idx, topk=self.index_topk, scale=self.indexer.scale)
        bounds = dsa.host_bounds(cu_seqlens, x.shape[0], x.shape[1])
        return dsa.select_topk(iq, ik, iw, topk=self.index_topk, scale=self.indexer.scale, bounds=bounds)


__all__ = ["MLAttention", "rope_interleaved", "softmax_scale"]
