"""DeepSeek-V4 blocks around the attention: manifold-constrained hyper-connections (mHC), the hash-routed and
top-k routed MoE with clipped SwiGLU experts, the decoder layer and the backbone `model.*` that CausalLM runs;
as transformers 5.24's modeling_deepseek_v4.py computes them.

Stage: shared model code (the trainer's forward; the engine's cached decode through `DSV4Backbone.new_state`
and `run(..., states=...)`, whose per-layer caches live in dsv4_state.py).

Invariants:
- The residual stream is `hc_mult` parallel copies [B, T, n, hidden]. Before a block, `HyperConnection` computes
  from the RMS-normalised (unweighted) flattened streams, in float32: pre = sigmoid(.) + hc_eps (collapses the n
  streams into the block's input), post = 2 sigmoid(.) (spreads the block's output over the streams), comb =
  softmax(.) + hc_eps then made doubly stochastic by hc_sinkhorn_iters Sinkhorn steps (columns first). New
  streams: post_k * out + sum_j comb[j, k] * stream_j. `HyperHead` collapses the streams once more at the end;
  `run` returns that, and CausalLM applies `model.norm` and the head, the order transformers uses.
- Routers score experts with sqrt(softplus(logit)) (or sigmoid), in float32. A "moe" layer picks the top-k of
  scores + e_score_correction_bias (a frozen parameter); a "hash_moe" layer takes its ids from the frozen
  token -> experts table `tid2eid[input_id]`. Either way the gate weights are the scores at the ids, divided by
  their sum (+1e-20), times routed_scaling_factor; routing replay (moe.py's `merge_replay`) applies to the top-k
  layers only (a hash layer's choice is a pure function of the token).
- Routed experts and the one shared expert are SwiGLUs whose gate is clipped from above and whose up projection
  is clipped to [-swiglu_limit, swiglu_limit] before the product.
- `tid2eid` is an int64 parameter (frozen) so that hf_io loads and saves it like any tensor; `IndexTable` keeps
  CausalLM's random init off it (int tensors have no normal_) and its own `reset_parameters` fills a valid table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .dsv4_attention import AttnDims, DSV4Attention, Rope, SequenceCache, rms
from .dsv4_state import DSV4State, LayerCache
from .layers import ACTIVATIONS, RMSNorm
from .moe import Experts, grouped_mix, merge_replay
from .rope import compute_inv_freq

if TYPE_CHECKING:
    from .config import ModelConfig

SCORE_FUNCS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
}


class HyperConnection(nn.Module):
    """`attn_hc` / `ffn_hc` of a layer: HF names `fn` [(2+n)n, n*hidden], `base` [(2+n)n], `scale` [3]."""

    custom_init = True

    def __init__(self, hidden: int, n: int, iters: int, eps: float, norm_eps: float, std: float) -> None:
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps, self.std = n, iters, eps, norm_eps, std
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fn, 0.0, self.std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [B, T, n, hidden] -> (post [B, T, n], comb [B, T, n, n], block input [B, T, hidden]), all but the
        block input in float32."""
        n = self.n
        mix = F.linear(rms(h.flatten(2).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax((comb_w * s_comb + comb_b).unflatten(-1, (n, n)), dim=-1) + self.eps
        # Sinkhorn-Knopp towards a doubly stochastic matrix: columns once, then (rows, columns) iters - 1 times.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre[..., None] * h).sum(dim=2).to(h.dtype)


def hc_merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: post_k * out + sum_j comb[j, k] * h_j (comb is read transposed; it is not symmetric)."""
    dt = h.dtype
    return post.to(dt)[..., None] * out[..., None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), h)


class HyperHead(nn.Module):
    """`model.hc_head`: the final collapse of the streams; HF names `hc_fn` [n, n*hidden], `hc_base`, `hc_scale`."""

    custom_init = True

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float, std: float) -> None:
        super().__init__()
        self.eps, self.norm_eps, self.std = eps, norm_eps, std
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.hc_fn, 0.0, self.std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mix = F.linear(rms(h.flatten(2).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * h).sum(dim=2).to(h.dtype)


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, act: Callable[..., torch.Tensor], limit: float) -> Any:
    return act(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClippedSwiGLU(nn.Module):
    """`mlp.shared_experts`: down(act(min(gate, L)) * clamp(up, -L, L)); HF names gate_proj, up_proj, down_proj."""

    def __init__(self, hidden: int, intermediate: int, act: str, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act, self.limit = ACTIVATIONS[act], limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clipped_swiglu(self.gate_proj(x), self.up_proj(x), self.act, self.limit))


class ClippedExperts(Experts):
    """Fused routed experts (moe.py's layout) with the clipped SwiGLU."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, act: str, limit: float) -> None:
        super().__init__(hidden, intermediate, num_experts, act)
        self.limit = limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(clipped_swiglu(gate, up, self.act, self.limit), self.down_proj[e])


class ScoredRouter(nn.Module):
    """A "moe" layer's top-k router: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, score: str, scaling: float) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.scaling = num_experts, top_k, scaling
        self.score = SCORE_FUNCS[score]
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], replay [N, k] or None -> (weights [N, k] in x.dtype, ids [N, k] int64)."""
        scores = self.score(F.linear(x.float(), self.weight.float()))
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False).indices
        if replay is not None:
            ids, self.replay_stats = merge_replay(replay, ids, self.num_experts, compare)
        return gate_weights(scores, ids, self.scaling, x.dtype), ids


def gate_weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    top = scores.gather(1, ids)
    return (top / (top.sum(dim=-1, keepdim=True) + 1e-20) * scaling).to(dtype)


class IndexTable(nn.Parameter):
    """An integer lookup table held as a frozen parameter: CausalLM's random init (normal_) leaves it alone."""

    def __new__(cls, data: torch.Tensor, requires_grad: bool = False) -> IndexTable:
        del requires_grad  # deepcopy passes the flag on; an index table never has a gradient
        return super().__new__(cls, data, requires_grad=False)

    def normal_(self, *args: Any, **kwargs: Any) -> IndexTable:
        return self


class HashRouter(nn.Module):
    """A "hash_moe" layer's router: `mlp.gate.weight` scores, `mlp.gate.tid2eid` [vocab, k] picks."""

    custom_init = True

    def __init__(self, hidden: int, num_experts: int, top_k: int, vocab: int, score: str, scaling: float) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.scaling = num_experts, top_k, scaling
        self.score = SCORE_FUNCS[score]
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.tid2eid = IndexTable(torch.zeros(vocab, top_k, dtype=torch.long))

    def _apply(self, fn: Any, recurse: bool = True) -> HashRouter:
        # Module._apply re-creates parameters as plain nn.Parameter on some moves (meta -> device): keep the kind.
        super()._apply(fn, recurse)
        table = self._parameters["tid2eid"]
        if table is not None and not isinstance(table, IndexTable):
            self._parameters["tid2eid"] = IndexTable(table.data)
        return self

    def reset_parameters(self) -> None:
        # transformers zero-fills it (checkpoints bring the real one); a random model gets k distinct experts a token.
        v, k = self.tid2eid.shape
        table = (torch.arange(v)[:, None] * k + torch.arange(k)[None, :]) % self.num_experts
        self.tid2eid.data.copy_(table)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], token_ids [N] -> (weights [N, k] in x.dtype, ids [N, k] int64)."""
        scores = self.score(F.linear(x.float(), self.weight.float()))
        ids = self.tid2eid[token_ids.reshape(-1)].long()
        return gate_weights(scores, ids, self.scaling, x.dtype), ids


class DSV4Moe(nn.Module):
    """`mlp` of a layer: `gate` (hash or top-k), `experts` (fused), `shared_experts`."""

    def __init__(self, config: ModelConfig, hashed: bool) -> None:
        super().__init__()
        s, h, e, k = config.spec, config.hidden_size, config.num_experts, config.num_experts_per_tok
        self.hashed = hashed
        self.gate: nn.Module = (
            HashRouter(h, e, k, config.vocab_size, s.scoring_func, config.routed_scaling_factor)
            if hashed
            else ScoredRouter(h, e, k, s.scoring_func, config.routed_scaling_factor)
        )
        inter = config.moe_intermediate_size
        self.experts = ClippedExperts(h, inter, e, config.hidden_act, s.swiglu_limit)
        self.shared_experts = ClippedSwiGLU(h, inter, config.hidden_act, s.swiglu_limit)

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor, replay: torch.Tensor | None, compare: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (out [B, T, H], routed ids [B*T, k])."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        if self.hashed:
            weights, ids = self.gate(flat, token_ids)
        else:
            weights, ids = self.gate(flat, replay, compare)
        routed = grouped_mix(flat, ids, weights, self.experts.num_experts, self.experts.expert).view(b, t, h)
        return routed + self.shared_experts(x), ids


def attn_dims(config: ModelConfig, layer_idx: int) -> AttnDims:
    s = config.spec
    kind = s.layer_types[layer_idx]
    return AttnDims(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        head_dim=config.head_dim,
        q_lora_rank=int(config.q_lora_rank or 0),
        o_groups=s.o_groups,
        o_lora_rank=s.o_lora_rank,
        window=s.sliding_window,
        eps=config.rms_norm_eps,
        kind=kind,
        rate=s.compress_rate(kind),
        index_heads=s.index_n_heads,
        index_head_dim=s.index_head_dim,
        index_topk=s.index_topk,
    )


class DSV4Layer(nn.Module):
    """`model.layers.{i}`: attn_hc, input_layernorm, self_attn, ffn_hc, post_attention_layernorm, mlp."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        s, h = config.spec, config.hidden_size
        self.layer_idx = layer_idx
        self.rope_kind = "main" if s.layer_types[layer_idx] == "sliding_attention" else "compress"
        self.is_moe = s.mlp_layer_types[layer_idx] == "moe"  # top-k routed (R3 records it); hash_moe is not
        self.self_attn = DSV4Attention(attn_dims(config, layer_idx))
        self.mlp = DSV4Moe(config, hashed=not self.is_moe)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, weight_in_fp32=True)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, weight_in_fp32=True)
        hc = (h, s.hc_mult, s.hc_sinkhorn_iters, s.hc_eps, config.rms_norm_eps, config.initializer_range)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self,
        h: torch.Tensor,
        token_ids: torch.Tensor,
        pos: torch.Tensor,
        ropes: dict[str, Rope],
        cu_seqlens: torch.Tensor | None,
        replay: torch.Tensor | None,
        compare: bool,
        caches: Sequence[SequenceCache] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T, n, H] -> (h, routed ids [B*T, k]); `caches`: this layer's, one per non-empty sequence."""
        post, comb, x = self.attn_hc(h)
        a = self.self_attn(self.input_layernorm(x), pos, ropes[self.rope_kind], cu_seqlens, caches)
        h = hc_merge(h, a, post, comb)
        post, comb, x = self.ffn_hc(h)
        m, ids = self.mlp(self.post_attention_layernorm(x), token_ids, replay, compare)
        return hc_merge(h, m, post, comb), ids


