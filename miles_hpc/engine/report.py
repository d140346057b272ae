"""What the engine reports: each finished request's `GenerateResult`, and the gauges/counters behind /metrics.

Stage: engine. Pure functions over an engine, its scheduler state and the cache's slot-indexed stores (MoE routing ids, DSA
indexer selections); `Engine` calls them with its step lock held (a result is built before the request's blocks
are released).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .kv_cache import BlockManager, KVCache
from .latent_cache import LatentCache
from .scheduler import Req, Scheduler
from .types import GenerateResult

if TYPE_CHECKING:
    from .core import Engine

THROUGHPUT_WINDOW_S = 10.0


def build_result(r: Req, cache: KVCache | LatentCache, block_size: int, version: str) -> GenerateResult:
    """The result of a request leaving the engine (its blocks still held, `r.finish` set)."""
    assert r.finish is not None
    req = r.req
    end = r.prompt_len + r.num_output - 1  # the last sampled token was never run through the model
    routed = indexer = None
    if req.return_routed_experts:
        assert cache.routing is not None
        routed = slot_rows(cache.routing, r, block_size, req.routed_experts_start_len, end)
    if req.return_indexer_topk:
        assert isinstance(cache, LatentCache) and cache.indexer_topk is not None  # validate_request checked
        indexer = slot_rows(cache.indexer_topk, r, block_size, req.indexer_topk_start_len, end)
    return GenerateResult(
        rid=req.rid,
        output_ids=r.tokens[r.prompt_len :],
        finish_reason=r.finish,
        prompt_tokens=r.prompt_len,
        cached_tokens=r.cached_tokens,
        output_logprobs=list(r.output_logprobs),
        input_logprobs=None if r.input_logprobs is None else r.input_logprobs[req.logprob_start_len :],
        routed_experts=routed,
        indexer_topk=indexer,
        weight_versions=[dict(s) for s in r.spans],
        weight_version=version,
        num_retractions=r.num_retractions,
        e2e_latency=time.monotonic() - r.t_submit,
    )


def slot_rows(store: torch.Tensor, r: Req, block_size: int, start: int, end: int) -> np.ndarray:
    """int32 [rows, *store.shape[1:]] for positions [start, end), read from a slot-indexed store (the routing ids
    [slots, moe_layers, top_k], the indexer selections [slots, indexer_layers, index_topk]) through the request's
    block table. Rows of a prefix-cache hit come from the request that computed the block. An aborted request
    returns only the rows it has computed (none if it was waiting)."""
    end = min(end, r.num_computed)
    if end <= start or not r.blocks:
        return np.zeros((0, *store.shape[1:]), dtype=np.int32)
    pos = torch.arange(start, end)
    table = torch.tensor(r.blocks, dtype=torch.int64)
    slots = (table[pos // block_size] * block_size + pos % block_size).to(store.device)
    return store[slots].cpu().numpy().astype(np.int32, copy=False)


@dataclass(slots=True)
class Counters:
    """Engine-lifetime counters and the recent-throughput window."""

    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # steps completed (any output): /health_generate's sign of progress
    recent: deque[tuple[float, int]] = field(default_factory=deque)

    def record_request(self, prompt_tokens: int) -> None:
        self.num_requests += 1
        self.prompt_tokens += prompt_tokens

    def record_step(self, n_generated: int) -> None:
        now = time.monotonic()
        self.steps += 1
        self.generated_tokens += n_generated
        self.recent.append((now, n_generated))
        while self.recent and self.recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self.recent.popleft()

    def throughput(self) -> float:
        """Generated tokens/s over the last THROUGHPUT_WINDOW_S seconds (0 when idle that long)."""
        recent = list(self.recent)  # a snapshot: the step thread appends concurrently
        if not recent or recent[-1][0] < time.monotonic() - THROUGHPUT_WINDOW_S:
            return 0.0
        span = max(time.monotonic() - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span


def engine_stats(
    sched: Scheduler, blocks: BlockManager, counters: Counters, *, queued: int, paused: bool
) -> dict[str, float | int]:
    """Gauges and counters, SGLang's metric names where one exists (`sglang:<name>`)."""
    used, total = blocks.num_used(), blocks.num_blocks
    return {
        "num_running_reqs": len(sched.running),
        "num_queue_reqs": len(sched.waiting) + queued,
        "paused": int(paused),
        "num_requests_total": counters.num_requests,
        "prompt_tokens_total": counters.prompt_tokens,
        "generation_tokens_total": counters.generated_tokens,
        "num_steps_total": counters.steps,
        "cached_tokens_total": sched.cached_tokens,
        "cache_hit_rate": sched.cached_tokens / sched.admitted_tokens if sched.admitted_tokens else 0.0,
        "gen_throughput": counters.throughput(),
        "kv_blocks_used": used,
        "kv_blocks_cached": len(blocks.cached_free),
        "kv_blocks_total": total,
        "token_usage": used / total,
        "num_retractions_total": sched.num_retractions,
    }


def model_info(e: Engine) -> dict[str, object]:
    """/get_model_info of engine `e`."""
    full = e._full_config
    return {
        "model_path": e.model_path,
        "model_type": e.model.config.model_type,
        "is_generation": True,
        "weight_version": e.weight_version,
        "weights_half_updated": e.half_updated,
        "vocab_size": e.vocab_size,
        "tp_size": e.config.tp_size,
        # the KV heads its TP layout splits or replicates (null: MLA), for a trainer planning per-rank sends
        "layout_kv_heads": None if full.is_mla else full.num_key_value_heads,
        "max_context_len": e.max_context_len,
        "num_moe_layers": e.num_moe_layers,
        "top_k": e.top_k,
        # DSA: the shape of `indexer_topk` rows (our extension); records only with record_indexer_topk
        "num_indexer_layers": e.geometry.index_layers,
        "index_topk": e.model.config.index_topk if e.geometry.index_layers else 0,
        "records_indexer_topk": e.config.record_indexer_topk,
        "eos_token_ids": sorted(e.eos_token_ids),
    }


def server_config(e: Engine) -> dict[str, object]:
    """/get_server_info's configuration part: the EngineConfig, the dtype and the resolved KV geometry."""
    return {
        **asdict(e.config),
        "dtype": str(e.dtype).removeprefix("torch."),
        "num_blocks": e.blocks.num_blocks,
        "max_total_num_tokens": e.blocks.num_blocks * e.blocks.block_size,
        **e.geometry.info(),
    }
