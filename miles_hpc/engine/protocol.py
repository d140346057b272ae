"""SGLang-shaped JSON <-> the engine's records (types.py): request validation and response building.

Stage: engine (HTTP layer; no I/O here, so every rule is unit-testable without a server).

Invariants:
- A request body is a JSON object, read by the field names of the matching SGLang request type (sglang 0.5.23
  ``io_struct``; docs/engine.md, HTTP API). As SGLang's HTTP server, a top-level key we do not read is ignored
  (handed to ``on_unknown``: the server logs it once per name), while ``sampling_params`` keys outside SGLang's
  are a :class:`BadRequest` naming them (SGLang's JSON contract rejects those too). Our extension endpoints
  (``EXTENSION_ENDPOINTS``) refuse unknown keys. A field SGLang has that would change the answer but the embedded
  engine does not implement is accepted only at its SGLang default; any other value is a 400 naming it, never
  silently ignored. ``null`` means "the default", as in SGLang (``max_new_tokens: null``: no limit but the
  context's). Our extensions: ``/generate``'s ``return_indexer_topk`` and ``indexer_topk_start_len`` (DSA indexer
  replay) and the ``meta_info.indexer_topk`` answer (docs/engine.md says how they relate to SGLang's later ones).
- Every type and range error names the field by its JSON path (``sampling_params[1].top_p``).
- Token ids are checked against the model (``0 <= id < vocab_size``) and lengths against its context, with
  SGLang's own messages, before anything reaches the engine core; ``max_new_tokens`` is then cut to what fits the
  context and the KV cache as SGLang's scheduler cuts it (`_sampling`).
- Responses carry SGLang's keys and shapes; ``text`` is the decoded output when the model has a tokenizer, else
  null, without the matched stop token (`text_ids`).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles_hpc.sync.wire.tensor_handles import DTYPE_NAMES

from .types import GenerateRequest, GenerateResult, SamplingParams


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message names the field."""


Check = Callable[[Any, str], Any]


@dataclass(frozen=True, slots=True)
class F:
    """One field of a request schema: its checker (value, json path) -> parsed value, and its default."""

    check: Check
    default: Any = None
    required: bool = False


def _show(v: Any) -> str:
    text = repr(v) if not isinstance(v, (list, dict)) else type(v).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _expect(ok: bool, path: str, what: str, v: Any) -> None:
    if not ok:
        raise BadRequest(f"field `{path}`: expected {what}, got {_show(v)}")


def boolean(v: Any, path: str) -> bool:
    _expect(isinstance(v, bool), path, "a boolean", v)
    return v


def integer(v: Any, path: str) -> int:
    _expect(isinstance(v, int) and not isinstance(v, bool), path, "an integer", v)
    return v


def number(v: Any, path: str) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    _expect(ok, path, "a finite number", v)
    return float(v)


def string(v: Any, path: str) -> str:
    _expect(isinstance(v, str), path, "a string", v)
    return v


def at_least(lo: float, check: Check = integer, hi: float = math.inf, lo_open: bool = False) -> Check:
    """``check``, then ``lo <= x <= hi`` (``lo < x`` when ``lo_open``)."""

    def run(v: Any, path: str) -> Any:
        x = check(v, path)
        ok = (x > lo if lo_open else x >= lo) and x <= hi
        _expect(ok, path, f"a value in {'(' if lo_open else '['}{lo}, {hi}{']' if hi < math.inf else ')'}", v)
        return x

    return run


def list_of(item: Check) -> Check:
    def run(v: Any, path: str) -> list[Any]:
        _expect(isinstance(v, list), path, "a list", v)
        return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]

    return run


def one_of(*values: str) -> Check:
    def run(v: Any, path: str) -> str:
        _expect(v in values, path, " or ".join(repr(x) for x in values), v)
        return v

    return run


def only(default: Any, why: str) -> Check:
    """A field SGLang has that we support at its default value only."""

    def run(v: Any, path: str) -> Any:
        if v != default and not (isinstance(default, (list, dict)) and not v):
            raise BadRequest(f"field `{path}` = {_show(v)} is not supported by the embedded engine: {why}")
        return default

    return run


Unknown = Callable[[str], None]


