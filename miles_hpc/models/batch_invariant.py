"""Zero-KL mode for a model (stage: shared model code; issue 12; docs/lora.md, "Zero-KL mode").

`make_batch_invariant(model)` switches an existing `CausalLM` in place to the batch-invariant primitives of
`invariant.py`, so a token's logits are bit-identical whether the engine computes it in a decode step of 1 row, in
a prefill chunk after a cached prefix, or the trainer in a packed micro-batch of thousands:
- every `nn.Linear`, `RMSNorm` and the SwiGLU MLP get an instance `forward` over fixed-shape row tiles (parameter
  names, hooks and checkpoints are unchanged: nothing is wrapped, only the instance's `forward` is replaced, and
  it reads the module's parameters at call time, so FSDP's gathered parameters and in-place weight updates are
  what it uses);
- RoPE's cos/sin (transcendental elementwise kernels, whose vector path depends on where an element sits in the
  tensor) are computed on tiles of one position per row;
- MoE routers (Qwen3-MoE's softmax top-k, DeepSeek-V3/GLM-4.5's group-limited sigmoid) run their whole forward
  (gate GEMM, softmax or sigmoid, group and expert top-k, replay merge) on fixed-shape row tiles, so a token's
  expert ids and gate weights do not depend on the batch; the routed experts run each expert's GEMMs through
  `invariant.linear` (an expert's token count varies with the batch, its tiles do not) and sum a token's k slots by
  sequential float32 adds in slot order (a reduction kernel over k could split it differently by batch size);
- MLA needs nothing of its own: its projections are linears, its norms RMSNorms, its RoPE multiply-adds, and its
  attention (keys of nope + rope width, narrower values) goes to the same per-sequence `invariant.attention`;
- attention is the caller's: `packed_attention` here for the trainer (per packed sequence), the engine's paged
  backend in its invariant mode. The rest (embedding lookup, residual adds, RoPE's multiply-adds, casts) is
  elementwise IEEE arithmetic, exact whatever the batch.

Refused at run time (ValueError naming the field): dynamic NTK RoPE past `max_position_embeddings`, where its
frequencies depend on the longest position of the call, so the engine's step and the trainer's micro-batch would
rotate the same position differently (within it, the frequencies are the static ones).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .attention import check_cu_seqlens
from .layers import RMSNorm, SwiGLUMLP
from .moe import Experts, GroupLimitedRouter, TopKRouter, grouped_mix
from .transformer import CausalLM

__all__ = ["is_batch_invariant", "make_batch_invariant", "packed_attention"]

_FLAG = "_miles_batch_invariant"


def is_batch_invariant(model: nn.Module) -> bool:
    return bool(getattr(model, _FLAG, False))


log = logging.getLogger(__name__)
MAX_CPU_THREADS = 8


def cap_cpu_threads(device: torch.device) -> None:
    """On the CPU, at most MAX_CPU_THREADS intra-op threads for this process: with more (16 measured), torch's
    multithreaded CPU GEMM gives a row different bits depending on its place in a fixed-shape tile (docs/lora.md,
    Zero-KL mode), which would break the mode; 1-8 threads were invariant in every check."""
    if device.type == "cpu" and torch.get_num_threads() > MAX_CPU_THREADS:
        log.warning(
            "zero-KL mode: %d CPU threads capped to %d (batch invariance of the CPU GEMM)",
            torch.get_num_threads(),
            MAX_CPU_THREADS,
        )
        torch.set_num_threads(MAX_CPU_THREADS)


def make_batch_invariant(model: CausalLM) -> CausalLM:
    """Switch `model`'s forward pieces to batch-invariant ones, in place (idempotent); returns `model`."""
    if is_batch_invariant(model):
        return model
    cap_cpu_threads(next(model.parameters()).device)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            _set_forward(module, _linear_forward(module, own_storage=module is model.lm_head))
        elif isinstance(module, RMSNorm):
            _set_forward(module, _rms_norm_forward(module))
        elif isinstance(module, SwiGLUMLP):
            _set_forward(module, _mlp_forward(module))
        elif isinstance(module, TopKRouter | GroupLimitedRouter):
            _set_forward(module, _router_forward(module))
        elif isinstance(module, Experts):
            _set_forward(module, _experts_forward(module))
    _set_forward(model.rotary, _rope_forward(model.rotary))
    setattr(model, _FLAG, True)
    return model


def _set_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.forward = forward  # type: ignore[method-assign]


