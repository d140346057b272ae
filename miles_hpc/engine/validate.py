"""Request validation: every check `Engine.submit` makes before queueing, each error naming the field.

Stage: engine. Pure functions over a `GenerateRequest` and the engine's limits, so the rules are testable alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .types import GenerateRequest

if TYPE_CHECKING:
    from miles_hpc.models import ModelConfig

    from .config import EngineConfig


class RequestError(ValueError):
    """An invalid request or weight update; the message names the field (or tensor) and why. HTTP 400."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    vocab_size: int
    max_context_len: int
    kv_capacity_tokens: int
    num_moe_layers: int
    model_type: str = ""
    dsa: bool = False  # the model has DSA indexer layers
    records_indexer_topk: bool = False  # EngineConfig.record_indexer_topk


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_request(req: GenerateRequest, lim: Limits) -> None:
    """Raise RequestError for the first problem found; return None for a request the engine can serve."""
    if not isinstance(req.rid, str) or not req.rid:
        raise RequestError(f"rid must be a non-empty string, got {req.rid!r}")
    ids = req.input_ids
    if not ids:
        raise RequestError("input_ids must not be empty")
    if not all(_is_int(t) for t in ids):
        i = next(i for i, t in enumerate(ids) if not _is_int(t))
        raise RequestError(f"input_ids[{i}] must be an int, got {ids[i]!r}")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= lim.vocab_size:
        i = next(i for i, t in enumerate(ids) if not 0 <= t < lim.vocab_size)
        raise RequestError(f"input_ids[{i}]={ids[i]} is outside the vocabulary [0, {lim.vocab_size})")
    sp = req.sampling
    for name in ("max_new_tokens", "min_new_tokens", "top_k"):
        if not _is_int(getattr(sp, name)):
            raise RequestError(f"sampling_params.{name} must be an int, got {getattr(sp, name)!r}")
    if sp.max_new_tokens < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    if sp.min_new_tokens < 0:
        raise RequestError(f"sampling_params.min_new_tokens must be >= 0, got {sp.min_new_tokens}")
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        raise RequestError(f"sampling_params.temperature must be a finite number >= 0, got {sp.temperature}")
    if not 0.0 < sp.top_p <= 1.0:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k != -1 and sp.top_k < 1:
        raise RequestError(f"sampling_params.top_k must be -1 (off) or >= 1, got {sp.top_k}")
    if not 0.0 <= sp.min_p <= 1.0:
        raise RequestError(f"sampling_params.min_p must be in [0, 1], got {sp.min_p}")
    bad_stop = [t for t in sp.stop_token_ids if not _is_int(t) or not 0 <= t < lim.vocab_size]
    if bad_stop:
        raise RequestError(f"sampling_params.stop_token_ids has {bad_stop[0]!r}, outside [0, {lim.vocab_size})")
    if sp.sampling_seed is not None and not _is_int(sp.sampling_seed):
        raise RequestError(f"sampling_params.sampling_seed must be an int or null, got {sp.sampling_seed!r}")
    total = len(ids) + sp.max_new_tokens
    if total > lim.max_context_len:
        raise RequestError(
            f"input_ids ({len(ids)} tokens) + sampling_params.max_new_tokens ({sp.max_new_tokens}) = {total} "
            f"exceeds the context length {lim.max_context_len}"
        )
    if total > lim.kv_capacity_tokens:
        raise RequestError(
            f"input_ids ({len(ids)} tokens) + sampling_params.max_new_tokens ({sp.max_new_tokens}) = {total} "
            f"can never fit the KV cache ({lim.kv_capacity_tokens} tokens)"
        )
    if req.return_logprob and not (req.logprob_start_len == -1 or 0 <= req.logprob_start_len <= len(ids)):
        raise RequestError(  # SGLang refuses only a start past the prompt; at its end: no prompt log-probs
            f"logprob_start_len must be -1 or in [0, {len(ids)}] (the prompt length), got {req.logprob_start_len}"
        )
    if req.return_routed_experts:
        if lim.num_moe_layers == 0:
            raise RequestError("return_routed_experts: this model has no MoE layers")
        if not 0 <= req.routed_experts_start_len <= len(ids):
            raise RequestError(
                f"routed_experts_start_len must be in [0, {len(ids)}] (the prompt length), "
                f"got {req.routed_experts_start_len}"
            )
    if req.return_indexer_topk:
        if not lim.dsa:
            raise RequestError(
                f"return_indexer_topk: this model ({lim.model_type or 'unknown'}) has no DSA indexer layers"
            )
        if not lim.records_indexer_topk:
            raise RequestError(
                "return_indexer_topk: this engine does not record indexer selections; start it with "
                "--enable-return-indexer-topk (EngineConfig.record_indexer_topk)"
            )
        if not 0 <= req.indexer_topk_start_len <= len(ids):
            raise RequestError(
                f"indexer_topk_start_len must be in [0, {len(ids)}] (the prompt length), "
                f"got {req.indexer_topk_start_len}"
            )


def check_supported(mc: ModelConfig, config: EngineConfig) -> None:
    """Refuse (ValueError) what this engine does not serve, before anything is allocated."""
    if mc.is_hybrid and (config.tp_size > 1 or config.batch_invariant):
        raise ValueError(
            f"{mc.model_type}: a hybrid model is served at tp_size 1 without batch_invariant for now (its "
            "linear-attention layers have no tensor-parallel layout or batch-invariant scan yet: issue 29)"
        )
    if mc.spec is not None and (config.tp_size > 1 or config.batch_invariant):
        raise ValueError(
            f"{mc.model_type}: served at tp_size 1 without batch_invariant for now (the engine keeps no attention "
            "state for this family yet and recomputes each sequence every step: no tensor-parallel layout or "
            "batch-invariant kernels; docs/models.md)"
        )
    if config.batch_invariant and mc.is_dsa:
        raise ValueError(
            f"batch_invariant (zero-KL mode) is not available for {mc.model_type} (DeepSeek sparse attention): the "
            "indexer's scores and top-k choice are not batch-invariant on either side, so engine and trainer "
            "log-probs could not be bit-identical; serve it without --batch-invariant"
        )
    if config.tp_size > 1:
        from .tp_layout import check_tp

        check_tp(mc, config.tp_size)
        if config.batch_invariant:
            raise ValueError("batch_invariant (zero-KL mode) runs on engines of tp_size 1")
    if config.record_indexer_topk and not mc.is_dsa:
        raise ValueError(
            f"record_indexer_topk (--enable-return-indexer-topk) is for DeepSeek sparse attention models "
            f"(deepseek_v32, glm_moe_dsa); {mc.model_type} has no indexer to record"
        )
