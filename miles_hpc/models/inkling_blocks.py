"""Inkling's MLPs, MoE, decoder layer and backbone (`model.*` of CausalLM), as transformers 5.24's
modeling_inkling.py computes them; attention and the short convolutions are in inkling_attention.py.

Stage: shared model code (the trainer's packed forward; R3 records and replays the routers' choices; the
engine's incremental decode through per-sequence `InklingState`s, inkling_state.py).

Invariants:
- Parameter names are transformers' in-memory ones: `embed_tokens.weight`, `embed_tokens.embed_norm.weight`,
  `layers.{i}.{input_layernorm,self_attn,attn_sconv,post_attention_layernorm,mlp,mlp_sconv}.*`, `norm.weight`;
  dense `mlp.{gate,up,down}_proj.weight` and `mlp.global_scale` [1]; MoE `mlp.gate.weight` [E + S, H],
  `mlp.gate.global_scale` [1], `mlp.gate.e_score_correction_bias` [E] (frozen: aux-loss-free balancing),
  `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) / `down_proj` [E, H, I], `mlp.shared_experts.{gate,up}_proj`
  [S, I, H] / `down_proj` [S, H, I] (no `.weight`).
- Layer: x += attn_sconv(attn(norm(x))); x += mlp_sconv(mlp(norm(x))).
- Router (float32): logits = x W^T over E routed + S shared experts; the top-k routed experts are chosen by
  sigmoid(logit) + e_score_correction_bias (torch.topk, unsorted, as transformers); the weights of the k chosen and
  the S shared experts are logsigmoid(logit) normalised together (a softmax over them: the shared experts are a
  sink), times route_scale * global_scale. Replay (moe.merge_replay) re-evaluates the weights at the recorded ids.
- `norm` divides by logits_mup_width_multiplier after the RMSNorm: CausalLM's head then computes transformers'
  logits (before `inkling.trim_logits`).
- `run(..., states=None)` is the trainer's forward, unchanged. With states, sequence i's rows are the tokens at
  positions states[i].length + 0, 1, ...: they read and extend the caches, and their logits and routed ids equal
  the one-shot forward's rows for those positions, whatever the split of a sequence into calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .inkling_attention import InklingAttention, Segments, ShortConvolution
from .inkling_state import InklingState, LayerState
from .layers import ACTIVATIONS, RMSNorm, SwiGLUMLP
from .moe import Experts, merge_replay


class NormedEmbedding(nn.Embedding):
    """The token embedding, RMS-normed (`embed_norm`, eps rms_norm_eps)."""

    def __init__(self, vocab: int, hidden: int, padding_idx: int | None, eps: float) -> None:
        super().__init__(vocab, hidden, padding_idx=padding_idx)
        self.embed_norm = RMSNorm(hidden, eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(input_ids))


class MupScaledNorm(RMSNorm):
    """The final RMSNorm, divided by the muP width multiplier (transformers divides the normed hidden state by it
    before the head: the same ops in the same order)."""

    def __init__(self, dim: int, eps: float, multiplier: float) -> None:
        super().__init__(dim, eps)
        self.multiplier = multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.multiplier


class ScaledMLP(SwiGLUMLP):
    """A dense layer's SwiGLU, times a learned scalar `global_scale`."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__(hidden, intermediate, act)
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.global_scale


class SinkRouter(nn.Module):
    """HF `mlp.gate` (module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.num_shared = config.num_experts, config.n_shared_experts
        self.top_k, self.route_scale = config.num_experts_per_tok, config.spec.route_scale
        self.weight = nn.Parameter(torch.empty(self.num_experts + self.num_shared, config.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H], replay [N, k] or None -> (routed weights [N, k], shared weights [N, S], ids [N, k] int64);
        weights in x's dtype."""
        logits = F.linear(x.float(), self.weight.float())
        routed, shared = logits[:, : self.num_experts], logits[:, self.num_experts :]
        choice = routed.sigmoid() + self.e_score_correction_bias.float()
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        if replay is not None:
            ids, self.replay_stats = merge_replay(replay, ids, self.num_experts, compare)
        log_p = F.logsigmoid(torch.cat([routed.gather(-1, ids), shared], dim=-1))
        weights = torch.exp(log_p - torch.logsumexp(log_p, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.global_scale.float()).to(x.dtype)
        return weights[:, : self.top_k], weights[:, self.top_k :], ids


class SharedExperts(nn.Module):
    """HF `mlp.shared_experts`: S SwiGLU experts held stacked, every token through each, weighted by the router's
    shared weights, summed in float32."""

    def __init__(self, hidden: int, intermediate: int, num_shared: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_shared, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_shared, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_shared, hidden, intermediate))
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, S] -> [N, H]."""
        xs = x.unsqueeze(0).expand(self.gate_proj.shape[0], -1, -1)  # [S, N, H]
        gate = torch.bmm(xs, self.gate_proj.transpose(1, 2))
        up = torch.bmm(xs, self.up_proj.transpose(1, 2))
        h = self.act(gate) * up * weights.t().unsqueeze(-1)
        return torch.bmm(h, self.down_proj.transpose(1, 2)).float().sum(dim=0).to(x.dtype)


class SinkMoeBlock(nn.Module):
    """HF `mlp` of a sparse layer: `gate` (SinkRouter), `experts` (moe.Experts), `shared_experts`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, inter, act = config.hidden_size, config.moe_intermediate_size, config.hidden_act
        self.gate = SinkRouter(config)
        self.experts = Experts(h, inter, config.num_experts, act)
        self.shared_experts = SharedExperts(h, inter, config.n_shared_experts, act)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H], replay [B*T, k] or None -> (out [B, T, H], routed ids [B*T, k])."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        weights, shared, ids = self.gate(flat, replay, compare)
        out = self.experts(flat, ids, weights) + self.shared_experts(flat, shared)
        return out.view(b, t, h), ids


class InklingDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        s, h = config.spec, config.hidden_size
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        self.sliding = s.layer_types[layer_idx] == "hybrid_sliding"
        self.self_attn = InklingAttention(config, layer_idx)
        self.mlp: nn.Module = (
            SinkMoeBlock(config) if self.is_moe else ScaledMLP(h, config.intermediate_size, config.hidden_act)
        )
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.attn_sconv = ShortConvolution(h, s.conv_kernel_size)
        self.mlp_sconv = ShortConvolution(h, s.conv_kernel_size)

    def forward(
        self,
        x: torch.Tensor,
        seg: Segments,
        replay: torch.Tensor | None,
        compare: bool,
        caches: list[LayerState] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [B, T, H], routed ids [B*T, k] of a MoE layer or None). `caches`: this layer's state of each
        sequence of seg.bounds (decode; the residual convolutions continue from their cached inputs)."""
        a = self.self_attn(self.input_layernorm(x), seg, caches)
        x = x + (self.attn_sconv(a, seg) if caches is None else self.attn_sconv.resume(a, seg.bounds, caches, "attn"))
        h = self.post_attention_layernorm(x)
        ids = None
        if self.is_moe:
            out, ids = self.mlp(h, replay, compare)
        else:
            out = self.mlp(h)
        if caches is None:
            return x + self.mlp_sconv(out, seg), ids
        return x + self.mlp_sconv.resume(out, seg.bounds, caches, "mlp"), ids


class InklingBackbone(nn.Module):
    """`model.*` of CausalLM for inkling_text: `embed_tokens` (normed), `layers`, `norm` (muP-scaled), `run`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        pad = config.pad_token_id
        padding_idx = pad if pad is not None and 0 <= pad < config.vocab_size else None
        self.embed_tokens = NormedEmbedding(config.vocab_size, config.hidden_size, padding_idx, config.rms_norm_eps)
        self.layers = nn.ModuleList([InklingDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = MupScaledNorm(config.hidden_size, config.rms_norm_eps, config.spec.logits_mup_width_multiplier)

    def new_state(self) -> InklingState:
        """An empty cache for one sequence (nothing seen yet), for `run(..., states=...)`."""
        return InklingState.empty(len(self.layers))

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        backend: object,
        routing_replay: torch.Tensor | None,
        routing_compare: bool,
        states: list[InklingState] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(hidden [B, T, H] before `norm`, routed ids [B*T, k] per MoE layer). `backend` is not used: the relative
        logits are an additive bias per (query, key), which the engine's paged kernels do not take.

        states: one per packed sequence of cu_seqlens (B == 1; one sequence when cu_seqlens is None); sequence i's
        rows continue the states[i].length tokens it has seen, at those absolute positions (position_ids is not
        read: the states know them), and each state is extended in place."""
        del backend
        b, t = input_ids.shape
        caches: list[InklingState] | None = None
        if states is None:
            seg = Segments.build(t, cu_seqlens, position_ids)
        else:
            seg, caches = _resume_segments(t, b, cu_seqlens, states, input_ids.device)
        x = self.embed_tokens(input_ids)
        routed: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            replay = None
            if routing_replay is not None and layer.is_moe:
                replay = routing_replay[:, :, len(routed)].reshape(b * t, -1)
            per_seq = None if caches is None else [c.layers[i] for c in caches]
            x, ids = layer(x, seg, replay, routing_compare, per_seq)
            if ids is not None:
                routed.append(ids)
        if caches is not None:  # after every layer read the old lengths (the positions)
            for state, (s, e) in zip(caches, seg.bounds, strict=True):
                state.length += e - s
        return x, routed


def _resume_segments(
    t: int, b: int, cu_seqlens: torch.Tensor | None, states: list[InklingState], device: torch.device
) -> tuple[Segments, list[InklingState]]:
    """The Segments of a decode call (positions: each state's length onwards) and the states of its non-empty
    sequences, in seg.bounds' order (a sequence with no new rows is left as it is)."""
    cu = [0, t] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    if b != 1 or len(states) != len(cu) - 1:
        raise ValueError(f"states: {len(states)} for {len(cu) - 1} sequences of a batch of {b} (B must be 1)")
    live = [(s, e, state) for s, e, state in zip(cu, cu[1:], states) if e > s]
    positions = torch.cat(
        [torch.arange(st.length, st.length + e - s, device=device) for s, e, st in live]
        or [torch.zeros(0, dtype=torch.long, device=device)]
    )[None]
    seg = Segments.build(t, torch.tensor(cu), positions)
    return seg, [state for _, _, state in live]
