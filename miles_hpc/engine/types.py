"""Request/result records between the engine core (scheduler, runner) and the HTTP server.

Stage: engine. The HTTP layer turns SGLang-shaped JSON (docs/design.md section 4) into a :class:`GenerateRequest` and a
:class:`GenerateResult` back into SGLang's response shape; the core never sees JSON. Field names follow SGLang's
so the mapping stays one-to-one.

Invariants:
- ``output_ids`` holds every generated id exactly as sampled, including a matched stop token (SGLang returns it
  too); ``output_logprobs[i]`` is the log-prob of ``output_ids[i]`` under the temperature-1 log-softmax of the
  model's logits (what SGLang reports), whatever temperature/top-p/top-k the sampler used.
- ``weight_versions`` spans cover ``[0, len(output_ids))`` without gaps: span ``{"version", "start", "end"}``
  says output tokens ``start..end-1`` were sampled with that weight version.
- ``routed_experts`` (when asked) is int32 ``[rows, num_moe_layers, top_k]`` for absolute positions
  ``[routed_experts_start_len, prompt_len + len(output_ids) - 1)``: every processed token's experts; the last
  sampled token was never fed through the model, hence the ``-1``.
- ``indexer_topk`` (when asked; DSA models on an engine that records them) is int32 ``[rows, num_indexer_layers,
  index_topk]`` for positions ``[indexer_topk_start_len, prompt_len + len(output_ids) - 1)``, the same rows:
  row p holds the key positions (within the sequence, <= p) the query at position p selected in each layer with
  its own indexer, -1 where it had fewer than index_topk keys. Our extension (docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishType = Literal["stop", "length", "abort"]
GREEDY_BELOW = 1e-6  # a temperature under this is greedy (SGLang's sampling params: _SAMPLING_EPS)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None  # same seed + same prompt -> same tokens, whatever the batch around it

    def __post_init__(self) -> None:
        # SGLang samples greedily below this temperature; dividing by it would overflow float32 logits to inf.
        if 0.0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateRequest:
    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only; k >= 0: also prompt tokens from position k
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False  # our extension (module docstring)
    indexer_topk_start_len: int = 0
    lora_path: str | None = None  # the name of a loaded LoRA adapter (SGLang's field), None: the base model
    log_metrics: bool = True  # False: counted in no request counter (SGLang's field; its /health_generate probe)


@dataclass(kw_only=True, slots=True)
class FinishReason:
    type: FinishType
    matched: int | None = None  # the stop token id that ended generation
    length: int | None = None  # "length": the max_new_tokens reached
    message: str | None = None  # why an abort happened
    status_code: int | None = None  # an abort's HTTP status, as SGLang's FINISH_ABORT (ours: always None)
    err_type: str | None = None

    def to_json(self) -> dict[str, object]:
        """SGLang's shapes (schedule_batch.py FINISH_MATCHED_TOKEN, FINISH_LENGTH, FINISH_ABORT.to_json)."""
        if self.type == "abort":
            return {
                "type": "abort",
                "message": self.message or "Aborted",
                "status_code": self.status_code,
                "err_type": self.err_type,
            }
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "stop", "matched": self.matched}


@dataclass(kw_only=True, slots=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int  # prompt tokens its first admission found in the prefix cache (SGLang's; not re-prefills)
    output_logprobs: list[float] = field(default_factory=list)
    # prompt tokens logprob_start_len.. ; entry 0 is None, as SGLang's (its log-prob would need the row before)
    input_logprobs: list[float | None] | None = None
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None
    weight_versions: list[dict[str, object]] = field(default_factory=list)
    weight_version: str = "0"
    num_retractions: int = 0
    e2e_latency: float = 0.0
    error: str | None = None  # the step running it failed: the server answers 500 with this, not an abort

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
