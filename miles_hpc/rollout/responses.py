"""Typed results of the SGLang HTTP API, parsed from JSON (stage: rollout, client side).

The client-side mirror of what an engine answers (our embedded engine or real SGLang; docs/design.md section 4). Parsing is
strict where RL correctness depends on it and lenient where SGLang versions differ:

Invariants of a :class:`GenerateOutput`:
- ``len(output_logprobs) == len(output_ids)`` when log-probs were asked, and each log-prob's token id equals the
  output id at the same index (checked; a mismatch means the engine and the client disagree on the trajectory).
- ``weight_versions`` spans, when the engine sends them, are contiguous from 0 to ``len(output_ids)``.
- ``routed_experts`` is int32 ``[rows, num_layers, top_k]`` with
  ``rows == prompt_tokens + completion_tokens - 1 - routed_experts_start_len`` (the last sampled token never went
  through the model).
- ``indexer_topk`` (DSA indexer replay; our engine's extension) is int32 ``[rows, indexer_layers, index_topk]`` with
  ``rows == prompt_tokens + completion_tokens - 1 - indexer_topk_start_len``: row r holds the key positions the
  query of token ``indexer_topk_start_len + r`` selected in each indexer layer, -1 padding. An aborted request
  that never ran returns no rows.

Parsers raise ``ValueError`` with a precise reason; the client wraps it into an ``EngineProtocolError`` that names
the engine and endpoint.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FinishReason:
    type: FinishType
    matched: int | str | None = None  # the stop token id (or stop string) that ended generation
    message: str | None = None  # why an abort happened


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightVersionSpan:
    """Output tokens ``start .. end-1`` were sampled with weights ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateOutput:
    """One finished generation, as the rollout stage consumes it (client-side type; never the engine's)."""

    rid: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[float] | None = None  # temperature-1 log-prob of each output id (when asked)
    # Prompt tokens logprob_start_len.. (when asked with a start >= 0; [] for none): entry 0 is None, on SGLang as on
    # our engine, so the log-prob of prompt token k needs a start of k - 1.
    input_logprobs: list[float | None] | None = None
    weight_version: str | None = None  # the version at the end of the request
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None
    num_retractions: int = 0
    e2e_latency: float = 0.0
    engine_url: str = ""  # the engine that produced the last token
    # Router bookkeeping: pieces the generation was produced in, and how many were re-run after an engine failed.
    chunks: int = 1
    resubmissions: int = 0
    # Prompt tokens sent and of them served from a prefix cache, summed over every request this output took (the
    # router's chunks, continuations after a weight update, which recompute what the update's cache flush dropped);
    # None: one request (prompt_tokens, cached_tokens).
    sent: tuple[int, int] | None = None

    def prefill_account(self) -> tuple[int, int]:
        """(prompt tokens the engines were asked to prefill, of them cached) for this output: the prefix-cache
        account (`prefix_cache_hit_rate`), unlike `prompt_tokens` / `cached_tokens` (its prompt, the first request's
        hits)."""
        return self.sent if self.sent is not None else (self.prompt_tokens, self.cached_tokens)

    def token_versions(self) -> list[str]:
        """The weight version of every output token. Without spans (older SGLang) every token gets the final
        version: exact unless the weights changed during the request."""
        if not self.weight_versions:
            return [self.weight_version or ""] * len(self.output_ids)
        out: list[str] = []
        for span in self.weight_versions:
            out.extend([span.version] * (span.end - span.start))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RankChecksums:
    """``/weights_checker`` result of one TP rank: per-tensor checksums under the engine's parameter names."""

    checksums: dict[str, str]
    per_gpu_checksum: str | None = None
    parallelism_info: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightsChecksums:
    ranks: tuple[RankChecksums, ...]
    per_engine_checksum: str | None = None
    message: str = ""


def _int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"meta_info.{key} must be an int, got {value!r}")
    return value


