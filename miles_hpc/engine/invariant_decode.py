"""Zero-KL mode's decode step in CUDA graphs: the invariant model's own forward over the paged cache, with no host
read, so `cuda_graphs.DecodeRunner` can capture and replay it as it does the normal step.

Stage: engine (`ModelRunner` hands it decode-only steps in batch-invariant mode; docs/lora.md, "Zero-KL mode").

How: the model was made invariant (`models.batch_invariant`), so its linears, norms, RoPE and MLP are already the
Triton kernels of `models/triton_invariant.py` (one launch each, fixed tiles); what the eager step adds on the host
(the per-sequence key gather and its tile table) is replaced by `triton_invariant.paged_attention`, which reads each
row's keys through its block-table row and puts the query where the trainer's packed call puts it, so a row's bits
are the eager step's and the trainer's. Greedy samples and their log-probs come from `invariant.log_softmax` inside
the graph (`greedy_sample`), as `sampling.sample` computes them in this mode.

Invariants: dense models only (an MoE layer's invariant experts group tokens by expert on the host), standard
attention (no MLA, linear attention or family backbones), static RoPE, and the Triton kernels in use (the torch
tiles read shapes on the host); `unsupported_reason` names what stops a model. The KV of row i goes to slot
`block_tables[i, p // block_size] * block_size + p % block_size` at its position p.
"""

from __future__ import annotations

import torch

from miles_hpc.models import CausalLM, invariant

from .kv_cache import KVCache


def unsupported_reason(model: CausalLM, cache: object) -> str | None:
    """Why zero-KL decode steps of `model` cannot be captured (None when they can)."""
    cfg = model.config
    if not isinstance(cache, KVCache) or cfg.is_mla:
        return "MLA attention (a latent cache)"
    if cfg.is_hybrid or hasattr(model.model, "run"):
        return "layers that keep their own state (linear attention or a family backbone)"
    if model.num_moe_layers:
        return "MoE layers (the invariant experts group tokens by expert on the host)"
    if model.rotary.dynamic:
        return "dynamic RoPE (frequencies depend on the largest position)"
    if invariant.kernels() == "torch":
        return f"{invariant.KERNELS_ENV}=torch (the torch tiles read shapes on the host)"
    if cfg.head_dim & (cfg.head_dim - 1):
        return f"head_dim {cfg.head_dim} (the invariant attention kernel takes powers of two)"
    return None


class InvariantDecodeForward:
    """`DecodeFn` (cuda_graphs.py): `(ids [n], positions [n], block_tables [n, W] int32, logits_out [n, vocab])`."""

    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        reason = unsupported_reason(model, cache)
        if reason is not None:
            raise ValueError(f"zero-KL decode in CUDA graphs does not support this model: {reason}")
        self.model, self.cache = model, cache

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, logits_out: torch.Tensor
    ) -> None:
        backend = _PagedInvariant(self.cache, positions, block_tables)
        logits = self.model(ids[None], position_ids=positions[None], attn_backend=backend)
        logits_out.copy_(logits[0])


class _PagedInvariant:
    """`AttentionBackend` of one decode step: writes each row's K/V at its slot, then `paged_attention`."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, block_tables: torch.Tensor) -> None:
        bs = cache.block_size
        self.cache, self.positions, self.tables = cache, positions, block_tables
        self.slots = block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).to(torch.int64) * bs + positions % bs

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
        del cu_seqlens  # every row is its own sequence
        from miles_hpc.models import triton_invariant

        kc, vc = self.cache.flat(layer_idx)
        # [1, H, n, D] -> [n, H, D]: the cache's slot-major layout, as PagedAttention writes it.
        kc.index_copy_(0, self.slots, k[0].transpose(0, 1).to(kc.dtype))
        vc.index_copy_(0, self.slots, v[0].transpose(0, 1).to(vc.dtype))
        out = triton_invariant.paged_attention(
            q[0].transpose(0, 1), kc, vc, self.tables, self.positions, self.cache.block_size, scale
        )
        return out.transpose(0, 1)[None]


def greedy_sample(logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """`cuda_graphs.Sampler`: `sampling.sample`'s greedy case with zero-KL's log-softmax (`invariant.log_softmax`):
    the first index of each row's largest float32 logit, and its log-prob as the trainer computes it."""
    lf = logits.to(torch.float32)
    tok = lf.argmax(dim=-1)
    tokens.copy_(tok)
    logprobs.copy_(invariant.log_softmax(lf).gather(1, tok[:, None]).squeeze(1))
