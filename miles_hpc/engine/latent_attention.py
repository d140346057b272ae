"""The engine's attention backend for MLA models: `mla_attention` and `dsa_select` over a `LatentCache`.

Stage: engine (the runner builds one `LatentAttention` per step for an MLA model; `MLAttention` calls its hooks,
models/mla.py). Metadata: the step's `AttentionMetadata` (paged_attention.py), the same as for dense models.

Per layer and step, `mla_attention` writes each new token's latent and rotated key part into the cache, then
attends each query over its keys EXPANDED ON THE FLY: the latent rows a query needs are gathered from the cache and
run through the layer's own `kv_b_proj` (nope keys and values per head), the shared rotated part is appended to
every head's key, and softmax attention runs as the model's default path runs it. So a key and a value are the
model's own computation on the same numbers (bit-identical inputs; batch-invariant `kv_b_proj` in zero-KL mode
gives the trainer's bits), and nothing needs a second copy of the weights. The cost is the expansion, done again
each step: per layer and step, rows * kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim) multiply-adds for the
rows expanded, against rows * heads * (qk_head_dim + v_head_dim) for the attention itself. Rows expanded:
- dense MLA (DeepSeek-V3): every cached token of the step's sequences (a decode row re-expands its whole context);
- DSA: a decode row expands only its `index_topk` selected tokens, so its cost is bounded by index_topk, whatever
  the context; a prefill chunk expands its context once and masks to each query's selection.
Absorbing kv_b_proj into the query and the output (attention in latent space, as SGLang's MLA kernels do) would
cost rows * (kv_lora_rank + rope) per head instead; it reorders the arithmetic, so it is left for the GPU work.

DSA (`dsa_select`): each step's indexer keys go into the cache first; each query then scores the cached and new
keys of its own sequence (`dsa.index_scores`, float32) and keeps the top `index_topk` with the rule of
`dsa.causal_topk`: a query at absolute position p sees keys <= p, the rest masked below every score first, k =
min(index_topk, keys in the row). The selection (positions within the sequence) is returned to the model, which
hands it to this layer's `mla_attention` and to the "shared" layers after it (GLM-5.2), as in its own forward.
Layout of the engine's `Selection`: with decode rows, first one tensor [Bd, 1, k] for all of them (scored in one
batch over their padded contexts, padding masked like the future), then one [count, n, k] per `PrefillSeq`.
Recording (a cache with `indexer_topk`, EngineConfig.record_indexer_topk): every token of the step, decode row or
prefill row alike, gets its selection written into its slot's row of the layer: key positions <= its own, the
masked picks (future keys, decode padding) and the width short of index_topk as -1 (`_record`).

Batch-invariant (zero-KL) mode: metadata with `invariant` (an `InvariantPack`); every sequence's keys and values
are expanded from positions 0..ctx-1 and attended by `invariant.packed_attention`. DSA models are refused in that mode (Engine).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles_hpc.models import dsa, invariant
from miles_hpc.models.attention import no_cudnn_sdpa

from .latent_cache import LatentCache
from .paged_attention import AttentionMetadata, PrefillSeq


class LatentAttention:
    """The attention backend of one step of an MLA model over a `LatentCache` (B == 1, sequences packed)."""

    def __init__(self, cache: LatentCache, meta: AttentionMetadata) -> None:
        self.cache, self.meta = cache, meta

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer_idx: int,
        scale: float,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        raise RuntimeError(
            f"layer {layer_idx}: a latent cache serves MLA layers through mla_attention (models/mla.py), "
            "not expanded keys and values"
        )

    # ---------------------------------------------------------------- DSA selection
    @torch.no_grad()
    def dsa_select(
        self, iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, *, layer_idx: int, topk: int, scale: float
    ) -> dsa.Selection:
        """iq [1, T, H, D], ik [1, T, D], iw [1, T, H] (float32) of the step's tokens -> the engine's Selection."""
        m = self.meta
        if m.invariant is not None:
            raise RuntimeError("DSA models do not run in batch-invariant mode (the engine refuses them)")
        keys = self.cache.index_flat(layer_idx)
        keys.index_copy_(0, m.slot_mapping, ik[0].to(keys.dtype))
        out: dsa.Selection = []
        if m.decode_rows is not None:
            assert m.decode_slots is not None and m.decode_mask is not None
            rows = m.decode_rows
            kd = keys[m.decode_slots].float()  # [Bd, ctx, D]
            scores = dsa.index_scores(iq[0][rows].unsqueeze(1), kd, iw[0][rows].unsqueeze(1), scale)  # [Bd, 1, ctx]
            out.append(dsa.causal_topk(scores, topk, offset=m.positions[rows]))  # masks padding as the future
        for p in m.prefills:
            qs, ws = iq[0, p.q_start : p.q_end], iw[0, p.q_start : p.q_end]
            if p.key_slots is None:  # count fresh prompts of n tokens: each scores its own keys
                n = (p.q_end - p.q_start) // p.count
                kq = ik[0, p.q_start : p.q_end].view(p.count, n, -1)
                qv, wv = qs.view(p.count, n, *qs.shape[1:]), ws.view(p.count, n, -1)
                out.append(dsa.topk_in_chunks(qv, kq, wv, scale, topk))
            else:
                ctx, n = p.key_slots.shape[0], p.q_end - p.q_start
                kc = keys[p.key_slots].float()[None]
                out.append(dsa.topk_in_chunks(qs[None], kc, ws[None], scale, topk, offset=ctx - n))
        if self.cache.indexer_topk is not None:
            self._record(layer_idx, out)
        return out

    def _record(self, layer_idx: int, selection: dsa.Selection) -> None:
        """The step's selections of layer `layer_idx` into the cache's `indexer_topk`, one row per packed token at
        its slot (module docstring): the decode rows, then each `PrefillSeq`'s rows in packed order."""
        store, m = self.cache.indexer_topk, self.meta
        assert store is not None
        rows = [] if m.decode_rows is None else [m.decode_rows]
        rows += [torch.arange(p.q_start, p.q_end, device=m.positions.device) for p in m.prefills]
        width = store.shape[-1]
        picks = torch.cat([F.pad(s.reshape(-1, s.shape[-1]), (0, width - s.shape[-1]), value=-1) for s in selection])
        packed = torch.cat(rows)
        picks = torch.where(picks.long() <= m.positions[packed][:, None], picks, -1)  # past the query: no key
        store[m.slot_mapping[packed], self.cache.index_row[layer_idx]] = picks.to(store.dtype)

    # ---------------------------------------------------------------- attention
    def mla_attention(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        *,
        kv_b_proj: torch.nn.Module,
        layer_idx: int,
        scale: float,
        selection: dsa.Selection | None,
    ) -> torch.Tensor:
        """The `MLAttention` hook (models/mla.py): [1, H, T, v_head_dim] for the step's packed queries."""
        m = self.meta
        lat_c, kr_c = self.cache.flat(layer_idx)
        lat_c.index_copy_(0, m.slot_mapping, latent[0].to(lat_c.dtype))
        kr_c.index_copy_(0, m.slot_mapping, k_rot[0, 0].to(kr_c.dtype))
        ex = _Expander(kv_b_proj, q_nope.shape[1], q_nope.shape[-1])
        q = torch.cat([q_nope, q_rot], dim=-1)  # [1, H, T, qk_head_dim], as the model's default path
        with no_cudnn_sdpa():
            if (pack := m.invariant) is not None:
                k, v = ex(lat_c[pack.key_slots], kr_c[pack.key_slots])  # [sum of ctx, H, *]
                kt, vt = k.transpose(0, 1), v.transpose(0, 1)
                return invariant.packed_attention(q[0], kt, vt, pack.starts, pack.cu_q, pack.cu_k, scale)[None]
            out = q.new_empty(*q.shape[:-1], ex.v_dim)
            sel = iter(selection) if selection is not None else None
            if m.decode_rows is not None:
                out[0][:, m.decode_rows] = self._decode(q, lat_c, kr_c, ex, scale, None if sel is None else next(sel))
            for p in m.prefills:
                fresh = (latent[0, p.q_start : p.q_end], k_rot[0, 0, p.q_start : p.q_end])
                s = None if sel is None else next(sel)
                out[:, :, p.q_start : p.q_end] = self._prefill(q, p, fresh, lat_c, kr_c, ex, scale, s)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        lat_c: torch.Tensor,
        kr_c: torch.Tensor,
        ex: _Expander,
        scale: float,
        sel: torch.Tensor | None,
    ) -> torch.Tensor:
        """[H, Bd, v] for the decode rows: over their whole context, or (DSA) over their selected positions."""
        m = self.meta
        assert m.decode_rows is not None and m.decode_slots is not None and m.decode_mask is not None
        slots, mask = m.decode_slots, m.decode_mask  # [Bd, ctx], [Bd, 1, 1, ctx]
        if sel is not None:  # [Bd, 1, k] positions; those past a row's context were padding (masked)
            pick = sel[:, 0].long()
            slots = slots.gather(1, pick)
            mask = m.decode_mask[:, 0, 0].gather(1, pick)[:, None, None, :]
        k, v = ex(lat_c[slots], kr_c[slots])  # [Bd, n, H, *]
        qd = q[0][:, m.decode_rows].transpose(0, 1).unsqueeze(2)  # [Bd, H, 1, qk]
        od = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        return od.squeeze(2).transpose(0, 1)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        p: PrefillSeq,
        fresh: tuple[torch.Tensor, torch.Tensor],
        lat_c: torch.Tensor,
        kr_c: torch.Tensor,
        ex: _Expander,
        scale: float,
        sel: torch.Tensor | None,
    ) -> torch.Tensor:
        """[1, H, n_rows, v] for one `PrefillSeq`: fresh prompts attend their own latents (causal), a chunk after a
        cached prefix its gathered context (causal from its offset); with DSA only each query's selected keys."""
        qs = q[:, :, p.q_start : p.q_end]
        if p.key_slots is None:
            k, v = ex(*fresh)  # [count * n, H, *]
            n = qs.shape[2] // p.count
            k, v = (x.view(p.count, n, *x.shape[1:]).transpose(1, 2) for x in (k, v))  # [count, H, n, *]
            qs = qs[0].view(qs.shape[1], p.count, n, -1).transpose(0, 1)
            if sel is None:
                o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=dsa.selection_mask(sel, n), scale=scale)
            return o.transpose(0, 1).reshape(1, o.shape[1], -1, o.shape[3])
        assert p.mask is not None
        k, v = ex(lat_c[p.key_slots], kr_c[p.key_slots])  # [ctx, H, *]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = p.mask if sel is None else dsa.selection_mask(sel, k.shape[2])
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)


class _Expander:
    """Per-head keys [..., H, nope + rope] and values [..., H, v] from latent rows [..., rank] and rotated key parts
    [..., rope], by the layer's `kv_b_proj` (as `MLAttention._expanded` computes them)."""

    def __init__(self, kv_b_proj: Any, heads: int, nope: int) -> None:
        self.kv_b_proj, self.heads, self.nope = kv_b_proj, heads, nope
        self.v_dim = kv_b_proj.weight.shape[0] // heads - nope

    def __call__(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv_b_proj(latent).view(*latent.shape[:-1], self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(-2).expand(*k_rot.shape[:-1], self.heads, k_rot.shape[-1])], dim=-1)
        return k, v
