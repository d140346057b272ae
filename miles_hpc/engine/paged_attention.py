"""The engine's `AttentionBackend`: write this step's K/V into the paged cache, attend over prefix + new tokens.

Stage: engine (the runner builds one `PagedAttention` per step and passes it to `CausalLM.forward`).

Per-step metadata (`AttentionMetadata`) is built once per step as tensors, the layout paged-attention kernels take:
`slot_mapping` [T] (cache slot of each new token), `query_start_loc` [B+1], `context_lens` [B] (prefix + new),
`block_tables` [B, max_blocks] int32. This module's torch implementation derives from them:
- decode sequences (one new token): with a `DecodeKernel` (triton_decode.paged_decode on CUDA), one kernel call per
  layer reading `block_tables` and `context_lens` of the decode rows directly; without one (CPU), one batched SDPA
  per layer over keys gathered by a padded slot matrix with a length mask (built only in that case: it is
  [B, max_ctx]). Whole decode batches of dense models skip this class: `DecodeForward` in a CUDA graph.
- prefill chunks: a loop over sequences (cost per sequence, never per token); a chunk starting at 0 attends its own
  fresh K/V with `is_causal` (adjacent such chunks of equal length, as a batch of same-length prompts gives, in one
  batched call), a later chunk gathers its prefix from the cache and uses a causal mask offset by the
  prefix length (query j at absolute position start+j sees keys 0..start+j).
GQA uses SDPA's `enable_gqa`; the cache stores only the KV heads.

Batch-invariant mode (zero-KL, `EngineConfig.batch_invariant`; metadata built with `batch_invariant=True`): every
sequence's queries, decode or prefill alike, go through `models.invariant.attention` over that sequence's keys and
values gathered from the cache at positions 0..context-1 (all written: this step's K/V go in first), so a query
row's output is bit-identical to the trainer's whole-sequence computation. Costs one call per sequence per layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from miles_hpc.models import invariant
from miles_hpc.models.attention import no_cudnn_sdpa

from .kv_cache import KVCache

# (q [N, Hq, D], k_cache, v_cache [slots, Hkv, D], block_tables int32 [N, W], context_lens int32 [N], *, block_size,
# scale) -> [N, Hq, D]: `triton_decode.paged_decode`, or `decode_ops.paged_decode_reference`.
DecodeKernel = Callable[..., torch.Tensor]


@dataclass(slots=True)
class PrefillSeq:
    q_start: int  # rows [q_start, q_end) of the packed step
    q_end: int
    key_slots: torch.Tensor | None  # [ctx] cache slots of prefix + new keys; None when the chunk starts at 0
    mask: torch.Tensor | None  # bool [1, 1, n, ctx]; None when the chunk starts at 0
    count: int = 1  # chunks starting at 0: this many adjacent sequences of equal length, attended in one batch


@dataclass(frozen=True, slots=True)
class InvariantPack:
    """Batch-invariant mode's layout of a step, as `invariant.packed_attention` takes it: sequence i's queries are
    the packed rows cu_q[i]..cu_q[i+1]-1 at positions starts[i]..; its keys, positions 0..ctx-1 (written positions
    only), are the cache slots key_slots[cu_k[i]:cu_k[i+1]]."""

    starts: list[int]
    cu_q: list[int]
    cu_k: list[int]
    key_slots: torch.Tensor  # int64 [sum of ctx]


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # int64 [T]: absolute position of each packed token (prefix + offset)
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B+1]
    context_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    # Derived for the torch implementation.
    decode_rows: torch.Tensor | None  # int64 [Bd]: packed row of each decode sequence's query
    decode_slots: torch.Tensor | None  # int64 [Bd, max_ctx] (padding points at slot 0, masked)
    decode_mask: torch.Tensor | None  # bool [Bd, 1, 1, max_ctx]
    decode_tables: torch.Tensor | None  # int32 [Bd, max_blocks]: for a decode kernel (instead of slots and mask)
    decode_lens: torch.Tensor | None  # int32 [Bd]
    prefills: list[PrefillSeq]
    invariant: InvariantPack | None = None  # batch-invariant mode: every sequence, instead of the above

    @classmethod
    def build(
        cls,
        starts: list[int],
        lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        device: torch.device,
        *,
        gather_decode: bool = True,
        batch_invariant: bool = False,
    ) -> AttentionMetadata:
        """starts[i] = tokens of sequence i already in the cache, lens[i] = new tokens this step;
        block_tables [B, >= max blocks] int32 on `device`. `gather_decode`: build the decode rows' slot matrix and
        mask for the torch path; False: their block tables and lengths for a decode kernel. `batch_invariant`: only the
        per-sequence slots of the batch-invariant mode."""
        b = len(starts)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
        qsl = torch.zeros(b + 1, dtype=torch.int64, device=device)
        torch.cumsum(lens_t, 0, out=qsl[1:])
        total = sum(lens)
        seq = torch.repeat_interleave(torch.arange(b, device=device), lens_t, output_size=total)
        pos = torch.arange(total, device=device) - qsl[:-1][seq] + starts_t[seq]
        tables = block_tables.to(torch.int64)
        slot_mapping = tables[seq, pos // block_size] * block_size + pos % block_size
        ctx = starts_t + lens_t

        q_starts = list(itertools.accumulate(lens[:-1], initial=0))  # sequence i's first row in the packed step
        if batch_invariant:
            ctxs = [s + n for s, n in zip(starts, lens, strict=True)]
            cu_k = list(itertools.accumulate(ctxs, initial=0))
            kseq = torch.repeat_interleave(torch.arange(b, device=device), ctx, output_size=cu_k[-1])
            kpos = torch.arange(cu_k[-1], device=device) - torch.tensor(cu_k[:-1], device=device)[kseq]
            slots = tables[kseq, kpos // block_size] * block_size + kpos % block_size
            pack = InvariantPack(list(starts), [*q_starts, total], cu_k, slots)
            return cls(
                positions=pos,
                slot_mapping=slot_mapping,
                query_start_loc=qsl.to(torch.int32),
                context_lens=ctx.to(torch.int32),
                block_tables=block_tables,
                decode_rows=None,
                decode_slots=None,
                decode_mask=None,
                decode_tables=None,
                decode_lens=None,
                prefills=[],
                invariant=pack,
            )
        dec = [i for i in range(b) if lens[i] == 1]
        decode_rows = decode_slots = decode_mask = decode_tables = decode_lens = None
        if dec and not gather_decode:
            idx = torch.tensor(dec, dtype=torch.int64, device=device)
            decode_rows = qsl[:-1][idx]
            decode_tables = block_tables[idx]
            decode_lens = ctx[idx].to(torch.int32)
        elif dec:
            idx = torch.tensor(dec, dtype=torch.int64, device=device)
            max_ctx = max(starts[i] + 1 for i in dec)
            kpos = torch.arange(max_ctx, device=device)
            d_tables = tables[idx]
            blk = (kpos // block_size).clamp(max=d_tables.shape[1] - 1)
            decode_slots = d_tables[:, blk] * block_size + kpos % block_size
            decode_mask = (kpos[None, :] < ctx[idx][:, None])[:, None, None, :]
            decode_slots = decode_slots.masked_fill(~decode_mask[:, 0, 0], 0)
            decode_rows = qsl[:-1][idx]
        prefills = _prefill_seqs(starts, lens, q_starts, tables, block_size, device)
        return cls(
            positions=pos,
            slot_mapping=slot_mapping,
            query_start_loc=qsl.to(torch.int32),
            context_lens=ctx.to(torch.int32),
            block_tables=block_tables,
            decode_rows=decode_rows,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            decode_tables=decode_tables,
            decode_lens=decode_lens,
            prefills=prefills,
        )


def _prefill_seqs(
    starts: list[int],
    lens: list[int],
    q_starts: list[int],
    tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> list[PrefillSeq]:
    """The prefill rows of a step (every sequence with more than one new token): fresh prompts of one length that
    follow each other share one entry (no key slots: attention within the chunk); a prompt continued from the
    cache gets its key slots and causal mask."""
    prefills: list[PrefillSeq] = []
    for i in range(len(starts)):
        if lens[i] == 1:
            continue
        qs, n, s = q_starts[i], lens[i], starts[i]
        if s == 0:
            last = prefills[-1] if prefills else None
            if last and last.key_slots is None and last.q_end == qs and n * last.count == qs - last.q_start:
                last.q_end, last.count = qs + n, last.count + 1  # one more of the same length, right after
            else:
                prefills.append(PrefillSeq(qs, qs + n, None, None))
            continue
        kpos = torch.arange(s + n, device=device)
        slots = tables[i, kpos // block_size] * block_size + kpos % block_size
        qpos = torch.arange(s, s + n, device=device)
        mask = (kpos[None, :] <= qpos[:, None])[None, None]
        prefills.append(PrefillSeq(qs, qs + n, slots, mask))
    return prefills


class PagedAttention:
    """`AttentionBackend` over a `KVCache` for one step's `AttentionMetadata` (B == 1, sequences packed)."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, decode_kernel: DecodeKernel | None = None) -> None:
        """`decode_kernel` serves the decode rows; the metadata must then be built with gather_decode=False."""
        self.cache, self.meta, self.decode_kernel = cache, meta, decode_kernel

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
        del cu_seqlens  # the metadata says more (prefix lengths, slots)
        with no_cudnn_sdpa():  # per-shape cuDNN plans cost ms of host time (models/attention.py)
            return self._attend(q, k, v, layer_idx, scale)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
        m = self.meta
        kc, vc = self.cache.flat(layer_idx)
        # [1, H, T, D] -> [T, H, D]: the cache's slot-major layout.
        kc.index_copy_(0, m.slot_mapping, k[0].transpose(0, 1).to(kc.dtype))
        vc.index_copy_(0, m.slot_mapping, v[0].transpose(0, 1).to(vc.dtype))
        if m.invariant is not None:
            return self._attend_invariant(q, kc, vc, m.invariant, scale)
        gqa = q.shape[1] != k.shape[1]
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # MLA: values narrower than queries and keys
        if m.decode_rows is not None and self.decode_kernel is not None:
            assert m.decode_tables is not None and m.decode_lens is not None
            qd = q[0][:, m.decode_rows].transpose(0, 1)  # [Bd, Hq, D]
            od = self.decode_kernel(
                qd, kc, vc, m.decode_tables, m.decode_lens, block_size=self.cache.block_size, scale=scale
            )
            out[0][:, m.decode_rows] = od.transpose(0, 1)
        elif m.decode_rows is not None:
            assert m.decode_slots is not None and m.decode_mask is not None
            qd = q[0][:, m.decode_rows].transpose(0, 1).unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = kc[m.decode_slots].transpose(1, 2)  # [Bd, Hkv, ctx, D]
            vd = vc[m.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m.decode_mask, scale=scale, enable_gqa=gqa)
            out[0][:, m.decode_rows] = od.squeeze(2).transpose(0, 1)
        for p in m.prefills:
            qs = q[:, :, p.q_start : p.q_end]
            if p.key_slots is None:
                ks, vs = k[:, :, p.q_start : p.q_end], v[:, :, p.q_start : p.q_end]
                if p.count > 1:  # [1, H, count * n, D] -> [count, H, n, D]: one causal SDPA for the run
                    qs, ks, vs = (_split_rows(x, p.count) for x in (qs, ks, vs))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
                if p.count > 1:
                    o = o.transpose(0, 1).reshape(1, o.shape[1], -1, o.shape[3])
            else:
                ks = kc[p.key_slots].transpose(0, 1).unsqueeze(0)
                vs = vc[p.key_slots].transpose(0, 1).unsqueeze(0)
                o = _continued_prefill(qs, ks, vs, scale)
            out[:, :, p.q_start : p.q_end] = o
        return out

    @staticmethod
    def _attend_invariant(
        q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pack: InvariantPack, scale: float
    ) -> torch.Tensor:
        ks = kc[pack.key_slots].transpose(0, 1)  # [Hkv, sum of ctx, D]: exactly the written positions
        vs = vc[pack.key_slots].transpose(0, 1)
        return invariant.packed_attention(q[0], ks, vs, pack.starts, pack.cu_q, pack.cu_k, scale)[None]


def _continued_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk continued from the cache: its n queries are the last n of the ctx keys (lower-right causal).
    As a causal bias, not the chunk's bool mask, SDPA runs it in the flash or memory-efficient kernel; a bool mask
    with grouped KV heads fell back to the math kernel and its [H, n, ctx] scores (8 GiB at 8k queries over 16k
    keys). Grouped KV heads are repeated here: the bias's kernels take equal head counts."""
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)


def _split_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """[1, H, count * n, D] -> [count, H, n, D] (a view)."""
    _, h, t, d = x.shape
    return x[0].view(h, count, t // count, d).transpose(0, 1)
