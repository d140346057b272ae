"""MoE blocks with routing replay (R3): Qwen3-MoE's softmax top-k router, DeepSeek-V3's sigmoid group-limited
router with shared experts, and the grouped expert SwiGLUs both use.

Stage: shared model code (the engine records routes, the trainer replays them).

Invariants:
- Router: probs = softmax(x @ W_gate^T) in float32; the top-k ids are the k largest probs (torch.topk order,
  largest first); gate weights are the probs at those ids, divided by their sum when `norm_topk_prob`, then cast
  to the activation dtype. This is transformers' Qwen3MoeTopKRouter.
- DeepSeek-V3 router (`GroupLimitedRouter`, transformers' DeepseekV3TopkRouter): scores = sigmoid(x @ W^T) in
  float32; choice scores = scores + `e_score_correction_bias` (a frozen parameter: aux-loss-free balancing, not
  trained by RL); experts are picked only from the `topk_group` of `n_group` groups with the largest top-2 choice
  sums; gate weights are the *scores* (no bias) at the picked ids, normalised (+1e-20) when `norm_topk_prob`, times
  `routed_scaling_factor`. Its block adds `shared_experts`, a dense SwiGLU every token goes through.
- Replay: given recorded ids, the same formula is evaluated at those ids from the *current* probs, so the gate
  weights stay differentiable w.r.t. the router; replaying the model's own ids reproduces its output exactly.
  A row of -1 means "no record" (e.g. a sample's last token, which the engine never ran through the model): that
  token uses the live router's choice. With `compare=True` every token uses the live choice and the records are
  only compared with it. Either way the router leaves `replay_stats` = int64 [3] (tokens with a record, of those
  the ones whose live top-k set equals the record, all tokens) on the device, for the R3 metrics.
- Experts are held fused, as transformers 5 holds them in memory: `experts.gate_up_proj` [E, 2I, H] (gate rows
  first, then up rows) and `experts.down_proj` [E, H, I]. hf_io.py maps them to the Hub's per-expert tensors.
- Expert compute groups the (token, slot) pairs by expert with one argsort and runs one GEMM pair per expert
  that received tokens (a Python loop over experts, never over tokens); results are put back in (token, slot) order
  and summed over the k slots: deterministic (no atomics), as transformers 5.24's default `grouped_mm` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import ACTIVATIONS, SwiGLUMLP


class TopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], replay [N, k] or None -> (weights [N, k] in x.dtype, ids [N, k] int64)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if replay is not None:
            ids, self.replay_stats = merge_replay(replay, ids, self.num_experts, compare)
            top = probs.gather(-1, ids)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids


def merge_replay(
    replay: torch.Tensor, live: torch.Tensor, num_experts: int, compare: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids to use [N, k], replay_stats int64 [3]) from recorded ids (rows of -1: no record) and the live top-k."""
    rec = replay.to(device=live.device, dtype=torch.long)
    if rec.shape != live.shape:
        raise ValueError(f"routing replay must be {list(live.shape)}, got {list(rec.shape)}")
    have = rec[:, 0] >= 0
    if rec.numel():
        bad_id = int(rec.max()) >= num_experts or int(rec.min()) < -1
        if bad_id or bool(((rec < 0) != ~have[:, None]).any()):
            raise ValueError(f"routing replay has expert ids outside [0, {num_experts}) (a row of -1 = no record)")
    agree = have & (rec.sort(dim=-1).values == live.sort(dim=-1).values).all(dim=-1)
    stats = torch.stack([have.sum(), agree.sum(), torch.tensor(rec.shape[0], device=rec.device)])
    return (live if compare else torch.where(have[:, None], rec, live)), stats


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's router (module docstring); HF names `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], replay [N, k] or None -> (weights [N, k] in x.dtype, ids [N, k] int64)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), -math.inf)
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        if replay is not None:
            ids, self.replay_stats = merge_replay(replay, ids, self.num_experts, compare)
        top = scores.gather(1, ids)
        if self.norm_topk_prob:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return (top * self.scaling).to(x.dtype), ids


class Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATIONS[act]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s SwiGLU on its tokens x [n, H]."""
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], ids/weights [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x)  [N, H]."""
        return grouped_mix(x, ids, weights, self.num_experts, self.expert)


def grouped_mix(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    slot_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts' output [N, H]: (token, slot) pairs grouped by expert, `expert(e, rows)` once per expert
    that got tokens, results weighted and put back in (token, slot) order, then `slot_sum` ([N, k, H] -> [N, H];
    default one sum over k) in x's dtype."""
    n_tok, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    w_sorted = weights.reshape(-1)[order]
    x_sorted = x[order // k]
    if flat.device.type == "meta":  # the planner's dry run (planner/measure.py): an even spread, same total rows
        counts = [len(range(e, flat.numel(), num_experts)) for e in range(num_experts)]
    else:
        counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync
    outs: list[torch.Tensor] = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        outs.append(expert(e, x_sorted[start : start + n]) * w_sorted[start : start + n, None])
        start += n
    y_sorted = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
    # Combine without atomics (index_add_ is nondeterministic on GPU): put the results back in (token, slot)
    # order and reduce over the k slots with one sum (float32 accumulation for bf16). This is transformers
    # 5.24's default "grouped_mm" experts path, so the result is bitwise transformers' on CPU.
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y = y_sorted[inv].view(n_tok, k, -1)
    return (y.sum(dim=1) if slot_sum is None else slot_sum(y)).to(x.dtype)


class SparseMoeBlock(nn.Module):
    """`mlp` of a MoE layer: HF names `mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob
        )
        self.experts = Experts(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.hidden_act)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H], replay [B*T, k] or None -> (out [B, T, H], routed ids [B*T, k])."""
        return route_and_mix(self.gate, self.experts, x, replay, compare)


class SharedExpertMoeBlock(nn.Module):
    """`mlp` of a Qwen3-Next MoE layer: the Qwen3-MoE router and experts plus one shared expert whose output is
    scaled by sigmoid(`shared_expert_gate`(x)); HF names add `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob
        )
        self.experts = Experts(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.hidden_act)
        self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        routed, ids = route_and_mix(self.gate, self.experts, x, replay, compare)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x), ids


def route_and_mix(
    gate: nn.Module, experts: Experts, x: torch.Tensor, replay: torch.Tensor | None, compare: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, H] through `gate` (replaying `replay` [B*T, k] when given) and the routed `experts`."""
    b, t, h = x.shape
    flat = x.reshape(-1, h)
    weights, ids = gate(flat, replay, compare)
    return experts(flat, ids, weights).view(b, t, h), ids


class DeepseekMoeBlock(nn.Module):
    """`mlp` of a DeepSeek-V3 MoE layer: `mlp.gate.*`, `mlp.experts.*` (fused, as Qwen3-MoE), `mlp.shared_experts.*`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = GroupLimitedRouter(config)
        self.experts = Experts(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.hidden_act)
        self.shared_experts = (
            SwiGLUMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.hidden_act)
            if config.n_shared_experts
            else None
        )

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, compare: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H], replay [B*T, k] or None -> (out [B, T, H], routed ids [B*T, k])."""
        out, ids = route_and_mix(self.gate, self.experts, x, replay, compare)
        return (out if self.shared_experts is None else out + self.shared_experts(x)), ids