def ignore_quietly(name: str) -> None:
    """An ``on_unknown`` that drops the key without a word (the server passes one that logs)."""


def parse_object(
    body: Any, fields: Mapping[str, F], path: str = "", on_unknown: Unknown | None = None
) -> dict[str, Any]:
    """Check a JSON object against ``fields``: unknown keys (a 400, or given ``on_unknown``, passed to it and
    ignored), missing required ones, each value's type."""
    where = path.rstrip(".") or "request body"
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise BadRequest(f"{where}: expected a JSON object, got {_show(body)}")
    for key in body:
        if key in fields:
            continue
        if on_unknown is None:
            raise BadRequest(f"unknown field `{path}{key}`; accepted: {', '.join(sorted(fields))}")
        on_unknown(f"{path}{key}")
    # Present fields first, so "text is not supported" wins over "input_ids is missing".
    out = {name: f.check(body[name], f"{path}{name}") for name, f in fields.items() if body.get(name) is not None}
    for name, f in fields.items():
        if name not in out:
            if f.required:
                raise BadRequest(f"missing required field `{path}{name}`")
            out[name] = f.default
    return out


# ---------------------------------------------------------------------------------------------- /generate
_NO_STRINGS = "the engine is token-in token-out; use stop_token_ids"
_NO_GRAMMAR = "constrained decoding is not implemented"
SAMPLING_FIELDS: dict[str, F] = {
    "max_new_tokens": F(at_least(0), 128),
    "min_new_tokens": F(at_least(0), 0),
    "temperature": F(at_least(0.0, number), 1.0),
    "top_p": F(at_least(0.0, number, 1.0, lo_open=True), 1.0),
    "top_k": F(lambda v, path: -1 if integer(v, path) == -1 else at_least(1)(v, path), -1),  # -1 = off
    "min_p": F(at_least(0.0, number, 1.0), 0.0),
    "stop_token_ids": F(list_of(integer), []),
    "ignore_eos": F(boolean, False),
    "sampling_seed": F(integer),
    "n": F(only(1, "send one request per sample"), 1),
    # These shape only the decoded `text`, never output_ids.
    "skip_special_tokens": F(boolean, True),
    "spaces_between_special_tokens": F(boolean, True),  # accepted; the tokenizer's decode has no such switch
    "no_stop_trim": F(boolean, False),
    "stream_interval": F(at_least(1)),  # accepted and ignored: no streaming
    "beam_width": F(only(None, "beam search is not implemented")),
    "watermark": F(only(None, "watermarking is not implemented")),
    "stop": F(only([], _NO_STRINGS)),
    "stop_regex": F(only([], _NO_STRINGS)),
    "json_schema": F(only(None, _NO_GRAMMAR)),
    "regex": F(only(None, _NO_GRAMMAR)),
    "ebnf": F(only(None, _NO_GRAMMAR)),
    "structural_tag": F(only(None, _NO_GRAMMAR)),
    "frequency_penalty": F(only(0.0, "penalties are not implemented"), 0.0),
    "presence_penalty": F(only(0.0, "penalties are not implemented"), 0.0),
    "repetition_penalty": F(only(1.0, "penalties are not implemented"), 1.0),
    "logit_bias": F(only({}, "logit_bias is not implemented")),
    "custom_params": F(only(None, "custom logit processors are not implemented")),
}


