"""The training batch: what the controller hands every trainer rank for one step (stage: train).

The trainer never sees `Sample` objects or HTTP: the loop flattens samples into this record. Invariants:
- ``tokens[i]`` = prompt + response ids of sample i, exactly the ids the engine generated (``token_hash[i]`` is the
  rollout side's hash of them; the trainer re-checks it: TITO).
- ``loss_mask[i]``, ``rollout_logprobs[i]``, ``advantages[i]`` have ``len(tokens[i])`` entries; positions with mask 0
  (prompt, tool output) carry no loss. ``rollout_logprobs[i][t]`` is the engine's log-prob of ``tokens[i][t]``.
- ``advantages`` are per token (sequence-level estimators broadcast over the response).
- ``routed_experts[i]`` (R3, MoE models): int [R_i, moe_layers, top_k], the experts the engine routed tokens
  0..R_i-1 of sample i to (R_i <= len(tokens[i]) - 1: the last token is never run through the model); None for a
  sample without a record. Tokens past R_i use the live router.
- ``indexer_topk[i]`` (DSA indexer replay): int [R_i, indexer_layers, index_topk], the key positions (within the
  sample, -1 padding) each of tokens 0..R_i-1 attended to in each layer with an indexer (``Sample.indexer_topk``);
  tokens past R_i, and rows of only -1, use the live indexer.
- ``supervised``: teacher-forced tokens no engine sampled (the warm-up, loop/warmup.py): ``rollout_logprobs`` are
  placeholders, so the trainer applies no off-policy correction (TIS, MIS) and no KL penalty to such a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    tokens: list[list[int]]
    loss_mask: list[list[int]]
    rollout_logprobs: list[list[float]]
    advantages: list[list[float]]
    token_hash: list[str] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    ref_logprobs: list[list[float]] | None = None  # reference-model log-probs, when a KL penalty is on
    routed_experts: list[np.ndarray | None] | None = None  # R3 records per sample (module docstring)
    indexer_topk: list[np.ndarray | None] | None = None  # DSA indexer records per sample (module docstring)
    supervised: bool = False  # teacher-forced, not sampled: no TIS/MIS, no KL (module docstring)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "rollout_logprobs", "advantages"):
            rows = getattr(self, name)
            if len(rows) != n:
                raise ValueError(f"TrainBatch.{name}: {len(rows)} rows for {n} samples")
            for i, (row, toks) in enumerate(zip(rows, self.tokens)):
                if len(row) != len(toks):
                    raise ValueError(f"TrainBatch.{name}[{i}]: {len(row)} entries for {len(toks)} tokens")

        for name, dims in (("routed_experts", "moe_layers, top_k"), ("indexer_topk", "indexer_layers, index_topk")):
            records = getattr(self, name)
            if records is None:
                continue
            if len(records) != n:
                raise ValueError(f"TrainBatch.{name}: {len(records)} rows for {n} samples")
            for i, (r, toks) in enumerate(zip(records, self.tokens)):
                if r is not None and (r.ndim != 3 or r.shape[0] > len(toks)):
                    raise ValueError(
                        f"TrainBatch.{name}[{i}]: shape {r.shape} for {len(toks)} tokens (expected [<= tokens, {dims}])"
                    )

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)
