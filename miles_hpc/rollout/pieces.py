"""A generation produced in pieces, merged into what one request would have returned (stage: rollout; no I/O of
its own: `continue_aborted` calls the generate function it is given).

The router (router.py) continues a generation from ``prompt + output so far`` when it chunks it or when the engine
running it failed. This module says when that is exact and how the pieces join.

Invariants:
- Continuing is exact only for the sampling keys in :data:`CONTINUABLE_KEYS`: each next token depends on the
  sequence so far alone. Stop strings, penalties, grammars and custom processors look at the output as output, so
  a request using them restarts from the prompt instead. ``sampling_seed`` is left out too: SGLang keys its seeded
  noise by absolute position (a continuation is exact there), but our embedded engine keys it by output index, so a
  continued seeded request would reuse the first piece's noise.
- :meth:`Pieces.result` of one piece is that piece (with the router's rid and counts); of several: output ids and
  log-probs concatenated, weight-version spans shifted and joined, routed experts and indexer records each
  concatenated (each piece covers rows ``[its start, its prompt + its output - 1)``, which tile ``[start, prompt +
  output - 1)`` when every later piece starts at its prompt length - 1), prompt log-probs and cached tokens from
  the first piece; `sent` sums every piece's prompt and cached tokens (a continuation after a weight update
  recomputes what the flush dropped: the prefix-cache account counts it).
- An aborted piece (a weight update in pause mode ``abort``) holds the records it computed, which may stop short of
  its prompt + output - 1 (none while it waited, part of its prompt mid-prefill): `continue_aborted` asks the next
  piece for records from the first one missing, so they still tile without a gap. A piece aborted before its first
  token is continued too (from no output): only an abort the caller asked for (:data:`CLIENT_ABORT`) ends a
  generation early.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from miles_hpc.rollout.responses import FinishReason, GenerateOutput, WeightVersionSpan

CLIENT_ABORT = FinishReason(type="abort", message="aborted by the client")  # `Router.abort`: never continued

CONTINUABLE_KEYS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "logit_bias",
    }
)


_RECORD_STARTS = {"routed_experts_start_len": "return_routed_experts", "indexer_topk_start_len": "return_indexer_topk"}


def continuable(sampling: Mapping[str, Any]) -> bool:
    """Whether a generation with these sampling params may continue from its partial output."""
    return sampling.get("max_new_tokens") is not None and not set(sampling) - CONTINUABLE_KEYS


def piece_params(sampling: Mapping[str, Any], done: int, chunk: int) -> dict[str, Any]:
    """Sampling params of the next piece after ``done`` tokens: at most ``chunk`` new tokens (0 = all remaining),
    ``min_new_tokens`` reduced by what is done."""
    out = dict(sampling)
    remaining = int(sampling["max_new_tokens"]) - done
    out["max_new_tokens"] = min(chunk, remaining) if chunk else remaining
    if sampling.get("min_new_tokens"):
        out["min_new_tokens"] = min(max(0, int(sampling["min_new_tokens"]) - done), out["max_new_tokens"])
    return out


@dataclass(slots=True)
class Pieces:
    prompt: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[WeightVersionSpan] = field(default_factory=list)
    routed: list[np.ndarray] = field(default_factory=list)
    indexer: list[np.ndarray] = field(default_factory=list)
    first: GenerateOutput | None = None
    last: GenerateOutput | None = None
    count: int = 0
    retractions: int = 0
    sent_prompt: int = 0  # prompt tokens of every piece (each sends the prompt with the output so far)
    sent_cached: int = 0  # of them served from a prefix cache
    started: float = field(default_factory=time.monotonic)

    def rows(self, field_name: str) -> int:
        """Record rows held so far for a record kind (a `_RECORD_STARTS` key)."""
        held = self.routed if field_name == "routed_experts_start_len" else self.indexer
        return sum(r.shape[0] for r in held)

    def add(self, out: GenerateOutput) -> None:
        offset = len(self.output_ids)
        self.output_ids += out.output_ids
        if out.output_logprobs is not None:
            self.logprobs += out.output_logprobs
        # A piece without spans (older SGLang) still says which version finished it: exact per piece.
        spans = out.weight_versions or (
            (WeightVersionSpan(version=out.weight_version, start=0, end=len(out.output_ids)),)
            if out.weight_version is not None and out.output_ids
            else ()
        )
        for s in spans:
            start, end = s.start + offset, s.end + offset
            if self.spans and self.spans[-1].version == s.version and self.spans[-1].end == start:
                self.spans[-1] = replace(self.spans[-1], end=end)
            else:
                self.spans.append(WeightVersionSpan(version=s.version, start=start, end=end))
        if out.routed_experts is not None:
            self.routed.append(out.routed_experts)
        if out.indexer_topk is not None:
            self.indexer.append(out.indexer_topk)
        self.first = self.first or out
        self.last = out
        self.count += 1
        self.retractions += out.num_retractions
        self.sent_prompt += out.prefill_account()[0]
        self.sent_cached += out.prefill_account()[1]

    def result(self, rid: str, resubmissions: int, finish: FinishReason | None = None) -> GenerateOutput:
        first, last = self.first, self.last
        if first is None or last is None:
            raise ValueError("no piece was generated")
        if self.count == 1 and not resubmissions:
            return replace(last, rid=rid, finish_reason=finish or last.finish_reason)
        return replace(
            last,
            rid=rid,
            output_ids=self.output_ids,
            finish_reason=finish or last.finish_reason,
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.output_ids),
            cached_tokens=first.cached_tokens,  # the prompt's hits; every piece's in `sent`
            sent=(self.sent_prompt, self.sent_cached),
            output_logprobs=self.logprobs if last.output_logprobs is not None else None,
            input_logprobs=first.input_logprobs,
            weight_versions=tuple(self.spans),
            routed_experts=np.concatenate(self.routed, axis=0) if self.routed else None,
            indexer_topk=np.concatenate(self.indexer, axis=0) if self.indexer else None,
            num_retractions=self.retractions,
            e2e_latency=time.monotonic() - self.started,
            chunks=self.count,
            resubmissions=resubmissions,
        )


async def continue_aborted(
    generate_fn: Callable[..., Awaitable[GenerateOutput]],
    ids: list[int],
    params: Mapping[str, Any],
    out: GenerateOutput,
    **kw: Any,
) -> GenerateOutput:
    """`out`, or, when a weight update aborted it (pause mode ``abort``) after some tokens, those tokens continued
    until the generation finishes otherwise: one output, as if never interrupted (its later tokens carry the new
    weight version). `kw` goes to every call of `generate_fn` (``Router.generate``'s signature); a continuation asks
    for its routing and indexer records from the first row not held yet (the last token sampled before it, or
    earlier when the aborted piece had not computed all of its tokens), so the records stitch without a gap. A
    generation aborted before its first token (waiting, or mid-prefill) is continued from its prompt alike; one the
    caller aborted (`CLIENT_ABORT`) is returned as it is."""
    if out.finish_reason.type != "abort" or out.finish_reason == CLIENT_ABORT or params.get("max_new_tokens") is None:
        return out
    pieces = Pieces(prompt=list(ids))
    pieces.add(out)
    cont = {k: v for k, v in params.items() if k != "sampling_seed"}  # continuing a seeded request is not exact
    first = {f: int(kw.get(f) or 0) for f, on in _RECORD_STARTS.items() if kw.get(on)}
    while (
        out.finish_reason.type == "abort"
        and out.finish_reason != CLIENT_ABORT
        and len(pieces.output_ids) < int(params["max_new_tokens"])
    ):
        starts = {f: start + pieces.rows(f) for f, start in first.items()}
        params_now = piece_params(cont, len(pieces.output_ids), 0)
        out = await generate_fn(list(ids) + pieces.output_ids, params_now, **{**kw, **starts})
        pieces.add(out)
    return pieces.result(out.rid, 0)