_ANY: Check = lambda v, path: v  # noqa: E731 (checked per item below)
_MULTIMODAL = "multimodal input is not supported"
_NO_NAMESPACE = "prefix-cache namespaces are not implemented"
UNSUPPORTED_GENERATE_FIELDS: dict[str, str] = {  # SGLang fields accepted only when absent/null
    "text": "text input is not supported: send input_ids (token-in token-out)",
    "input_embeds": "input_embeds is not supported: send input_ids",
    "image_data": _MULTIMODAL,
    "video_data": _MULTIMODAL,
    "audio_data": _MULTIMODAL,
    "token_ids_logprob": "token_ids_logprob is not implemented",
    "session_params": "sessions are not implemented",
    "custom_logit_processor": "custom logit processors are not implemented",
    "extra_key": _NO_NAMESPACE,
    "cache_salt": _NO_NAMESPACE,
    "session_id": "sessions are not implemented",
    "positional_embed_overrides": "input embeddings are not supported",
    "token_indices_to_pool": "scoring requests are not implemented",
    "multi_item_delimiter_indices": "scoring requests are not implemented",
    "max_thinking_tokens": "there is no reasoning parser to hold a thinking budget",
    "sampling_logprobs_mode": "sampling masks are not returned",
    "watermark": "watermarking is not implemented",
}
_FLAGS_NOT_IMPLEMENTED: dict[str, str] = {  # SGLang flags accepted only when false: each would change the answer
    "return_prompt_token_ids": "prompt_token_ids are not returned (they are the input_ids sent)",
    "return_entropy": "entropies are not returned",
    "return_bytes": "byte outputs are not returned",
    "return_sampling_mask": "sampling masks are not returned",
    "require_reasoning": "there is no reasoning parser",
    "return_flat_raw_top_logprobs": "top-k log-probs are not implemented",
    "return_flat_raw_output_top_logprobs": "top-k log-probs are not implemented",
    "return_flat_raw_top_logprobs_b64": "top-k log-probs are not implemented",
}
GENERATE_FIELDS: dict[str, F] = {
    "rid": F(_ANY),
    "input_ids": F(_ANY, required=True),
    "sampling_params": F(_ANY),
    "return_logprob": F(_ANY),
    "logprob_start_len": F(_ANY),
    "return_routed_experts": F(boolean, False),
    "routed_experts_start_len": F(at_least(0), 0),
    # Our extension (DSA indexer replay; the engine must run with --enable-return-indexer-topk): not SGLang's.
    "return_indexer_topk": F(boolean, False),
    "indexer_topk_start_len": F(at_least(0), 0),
    "stream": F(only(False, "streaming (SSE) is not implemented; send stream=false"), False),
    "top_logprobs_num": F(only(0, "top-k log-probs are not implemented"), 0),
    "return_text_in_logprobs": F(only(False, "log-prob entries carry no text ([logprob, id, null])"), False),
    "return_hidden_states": F(only(False, "hidden states are not returned"), False),
    "log_metrics": F(boolean, True),  # False: the request counters leave it out
    "lora_path": F(_ANY),  # a loaded adapter's name, or one per prompt (checked per item below)
    "routing_key": F(string),  # accepted and ignored: one engine, no data parallelism inside
    "priority": F(integer),  # accepted and ignored: scheduling is first come, first served
    **{name: F(only(None, why)) for name, why in UNSUPPORTED_GENERATE_FIELDS.items()},
    **{name: F(only(False, why), False) for name, why in _FLAGS_NOT_IMPLEMENTED.items()},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_context_len: int
    kv_capacity_tokens: int | None = None  # the KV cache's tokens (SGLang's max_total_num_tokens); None: unbounded


@dataclass(frozen=True, kw_only=True, slots=True)
class TextOptions:
    """How one request's ``text`` is decoded from its output ids (SGLang's detokenizer; output_ids never change)."""

    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedGenerate:
    requests: list[GenerateRequest]
    batched: bool  # input_ids was a list of lists: answer with a list
    text: list[TextOptions]  # per request


def _per_item(value: Any, n: int, batched: bool, path: str, check: Check, default: Any) -> list[Any]:
    """A scalar applies to every prompt; a list (batched requests only) gives one value per prompt."""
    if isinstance(value, list) and batched:
        if len(value) != n:
            raise BadRequest(f"field `{path}`: {len(value)} values for {n} prompts")
        return [default if v is None else check(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return [default if value is None else check(value, path)] * n


def _prompt(ids: Any, path: str, limits: ModelLimits) -> tuple[int, ...]:
    _expect(isinstance(ids, list), path, "a list of token ids", ids)
    if not ids:
        raise BadRequest(f"field `{path}`: the prompt must not be empty")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
            raise BadRequest(
                f"field `{path}[{i}]` = {_show(t)} is not a token id of this model (0 <= id < {limits.vocab_size})"
            )
    if len(ids) >= limits.max_context_len:
        raise BadRequest(
            f"The input ({len(ids)} tokens) is longer than the model's context length ({limits.max_context_len} "
            f"tokens)."
        )
    return tuple(ids)


def _sampling(raw: Any, path: str, prompt_len: int, limits: ModelLimits) -> tuple[SamplingParams, TextOptions]:
    """The sampling params, ``max_new_tokens`` cut as SGLang cuts it. Its tokenizer manager refuses only an explicit
    ``max_new_tokens`` that overruns the context; its scheduler (``init_req_max_new_tokens``) then cuts every
    request's to ``min(context - 1, kv tokens - 1) - prompt - 1``, 0 at least, ``null`` meaning no limit of its
    own (an absent one is 128), and ``min_new_tokens`` to the result."""
    p = parse_object(raw, SAMPLING_FIELDS, path + ".")
    unbounded = isinstance(raw, dict) and "max_new_tokens" in raw and raw["max_new_tokens"] is None
    if not unbounded and p["min_new_tokens"] > p["max_new_tokens"]:
        raise BadRequest(f"field `{path}.min_new_tokens`: {p['min_new_tokens']} > max_new_tokens")
    total = prompt_len + p["max_new_tokens"]
    if isinstance(raw, dict) and raw.get("max_new_tokens") is not None and total >= limits.max_context_len:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {limits.max_context_len} tokens. "
            f"You requested a total of {total} tokens: {prompt_len} tokens from the input messages and "
            f"{p['max_new_tokens']} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit."
        )
    room = min(limits.max_context_len, limits.kv_capacity_tokens or limits.max_context_len) - prompt_len - 2
    p["max_new_tokens"] = max(0, room if unbounded else min(p["max_new_tokens"], room))
    p["min_new_tokens"] = min(p["min_new_tokens"], p["max_new_tokens"])
    keys = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "ignore_eos", "sampling_seed")
    sampling = SamplingParams(**{k: p[k] for k in keys}, stop_token_ids=tuple(p["stop_token_ids"]))
    return sampling, TextOptions(skip_special_tokens=p["skip_special_tokens"], no_stop_trim=p["no_stop_trim"])


def _rids(raw: Any, n: int, batched: bool, new_rid: Callable[[], str]) -> list[str]:
    """One rid per prompt. A batch's single string rid becomes ``rid_0``, ``rid_1``, ... (SGLang's
    ``_normalize_rid``); a missing one is made up."""
    if batched and isinstance(raw, str):
        raw = [f"{raw}_{i}" for i in range(n)]
    rids = [r if r is not None else new_rid() for r in _per_item(raw, n, batched, "rid", string, None)]
    if len(set(rids)) != n:
        raise BadRequest("field `rid`: rids within one request must be distinct")
    return rids


def parse_generate(
    body: Any, limits: ModelLimits, new_rid: Callable[[], str], on_unknown: Unknown = ignore_quietly
) -> ParsedGenerate:
    """``POST /generate`` body -> one GenerateRequest per prompt (see module invariants)."""
    top = parse_object(body, GENERATE_FIELDS, on_unknown=on_unknown)
    raw_ids = top["input_ids"]
    _expect(isinstance(raw_ids, list), "input_ids", "a list of token ids or a list of such lists", raw_ids)
    batched = bool(raw_ids) and isinstance(raw_ids[0], list)
    items = [(p, f"input_ids[{i}]") for i, p in enumerate(raw_ids)] if batched else [(raw_ids, "input_ids")]
    prompts = [_prompt(p, path, limits) for p, path in items]
    n = len(prompts)
    rids = _rids(top["rid"], n, batched, new_rid)
    logprob = _per_item(top["return_logprob"], n, batched, "return_logprob", boolean, False)
    loras = _per_item(top["lora_path"], n, batched, "lora_path", string, None)
    starts = _per_item(top["logprob_start_len"], n, batched, "logprob_start_len", at_least(-1), -1)
    raw_sp = top["sampling_params"]
    if isinstance(raw_sp, list) and not batched:
        raise BadRequest("field `sampling_params`: a list is only allowed with batched input_ids")
    sp_items = raw_sp if isinstance(raw_sp, list) else [raw_sp] * n
    if len(sp_items) != n:
        raise BadRequest(f"field `sampling_params`: {len(sp_items)} values for {n} prompts")
    requests, text = [], []
    for i, prompt in enumerate(prompts):
        sp_path = f"sampling_params[{i}]" if isinstance(raw_sp, list) else "sampling_params"
        sampling, options = _sampling(sp_items[i], sp_path, len(prompt), limits)
        if logprob[i] and starts[i] > len(prompt):  # SGLang: at the prompt's end is fine (no prompt log-probs)
            raise BadRequest(
                f"field `logprob_start_len`: {starts[i]} is past the end of the {len(prompt)}-token prompt"
            )
        for start in ("routed_experts_start_len", "indexer_topk_start_len"):
            if top[start] > len(prompt):
                raise BadRequest(f"field `{start}`: {top[start]} > prompt length")
        keys = ("return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "indexer_topk_start_len")
        requests.append(
            GenerateRequest(
                rid=rids[i],
                input_ids=prompt,
                sampling=sampling,
                return_logprob=logprob[i],
                logprob_start_len=starts[i],
                lora_path=loras[i],
                log_metrics=top["log_metrics"],
                **{k: top[k] for k in keys},
            )
        )
        text.append(options)
    return ParsedGenerate(requests=requests, batched=batched, text=text)


def text_ids(res: GenerateResult, options: TextOptions) -> list[int]:
    """The output ids ``text`` is decoded from: SGLang's detokenizer drops the matched stop token (a stop_token_ids
    entry or EOS; ``output_ids`` keep it) unless ``no_stop_trim``. Stop strings, which it trims too, are refused."""
    ids = res.output_ids
    trim = res.finish_reason.type == "stop" and res.finish_reason.matched is not None and not options.no_stop_trim
    return ids[:-1] if trim and ids else ids


def _logprob_entries(lps: Sequence[float | None], ids: Sequence[int]) -> list[list[Any]]:
    return [[lp, t, None] for lp, t in zip(lps, ids)]  # SGLang's [logprob, token id, text]: no text asked


def generate_response(req: GenerateRequest, res: GenerateResult, text: str | None) -> dict[str, Any]:
    """SGLang's ``{text, output_ids, meta_info}`` for one finished request (its tokenizer_manager's meta_info keys)."""
    meta: dict[str, Any] = {
        "id": res.rid,
        "finish_reason": res.finish_reason.to_json(),
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "cached_tokens": res.cached_tokens,
        "reasoning_tokens": 0,  # SGLang's count without a reasoning parser (we have none)
        "weight_version": res.weight_version,
        "weight_versions": res.weight_versions,
        "num_retractions": res.num_retractions,
        "e2e_latency": res.e2e_latency,
    }
    if req.return_logprob:  # input entries from logprob_start_len (entry 0 None), none for -1, as SGLang
        start, inputs = req.logprob_start_len, res.input_logprobs
        ins = inputs if start >= 0 and inputs is not None else []
        meta["input_token_logprobs"] = _logprob_entries(ins, req.input_ids[start:] if ins else ())
        meta["output_token_logprobs"] = _logprob_entries(res.output_logprobs, res.output_ids)
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    if req.return_routed_experts:
        routed = res.routed_experts
        arr = np.zeros((0, 0, 0), np.int32) if routed is None else np.ascontiguousarray(routed, dtype=np.int32)
        meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode("ascii")
    if req.return_indexer_topk:  # our extension, the same form: int32 [rows, indexer_layers, index_topk]
        sel = res.indexer_topk
        arr = np.zeros((0, 0, 0), np.int32) if sel is None else np.ascontiguousarray(sel, dtype=np.int32)
        meta["indexer_topk"] = base64.b64encode(arr.tobytes()).decode("ascii")
    return {"text": text, "output_ids": list(res.output_ids), "meta_info": meta}


# ---------------------------------------------------------------------------------------------- control endpoints
_WEIGHT_COMMON: dict[str, F] = {
    "rid": F(string),
    "flush_cache": F(boolean, True),
    "abort_all_requests": F(boolean, False),
    "weight_version": F(string),
    "selector": F(one_of("target", "draft", "all"), "all"),  # no draft model here: every value means the model
    "torch_empty_cache": F(boolean, False),  # accepted; the core frees what it allocates
}

SCHEMAS: dict[str, dict[str, F]] = {
    "abort_request": {"rid": F(string, ""), "abort_all": F(boolean, False), "abort_message": F(string)},
    "pause_generation": {"rid": F(string), "mode": F(one_of("abort", "retract", "in_place"), "abort")},
    "continue_generation": {"rid": F(string), "torch_empty_cache": F(boolean, True)},
    "flush_cache": {"timeout_s": F(at_least(0.0, number), 0.0)},
    "update_weight_version": {
        "rid": F(string),
        "new_version": F(string, required=True),
        "abort_all_requests": F(boolean, True),
    },
    "weights_checker": {
        "rid": F(string),
        "action": F(one_of("checksum"), "checksum"),
        "allow_quant_error": F(boolean, False),
        "skip_tensor_list": F(list_of(string), []),
        "selector": F(one_of("target", "draft", "all"), "all"),
    },
    "update_weights_from_disk": {
        **_WEIGHT_COMMON,
        "model_path": F(string, required=True),
        "load_format": F(only(None, "checkpoints load as HF safetensors")),
        "is_async": F(only(False, "updates are synchronous"), False),
        "keep_pause": F(boolean, False),
        "recapture_cuda_graph": F(boolean, False),
        "token_step": F(integer, 0),
        "manifest": F(only(None, "manifests are not implemented")),
    },
    "update_weights_from_tensor": {
        **_WEIGHT_COMMON,
        "serialized_named_tensors": F(list_of(string), required=True),
        "load_format": F(one_of("safetensors", "flattened_bucket")),
    },
    "init_weights_update_group": {
        "rid": F(string),
        "master_address": F(string, required=True),
        "master_port": F(integer, required=True),
        "rank_offset": F(at_least(1), required=True),
        "world_size": F(at_least(2), required=True),
        "group_name": F(string, "weight_update_group"),
        "backend": F(one_of("nccl", "gloo", "mpi"), "nccl"),  # "mpi": ours (master_address = port-file dir)
    },
    "update_weights_from_distributed": {
        **_WEIGHT_COMMON,
        "names": F(list_of(string), required=True),
        "dtypes": F(list_of(one_of(*DTYPE_NAMES, *(f"torch.{d}" for d in DTYPE_NAMES))), required=True),
        "shapes": F(list_of(list_of(at_least(0))), required=True),
        "group_name": F(string, "weight_update_group"),
        "load_format": F(only(None, "tensors arrive as they are broadcast")),
    },
    "destroy_weights_update_group": {"rid": F(string), "group_name": F(string, "weight_update_group")},
    "load_lora_adapter": {
        "lora_name": F(string, required=True),
        "lora_path": F(string, required=True),
        "pinned": F(boolean, False),
    },
    "unload_lora_adapter": {"lora_name": F(string, required=True)},
    "lora_adapter_checksums": {"lora_name": F(string, required=True)},  # our extension
    "update_weights_from_p2p": {  # our extension (docs/engine.md; the p2p strategy, sync/strategies/p2p.py)
        **_WEIGHT_COMMON,
        "names": F(list_of(string), required=True),
        "dtypes": F(list_of(one_of(*DTYPE_NAMES, *(f"torch.{d}" for d in DTYPE_NAMES))), required=True),
        "shapes": F(list_of(list_of(at_least(0))), required=True),
        "pieces": F(list_of(list_of(list_of(at_least(0)))), required=True),
        # a tensor-parallel engine: per tensor, per TP rank, its pieces (dims within that rank's part of the tensor)
        "tp_pieces": F(list_of(list_of(list_of(list_of(at_least(0)))))),
        "group_name": F(string, "weight_update_group"),
    },
    "weights_piece_checksums": {  # our extension: checksums of boxes of tensors (p2p verification)
        "names": F(list_of(string), required=True),
        "boxes": F(list_of(list_of(list_of(at_least(0)))), required=True),
    },
    "weights_ipc_handles": {},  # our extension: direct writes of a colocated trainer (engine/direct_weights.py)
    "weights_direct_begin": {},  # our extension
    "weights_direct_commit": {**_WEIGHT_COMMON},  # our extension
    "update_weights_from_delta": {  # our extension (docs/engine.md; engine/delta_receiver.py), not SGLang's
        **_WEIGHT_COMMON,
        "manifest_path": F(string, required=True),
        "base_version": F(string),  # null: the manifest holds full tensors
    },
}


def parse_box(flat: list[int], shape: list[int] | None, path: str, name: str) -> tuple[tuple[int, int], ...]:
    """``[lo0, hi0, lo1, hi1, ...]`` -> per-dim (lo, hi), checked against ``shape`` when it is known."""
    dims = tuple(zip(flat[0::2], flat[1::2]))
    if len(flat) % 2 or (shape is not None and len(dims) != len(shape)):
        raise BadRequest(
            f"field `{path}` of {name!r}: needs lo, hi for each of its {len(shape or ())} dims, got {flat}"
        )
    if any(not lo < hi for lo, hi in dims) or (shape is not None and any(hi > n for (_, hi), n in zip(dims, shape))):
        raise BadRequest(f"field `{path}` of {name!r}: box {flat} is empty or outside shape {shape}")
    return dims


EXTENSION_ENDPOINTS = frozenset(
    {
        "lora_adapter_checksums",
        "update_weights_from_p2p",
        "weights_piece_checksums",
        "weights_ipc_handles",
        "weights_direct_begin",
        "weights_direct_commit",
        "update_weights_from_delta",
    }
)
"""Our endpoints, not SGLang's: their bodies refuse unknown keys (SGLang's ignore them)."""


def parse_control(endpoint: str, body: Any, on_unknown: Unknown = ignore_quietly) -> dict[str, Any]:
    """Body of a control/weight endpoint (``SCHEMAS[endpoint]``) -> dict with every field (defaults filled).
    Unknown keys go to ``on_unknown`` for SGLang's endpoints, are a 400 for ours (``EXTENSION_ENDPOINTS``)."""
    out = parse_object(body, SCHEMAS[endpoint], on_unknown=None if endpoint in EXTENSION_ENDPOINTS else on_unknown)
    if endpoint in ("update_weights_from_distributed", "update_weights_from_p2p"):
        n = len(out["names"])
        if not n == len(out["dtypes"]) == len(out["shapes"]):
            raise BadRequest(
                f"fields `names`/`dtypes`/`shapes` differ in length: {n}/{len(out['dtypes'])}/{len(out['shapes'])}"
            )
        out["dtypes"] = [d.removeprefix("torch.") for d in out["dtypes"]]
    if endpoint == "update_weights_from_p2p":
        if len(out["pieces"]) != len(out["names"]):
            raise BadRequest(f"field `pieces`: {len(out['pieces'])} entries for {len(out['names'])} names")
        out["pieces"] = [
            [(p[0], parse_box(p[1:], shape, f"pieces[{i}][{j}]", name)) for j, p in enumerate(ps)]
            for i, (name, shape, ps) in enumerate(zip(out["names"], out["shapes"], out["pieces"]))
        ]
        if out.get("tp_pieces") is not None:
            if len(out["tp_pieces"]) != len(out["names"]):
                raise BadRequest(f"field `tp_pieces`: {len(out['tp_pieces'])} entries for {len(out['names'])} names")
            out["tp_pieces"] = [
                [[(p[0], parse_box(p[1:], shape, f"tp_pieces[{i}][{r}][{j}]", name)) for j, p in enumerate(ps)]
                 for r, ps in enumerate(ranks)]
                for i, (name, shape, ranks) in enumerate(zip(out["names"], out["shapes"], out["tp_pieces"]))
            ]  # fmt: skip
    if endpoint == "weights_piece_checksums":
        if len(out["boxes"]) != len(out["names"]):
            raise BadRequest(f"field `boxes`: {len(out['boxes'])} entries for {len(out['names'])} names")
    if endpoint == "init_weights_update_group" and not out["rank_offset"] < out["world_size"]:
        raise BadRequest(f"field `rank_offset`: {out['rank_offset']} is not a rank of a {out['world_size']}-rank group")
    if endpoint == "init_weights_update_group" and not 0 < out["master_port"] < 65536:
        raise BadRequest(f"field `master_port`: {out['master_port']} is not a TCP port")
    return out