def parse_finish_reason(raw: Any) -> FinishReason:
    if not isinstance(raw, Mapping) or raw.get("type") not in ("stop", "length", "abort"):
        raise ValueError(f"meta_info.finish_reason must be {{'type': stop|length|abort, ...}}, got {raw!r}")
    matched = raw.get("matched")
    message = raw.get("message")
    return FinishReason(type=raw["type"], matched=matched, message=None if message is None else str(message))


def parse_weight_versions(raw: Any, n_output: int) -> tuple[WeightVersionSpan, ...]:
    if raw is None:
        return ()
    spans = []
    for item in raw:
        if isinstance(item, Mapping):
            spans.append(
                WeightVersionSpan(version=str(item["version"]), start=int(item["start"]), end=int(item["end"]))
            )
        else:  # msgspec array_like encoding [version, start, end]
            version, start, end = item
            spans.append(WeightVersionSpan(version=str(version), start=int(start), end=int(end)))
    pos = 0
    for span in spans:
        if span.start != pos or span.end < span.start:
            raise ValueError(f"meta_info.weight_versions are not contiguous from 0: {raw!r}")
        pos = span.end
    if spans and pos != n_output:
        raise ValueError(f"meta_info.weight_versions end at {pos}, but there are {n_output} output tokens")
    return tuple(spans)


def _logprob_triples(raw: Any, key: str) -> list[tuple[float | None, int]]:
    if not isinstance(raw, list):
        raise ValueError(f"meta_info.{key} missing or not a list: {raw!r}"[:300])
    out = []
    for entry in raw:
        lp, tid = entry[0], entry[1]
        out.append((None if lp is None else float(lp), int(tid)))
    return out