def _linear_forward(m: nn.Linear, own_storage: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """`own_storage` (the LM head): the logits are the model's output, and a view (the tiles' cat, reshaped) there
    makes FSDP2 warn that an in-place op on it would skip its backward hook; a copy of its own is not a view."""
    if own_storage:
        return lambda x: invariant.linear(x, m.weight, m.bias).clone()
    return lambda x: invariant.linear(x, m.weight, m.bias)


def _rms_norm_forward(m: RMSNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: invariant.rms_norm(x, m.weight, m.eps)


def _mlp_forward(m: SwiGLUMLP) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: m.down_proj(invariant.act_mul(m.act, m.gate_proj(x), m.up_proj(x)))  # already tiled linears


RouterForward = Callable[[torch.Tensor, torch.Tensor | None, bool], tuple[torch.Tensor, torch.Tensor]]


def _router_forward(m: TopKRouter | GroupLimitedRouter) -> RouterForward:
    """The router's own forward on fixed-shape tiles of `row_tile(hidden)` tokens (padding: zero rows with no
    replay record, dropped after). `replay_stats` sums the tiles' and leaves the padding out of the token count."""
    own = type(m).forward

    def forward(
        x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        r = invariant.row_tile(x.shape[1])
        pad = (-n) % r
        xp = F.pad(x, (0, 0, 0, pad))
        rp = None if replay is None else F.pad(replay.to(torch.long), (0, 0, 0, pad), value=-1)
        weights, ids, stats = [], [], []
        for i in range(0, n + pad, r):
            w, d = own(m, xp[i : i + r], None if rp is None else rp[i : i + r], compare)
            weights.append(w)
            ids.append(d)
            if rp is not None:
                stats.append(m.replay_stats)
        if stats:
            m.replay_stats = torch.stack(stats).sum(dim=0) - torch.tensor([0, 0, pad], device=stats[0].device)
        return torch.cat(weights)[:n], torch.cat(ids)[:n]

    return forward


def _experts_forward(m: Experts) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`Experts.forward` (the same grouping by expert) with tiled GEMMs and activation, and a token's k slots
    summed in slot order by elementwise float32 adds."""

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = invariant.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
        return invariant.linear(invariant.act_mul(m.act, gate, up), m.down_proj[e])

    def slot_sum(y: torch.Tensor) -> torch.Tensor:
        total = y[:, 0].float()
        for j in range(1, y.shape[1]):
            total = total + y[:, j].float()
        return total

    return lambda x, ids, weights: grouped_mix(x, ids, weights, m.num_experts, expert, slot_sum)


def _rope_forward(rot: nn.Module) -> Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]:
    """`RotaryEmbedding.forward` with cos/sin on fixed-shape tiles (one position per row). The angle itself is one
    float32 multiply per element, exact anywhere."""

    def forward(position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        limit = rot.config.max_position_embeddings
        if rot.dynamic and position_ids.numel() and int(position_ids.max()) >= limit:
            raise ValueError(
                f"zero-KL mode: position {int(position_ids.max())} is past "
                f"max_position_embeddings={limit} with rope_scaling.rope_type 'dynamic', whose "
                "frequencies then depend on the longest sequence of each call (not batch-invariant); "
                "keep contexts within it"
            )
        freqs = position_ids[..., None].float() * rot._inv_freq(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)
        r = emb.shape[-1]
        both = invariant.elementwise(lambda t: torch.cat([t.cos(), t.sin()], dim=-1), emb)
        cos, sin = both[..., :r] * rot.attention_scaling, both[..., r:] * rot.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    return forward


@torch.compiler.disable
def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer_idx: int,
    scale: float,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Batch-invariant `AttentionBackend` for the trainer: `invariant.packed_attention` of each row of the batch (one
    sequence per row, or the packed sequences of `cu_seqlens`), positions 0..n-1 within each sequence, as the engine
    attends over its cache."""
    del layer_idx
    b, _, t, _ = q.shape
    if cu_seqlens is None:
        layouts = [(row, [0, t]) for row in range(b)]
    else:
        bounds = check_cu_seqlens(cu_seqlens, b, t)
        layouts = [(0, [0, *(e for s, e in pairwise(bounds) if e > s)])]
    outs = [
        invariant.packed_attention(q[row], k[row], v[row], [0] * (len(cu) - 1), cu, cu, scale) for row, cu in layouts
    ]
    return torch.stack(outs)