def make_ropes(config: ModelConfig) -> dict[str, Rope]:
    """The "main" RoPE (rope_theta, unscaled) and the "compress" one (compress_rope_theta and its scaling)."""
    s, dim = config.spec, config.rotary_dim
    out: dict[str, Rope] = {}
    for kind, theta, scaling in (
        ("main", config.rope_theta, None),
        ("compress", s.compress_rope_theta, s.compress_rope_scaling),
    ):
        # compute_inv_freq reads only these four fields of a config.
        view = SimpleNamespace(
            rotary_dim=dim,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        inv_freq, attention_scaling = compute_inv_freq(view)  # type: ignore[arg-type]
        out[kind] = Rope(inv_freq, float(attention_scaling))
    return out


class DSV4Backbone(nn.Module):
    """`model.*`: embed_tokens, layers, norm, hc_head; `run` is CausalLM's contract (transformer.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        s = config.spec
        pad = config.pad_token_id
        padding_idx = pad if pad is not None and 0 <= pad < config.vocab_size else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=padding_idx)
        self.layers = nn.ModuleList([DSV4Layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_in_fp32=True)
        std = config.initializer_range
        self.hc_head = HyperHead(config.hidden_size, s.hc_mult, s.hc_eps, config.rms_norm_eps, std)
        self.hc_mult = s.hc_mult
        self.ropes = make_ropes(config)  # plain tensors: no dtype cast, not in the state dict

    def new_state(self) -> DSV4State:
        """An empty cache for one sequence (dsv4_state.py); `run(..., states=...)` fills it."""
        return DSV4State(layers=[LayerCache() for _ in self.layers])

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        backend: Any,
        routing_replay: torch.Tensor | None,
        routing_compare: bool,
        states: list[DSV4State] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states [B, T, H] after the final stream collapse (before `norm`), and the routed ids
        [B*T, k] of each top-k MoE layer. `backend` is unused (module docstring of dsv4_attention.py).

        states: one per packed sequence of cu_seqlens (B == 1; None: the row is one sequence); sequence i's tokens
        follow the states[i].length tokens it has seen, at positions length + offset (position_ids is ignored),
        and each state is extended in place. None: every sequence from its first token (the trainer's path)."""
        b, t = input_ids.shape
        pos = position_ids.expand(b, t)
        caches: list[list[LayerCache]] | None = None
        if states is not None:
            pos, caches = self._continue(states, b, t, cu_seqlens, input_ids.device)
        x = self.embed_tokens(input_ids)
        h = x.unsqueeze(2).expand(b, t, self.hc_mult, x.shape[-1])
        ropes = {kind: rope.on(input_ids.device) for kind, rope in self.ropes.items()}
        routed: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            replay = None
            if routing_replay is not None and layer.is_moe:
                replay = routing_replay[:, :, len(routed)].reshape(b * t, -1)
            layer_caches = None if caches is None else [c[i] for c in caches]
            h, ids = layer(h, input_ids, pos, ropes, cu_seqlens, replay, routing_compare, layer_caches)
            if layer.is_moe:
                routed.append(ids)
        if states is not None and cu_seqlens is not None:
            for state, n in zip(states, cu_seqlens.diff().tolist(), strict=True):
                state.length += int(n)
        elif states is not None:
            states[0].length += t
        return self.hc_head(h), routed

    def _continue(
        self, states: list[DSV4State], b: int, t: int, cu_seqlens: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, list[list[LayerCache]]]:
        """Positions [1, T] (each sequence from its state's length) and the layer caches of the non-empty
        sequences, in the order the attention meets them (sequence_spans)."""
        cu = [0, t] if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()]
        if b != 1 or len(cu) != len(states) + 1:
            raise ValueError(f"states: {len(states)} states for B={b} and {len(cu) - 1} packed sequences (B must be 1)")
        pos: list[int] = []
        caches: list[list[LayerCache]] = []
        for state, s, e in zip(states, cu[:-1], cu[1:], strict=True):
            if any(c.length != state.length for c in state.layers):
                raise ValueError("states: a state's layers disagree on its length (a call failed part way?)")
            pos.extend(range(state.length, state.length + e - s))
            if e > s:
                caches.append(state.layers)
        return torch.tensor(pos, dtype=torch.long, device=device)[None], caches