def decode_routed_experts(
    b64: str, rows: int, *, num_layers: int | None = None, top_k: int | None = None, at_most: bool = False
) -> np.ndarray:
    """Base64 of int32 ``[rows, num_layers, top_k]`` -> array. One of ``num_layers``/``top_k`` suffices: the
    other follows from the byte count and ``rows`` (which the token counts give), and a given one is checked.
    ``at_most``: an aborted request's answer, which holds only the rows it computed (none while it waited, part of
    its prompt's mid-prefill): any whole number of rows up to ``rows``, which needs both dims."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    if at_most and num_layers and top_k and flat.size != rows * num_layers * top_k:
        per_row = num_layers * top_k
        if flat.size % per_row or flat.size // per_row > rows:
            raise ValueError(
                f"routed_experts of an aborted request: {flat.size} int32 values, not up to {rows} rows of "
                f"num_layers*top_k={num_layers}*{top_k}"
            )
        return flat.reshape(-1, num_layers, top_k)
    if rows <= 0:
        if flat.size:
            raise ValueError(f"routed_experts has {flat.size} values for 0 rows")
        return flat.reshape(0, num_layers or 0, top_k or 0)
    if flat.size % rows:
        raise ValueError(f"routed_experts: {flat.size} int32 values do not split into {rows} rows")
    per_row = flat.size // rows
    if num_layers is None and top_k is None:
        raise ValueError("routed_experts: the model's num_layers or top_k is needed to decode")
    if top_k is None:
        assert num_layers is not None
        top_k = per_row // num_layers if num_layers else 0
    if num_layers is None:
        num_layers = per_row // top_k if top_k else 0
    if num_layers * top_k != per_row:
        raise ValueError(f"routed_experts: {per_row} values per row, expected num_layers*top_k={num_layers}*{top_k}")
    return flat.reshape(rows, num_layers, top_k)


def decode_indexer_topk(b64: str, rows: int, *, num_layers: int, index_topk: int, at_most: bool = False) -> np.ndarray:
    """Base64 of int32 ``[rows, num_layers, index_topk]`` -> array; both dims are needed (the model's), and a
    payload of no values is the no rows of a request aborted before it ran. ``at_most``: an aborted request's
    answer, any whole number of rows up to ``rows`` (the rows it computed)."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    per_row = num_layers * index_topk
    if flat.size == 0:
        return flat.reshape(0, num_layers, index_topk)
    if at_most and per_row and not flat.size % per_row and flat.size // per_row <= rows:
        return flat.reshape(-1, num_layers, index_topk)
    if flat.size != rows * num_layers * index_topk:
        raise ValueError(
            f"indexer_topk: {flat.size} int32 values, expected rows*indexer_layers*index_topk="
            f"{rows}*{num_layers}*{index_topk}"
        )
    return flat.reshape(rows, num_layers, index_topk)


def _indexer_rows(meta: Mapping[str, Any], rows: int, dims: tuple[int, int] | None, at_most: bool) -> np.ndarray:
    b64 = meta.get("indexer_topk")
    if not isinstance(b64, str):
        raise ValueError("indexer_topk asked but missing (our engine returns it with --enable-return-indexer-topk)")
    if dims is None:
        raise ValueError("indexer_topk: the model's indexer layers and index_topk are needed to decode")
    return decode_indexer_topk(b64, rows, num_layers=dims[0], index_topk=dims[1], at_most=at_most)


def parse_generate(
    obj: Any,
    *,
    return_logprob: bool,
    return_routed_experts: bool,
    routed_experts_start_len: int = 0,
    routing_dims: tuple[int | None, int | None] = (None, None),
    return_indexer_topk: bool = False,
    indexer_topk_start_len: int = 0,
    indexer_dims: tuple[int, int] | None = None,
    engine_url: str = "",
) -> GenerateOutput:
    """The JSON answer of ``POST /generate`` for one prompt -> :class:`GenerateOutput` (see module invariants).
    ``routing_dims`` is ``(num_layers, top_k)`` of the model, either may be None (see decode_routed_experts);
    ``indexer_dims`` ``(indexer_layers, index_topk)``, needed with ``return_indexer_topk``."""
    if isinstance(obj, list):
        if len(obj) != 1:
            raise ValueError(f"expected one result, got a list of {len(obj)}")
        obj = obj[0]
    if not isinstance(obj, Mapping) or not isinstance(obj.get("meta_info"), Mapping):
        raise ValueError(f"expected {{output_ids, meta_info}}, got {str(obj)[:200]}")
    meta = obj["meta_info"]
    output_ids = obj.get("output_ids")
    if not isinstance(output_ids, list):
        raise ValueError("output_ids missing (was the request sent with input_ids?)")
    output_ids = [int(t) for t in output_ids]
    n = len(output_ids)
    completion = _int(meta, "completion_tokens", n)
    if completion != n:
        raise ValueError(f"meta_info.completion_tokens={completion} but {n} output_ids")
    prompt_tokens = _int(meta, "prompt_tokens")

    output_logprobs = input_logprobs = None
    if return_logprob:
        triples = _logprob_triples(meta.get("output_token_logprobs"), "output_token_logprobs")
        if len(triples) != n:
            raise ValueError(f"{len(triples)} output_token_logprobs for {n} output tokens")
        for i, ((lp, tid), out_id) in enumerate(zip(triples, output_ids)):
            if tid != out_id:
                raise ValueError(f"output_token_logprobs[{i}] is for token {tid}, but output_ids[{i}] = {out_id}")
            if lp is None or math.isnan(lp):
                raise ValueError(f"output_token_logprobs[{i}] is {lp}")
        output_logprobs = [float(lp) for lp, _ in triples]  # type: ignore[arg-type]
        if meta.get("input_token_logprobs") is not None:
            input_logprobs = [lp for lp, _ in _logprob_triples(meta["input_token_logprobs"], "input_token_logprobs")]

    finish = parse_finish_reason(meta.get("finish_reason"))
    aborted = finish.type == "abort"  # a paused or cancelled request: only the records it computed
    routed = None
    if return_routed_experts:
        b64 = meta.get("routed_experts")
        if not isinstance(b64, str):
            raise ValueError("routed_experts asked but missing (SGLang needs --enable-return-routed-experts)")
        rows = prompt_tokens + n - 1 - routed_experts_start_len
        routed = decode_routed_experts(b64, rows, num_layers=routing_dims[0], top_k=routing_dims[1], at_most=aborted)
    indexer = None
    if return_indexer_topk:
        indexer = _indexer_rows(meta, prompt_tokens + n - 1 - indexer_topk_start_len, indexer_dims, aborted)

    version = meta.get("weight_version")
    return GenerateOutput(
        rid=str(meta.get("id", "")),
        output_ids=output_ids,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=n,
        cached_tokens=_int(meta, "cached_tokens", 0),
        output_logprobs=output_logprobs,
        input_logprobs=input_logprobs,
        weight_version=None if version is None else str(version),
        weight_versions=parse_weight_versions(meta.get("weight_versions"), n),
        routed_experts=routed,
        indexer_topk=indexer,
        num_retractions=_int(meta, "num_retractions", 0),
        e2e_latency=float(meta.get("e2e_latency") or 0.0),
        engine_url=engine_url,
    )


def parse_weights_checksums(obj: Any) -> WeightsChecksums:
    """SGLang answers ``{success, message, ranks: [{checksums, per_gpu_checksum, parallelism_info}],
    per_engine_checksum}``; a bare ``{checksums: {...}}`` (one rank) is accepted too."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"weights_checker: expected an object, got {str(obj)[:200]}")
    raw_ranks: Sequence[Any] = obj.get("ranks") or ([obj] if "checksums" in obj else [])
    ranks = []
    for r in raw_ranks:
        if not isinstance(r.get("checksums"), Mapping):
            raise ValueError(f"weights_checker: rank without checksums: {str(r)[:200]}")
        ranks.append(
            RankChecksums(
                checksums={str(k): str(v) for k, v in r["checksums"].items()},
                per_gpu_checksum=r.get("per_gpu_checksum"),
                parallelism_info=tuple(r.get("parallelism_info") or ()),
            )
        )
    return WeightsChecksums(
        ranks=tuple(ranks), per_engine_checksum=obj.get("per_engine_checksum"), message=str(obj.get("message", ""))
    )


def _split_labels(text: str) -> list[tuple[str, str]]:
    """``a="x",b="y\\"z"`` -> [(a, x), (b, y"z)]; values may hold commas, braces and escaped quotes."""
    out, i = [], 0
    while i < len(text):
        eq = text.index("=", i)
        name = text[i:eq].strip().lstrip(",").strip()
        if text[eq + 1] != '"':
            raise ValueError(f"bad label value in {{{text}}}")
        j, chars = eq + 2, []
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
                chars.append({"n": "\n"}.get(text[j], text[j]))
            else:
                chars.append(text[j])
            j += 1
        out.append((name, "".join(chars)))
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1
    return out


def metric_key(name: str, labels: Mapping[str, str] | None = None) -> str:
    """The dict key :func:`parse_prometheus` uses: ``name`` or ``name{k="v",...}`` with labels sorted."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{metric_key(name, labels): value}`` (comments and timestamps dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), len(line.split(None, 1)[0])
        if brace != -1 and brace < space:  # labels may contain spaces, so look for the brace within the name
            name, rest = line[:brace], line[brace + 1 :]
            close = rest.rindex("}")
            labels = dict(_split_labels(rest[:close]))
            value_text = rest[close + 1 :].split()[0]
        else:
            name, value_text = line.split()[:2]
            labels = {}
        out[metric_key(name.strip(), labels)] = float(value_text)
    return out


def metric_sum(metrics: Mapping[str, float], name: str) -> float | None:
    """Sum of one metric over its label sets (e.g. ``sglang:num_running_reqs`` over TP/DP ranks); None if absent."""
    values = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None
