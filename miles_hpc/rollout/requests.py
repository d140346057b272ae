"""Request bodies of the SGLang HTTP API that RL uses, as pure functions (stage: rollout, client side).

Every body the :class:`~miles_hpc.rollout.client.EngineClient` sends is built here and nowhere else, so one module
states the wire contract and ``tests/sglang_schema_check.py`` can check it against SGLang's own definitions. This
module imports only the standard library: the check runs in SGLang's venv, where our dependencies are not installed.

Invariants:
- A body holds only field names of the matching SGLang request type (``GenerateReqInput``, the ``io_struct``
  ``*ReqInput`` structs). Over HTTP SGLang ignores a top-level key it does not know (so would our engine): a
  misspelt field would silently do nothing, and unknown ``sampling_params`` keys are a 400 on both. The exception
  is :data:`EXTENSION_FIELDS` (DSA indexer replay), set only when a caller asks for indexer records, which only our
  embedded engine returns (the run config refuses ``algo.indexer_replay`` with ``rollout.backend=sglang``).
- A field is present only when the caller set it (``None`` = absent = SGLang's default), except where a comment
  says why we pin a value SGLang would otherwise default dangerously.
- ``sampling_params`` keys are a subset of :data:`SAMPLING_KEYS`, which SGLang's ``SamplingParams`` accepts.
- Values are plain JSON types (Python ``int``/``float``/``str``/``bool``/``list``/``dict``), never numpy scalars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

PauseMode = Literal["abort", "retract", "in_place"]

# SGLang's SamplingParams keys a rollout may set. Left out on purpose: ``n`` and ``beam_width`` (they turn the
# response into a list; RL sends one request per sample so the router can place and track each), ``stream_interval``
# (we never stream), ``watermark``. ``stop``/``stop_regex``/grammar keys are allowed but make a generation
# un-chunkable (router.py).
SAMPLING_KEYS: frozenset[str] = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HTTP route: how the client calls it and what a failure allows."""

    method: Literal["GET", "POST"]
    path: str
    admin: bool  # SGLang's ADMIN_OPTIONAL level: needs the admin key when the server has one
    # Safe to send twice: a retry after the connection broke *after* sending may not double an effect.
    idempotent: bool


# SGLang's scheduler cuts max_new_tokens to min(context, KV tokens) - prompt - 2 (`init_req_max_new_tokens`), as our
# engine does (engine/protocol.py): a prompt gets its full max_new_tokens only with these 2 tokens to spare.
ENGINE_RESERVED_TOKENS = 2

GENERATE = Endpoint("POST", "/generate", admin=False, idempotent=False)
ABORT = Endpoint("POST", "/abort_request", admin=True, idempotent=True)
PAUSE = Endpoint("POST", "/pause_generation", admin=True, idempotent=True)
CONTINUE = Endpoint("POST", "/continue_generation", admin=True, idempotent=True)
FLUSH_CACHE = Endpoint("POST", "/flush_cache", admin=True, idempotent=True)
HEALTH = Endpoint("GET", "/health", admin=False, idempotent=True)
HEALTH_GENERATE = Endpoint("GET", "/health_generate", admin=False, idempotent=True)
# The /get_* spellings: docs/design.md's contract for our engine; SGLang 0.5.23 serves them too (deprecated aliases of
# /server_info and /model_info, with a log line per call).
SERVER_INFO = Endpoint("GET", "/get_server_info", admin=False, idempotent=True)
MODEL_INFO = Endpoint("GET", "/get_model_info", admin=False, idempotent=True)
METRICS = Endpoint("GET", "/metrics", admin=False, idempotent=True)
UPDATE_WEIGHT_VERSION = Endpoint("POST", "/update_weight_version", admin=True, idempotent=True)
WEIGHTS_CHECKER = Endpoint("POST", "/weights_checker", admin=True, idempotent=True)
INIT_WEIGHTS_UPDATE_GROUP = Endpoint("POST", "/init_weights_update_group", admin=True, idempotent=False)
UPDATE_WEIGHTS_FROM_DISTRIBUTED = Endpoint("POST", "/update_weights_from_distributed", admin=True, idempotent=False)
UPDATE_WEIGHTS_FROM_DISK = Endpoint("POST", "/update_weights_from_disk", admin=True, idempotent=False)
UPDATE_WEIGHTS_FROM_TENSOR = Endpoint("POST", "/update_weights_from_tensor", admin=True, idempotent=False)
DESTROY_WEIGHTS_UPDATE_GROUP = Endpoint("POST", "/destroy_weights_update_group", admin=True, idempotent=False)
LOAD_LORA_ADAPTER = Endpoint("POST", "/load_lora_adapter", admin=True, idempotent=False)
UNLOAD_LORA_ADAPTER = Endpoint("POST", "/unload_lora_adapter", admin=True, idempotent=False)

# Routes only the embedded engine serves (our extensions, docs/engine.md). Kept out of the module-level Endpoint
# constants above: tests/sglang_schema_check.py checks each of those against SGLang's own app.
EXTENSIONS: dict[str, Endpoint] = {
    "update_weights_from_delta": Endpoint("POST", "/update_weights_from_delta", admin=True, idempotent=False),
    "update_weights_from_p2p": Endpoint("POST", "/update_weights_from_p2p", admin=True, idempotent=False),
    "weights_piece_checksums": Endpoint("POST", "/weights_piece_checksums", admin=True, idempotent=True),
    "lora_adapter_checksums": Endpoint("POST", "/lora_adapter_checksums", admin=True, idempotent=True),
    "weights_ipc_handles": Endpoint("POST", "/weights_ipc_handles", admin=True, idempotent=True),
    "weights_direct_begin": Endpoint("POST", "/weights_direct_begin", admin=True, idempotent=False),
    "weights_direct_commit": Endpoint("POST", "/weights_direct_commit", admin=True, idempotent=False),
}

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name

# ``/generate`` fields of our embedded engine that are not in the SGLang schema we check against (docs/engine.md).
EXTENSION_FIELDS: frozenset[str] = frozenset({"return_indexer_topk", "indexer_topk_start_len"})


def _set(body: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        body[key] = value


def _set_start(body: dict[str, Any], key: str, start: int | None, prompt_len: int) -> None:
    """A records' start position (routing rows, indexer rows): within the prompt, or absent."""
    if start is not None:
        if not 0 <= start <= prompt_len:
            raise ValueError(f"{key} must be in [0, {prompt_len}], got {start}")
        body[key] = start


def _ints(values: Sequence[int], what: str) -> list[int]:
    # int() also turns numpy/torch integer scalars into JSON ints; bool is rejected (it is an int subclass).
    out = []
    for v in values:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{what} must hold integers, got {type(v).__name__}: {v!r}")
        out.append(int(v))
    return out


def sampling_params_body(params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` without ``None`` values; unknown keys raise ``ValueError`` naming them."""
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"sampling_params: unknown key(s) {unknown}; SGLang accepts {sorted(SAMPLING_KEYS)}")
    out = {k: v for k, v in params.items() if v is not None}
    if "stop_token_ids" in out:
        out["stop_token_ids"] = _ints(out["stop_token_ids"], "sampling_params.stop_token_ids")
    return out


def generate_body(
    input_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    *,
    rid: str | None = None,
    return_logprob: bool = False,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_routed_experts: bool = False,
    routed_experts_start_len: int | None = None,
    return_indexer_topk: bool = False,
    indexer_topk_start_len: int | None = None,
    lora_path: str | None = None,
) -> dict[str, Any]:
    """``POST /generate`` (``GenerateReqInput``), one prompt given as token ids. ``return_indexer_topk`` (with its
    start, as ``routed_experts_start_len``): our engine's extension (:data:`EXTENSION_FIELDS`)."""
    ids = _ints(input_ids, "input_ids")
    if not ids:
        raise ValueError("input_ids must not be empty")
    body: dict[str, Any] = {}
    _set(body, "rid", rid)
    body["input_ids"] = ids
    body["sampling_params"] = sampling_params_body(sampling_params)
    if return_logprob:
        body["return_logprob"] = True
        _set(body, "logprob_start_len", logprob_start_len)
        _set(body, "top_logprobs_num", top_logprobs_num)
    if return_routed_experts:
        body["return_routed_experts"] = True
        _set_start(body, "routed_experts_start_len", routed_experts_start_len, len(ids))
    if return_indexer_topk:
        body["return_indexer_topk"] = True
        _set_start(body, "indexer_topk_start_len", indexer_topk_start_len, len(ids))
    _set(body, "lora_path", lora_path)
    return body


def abort_body(rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
    """``POST /abort_request`` (``AbortReq``): one request by id, or every request."""
    if (rid is None) == (not abort_all):
        raise ValueError("abort: give exactly one of rid or abort_all=True")
    return {"abort_all": True} if abort_all else {"rid": rid}


def pause_body(mode: PauseMode) -> dict[str, Any]:
    """``POST /pause_generation`` (``PauseGenerationReqInput``)."""
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be abort|retract|in_place, got {mode!r}")
    return {"mode": mode}


def continue_body() -> dict[str, Any]:
    """``POST /continue_generation`` (``ContinueGenerationReqInput``): SGLang's defaults."""
    return {}


def flush_cache_query(timeout_s: float | None = None) -> dict[str, str]:
    """``POST /flush_cache``: no body; SGLang reads an optional ``timeout`` query parameter (seconds to wait for
    running requests to drain; 0 = fail at once if any run)."""
    return {} if timeout_s is None else {"timeout": repr(float(timeout_s))}


def update_weight_version_body(new_version: str, *, abort_all_requests: bool = False) -> dict[str, Any]:
    """``POST /update_weight_version`` (``UpdateWeightVersionReqInput``).

    ``abort_all_requests`` is always sent: SGLang defaults it to True, which would abort every in-flight rollout
    (silently losing partial samples under in_place/retract pauses); a caller that wants that says so.
    """
    return {"new_version": str(new_version), "abort_all_requests": bool(abort_all_requests)}


def weights_checker_body(action: str = "checksum", *, skip_tensor_list: Sequence[str] | None = None) -> dict[str, Any]:
    """``POST /weights_checker`` (``CheckWeightsReqInput``)."""
    body: dict[str, Any] = {"action": action}
    if skip_tensor_list is not None:
        body["skip_tensor_list"] = list(skip_tensor_list)
    return body


def init_weights_update_group_body(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    *,
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
) -> dict[str, Any]:
    """``POST /init_weights_update_group`` (``InitWeightsUpdateGroupReqInput``)."""
    return {
        "master_address": str(master_address),
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` -> ``"bfloat16"`` (SGLang's spelling), without importing torch."""
    return str(dtype).removeprefix("torch.")


def update_weights_from_distributed_body(
    names: Sequence[str],
    dtypes: Sequence[object],
    shapes: Sequence[Sequence[int]],
    *,
    group_name: str = DEFAULT_GROUP,
    weight_version: str | None = None,
    flush_cache: bool | None = None,
    abort_all_requests: bool | None = None,
    load_format: str | None = None,
) -> dict[str, Any]:
    """``POST /update_weights_from_distributed`` (``UpdateWeightsFromDistributedReqInput``): announces one bucket
    that the trainer then broadcasts over the group."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    body: dict[str, Any] = {
        "names": [str(n) for n in names],
        "dtypes": [dtype_name(d) for d in dtypes],
        "shapes": [_ints(s, f"shape of {n}") for n, s in zip(names, shapes)],
        "group_name": group_name,
    }
    _set(body, "flush_cache", flush_cache)
    _set(body, "abort_all_requests", abort_all_requests)
    _set(body, "weight_version", None if weight_version is None else str(weight_version))
    _set(body, "load_format", load_format)
    return body


def update_weights_from_disk_body(
    model_path: str,
    *,
    weight_version: str | None = None,
    flush_cache: bool | None = None,
    abort_all_requests: bool | None = None,
    load_format: str | None = None,
    keep_pause: bool | None = None,
) -> dict[str, Any]:
    """``POST /update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``)."""
    body: dict[str, Any] = {"model_path": str(model_path)}
    _set(body, "load_format", load_format)
    _set(body, "abort_all_requests", abort_all_requests)
    _set(body, "weight_version", None if weight_version is None else str(weight_version))
    _set(body, "flush_cache", flush_cache)
    _set(body, "keep_pause", keep_pause)
    return body


def update_weights_from_tensor_body(
    serialized_named_tensors: Sequence[str],
    *,
    load_format: str | None = None,
    weight_version: str | None = None,
    flush_cache: bool | None = None,
    abort_all_requests: bool | None = None,
) -> dict[str, Any]:
    """``POST /update_weights_from_tensor`` (``UpdateWeightsFromTensorReqInput``): one base64 string per TP rank
    (SGLang: a ``MultiprocessingSerializer`` pickle of ``[(name, tensor)]``; docs/engine.md for the embedded engine)."""
    if not serialized_named_tensors or not all(isinstance(x, str) for x in serialized_named_tensors):
        raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank")
    body: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors)}
    _set(body, "load_format", load_format)
    _set(body, "flush_cache", flush_cache)
    _set(body, "abort_all_requests", abort_all_requests)
    _set(body, "weight_version", None if weight_version is None else str(weight_version))
    return body


def update_weights_from_p2p_body(
    names: Sequence[str],
    dtypes: Sequence[object],
    shapes: Sequence[Sequence[int]],
    pieces: Sequence[Sequence[Sequence[int]]],
    *,
    group_name: str = DEFAULT_GROUP,
    weight_version: str | None = None,
    flush_cache: bool | None = None,
    tp_pieces: Sequence[Sequence[Sequence[Sequence[int]]]] | None = None,
) -> dict[str, Any]:
    """``POST /update_weights_from_p2p`` (our extension, docs/engine.md): one bucket that the trainer ranks send
    point-to-point; ``pieces[i]`` lists what arrives of ``names[i]``, each ``[trainer rank, lo0, hi0, lo1, ...]``,
    in the order the sends are posted. A tensor-parallel engine: ``tp_pieces[i][r]`` lists what TP rank ``r``
    receives, its dims within that rank's part of the tensor (``pieces`` is then rank 0's)."""
    body = update_weights_from_distributed_body(
        names, dtypes, shapes, group_name=group_name, weight_version=weight_version, flush_cache=flush_cache
    )
    if len(pieces) != len(names):
        raise ValueError(f"pieces has {len(pieces)} entries for {len(names)} names")
    body["pieces"] = [[_ints(p, f"piece of {n}") for p in ps] for n, ps in zip(names, pieces)]
    if tp_pieces is not None:
        if len(tp_pieces) != len(names):
            raise ValueError(f"tp_pieces has {len(tp_pieces)} entries for {len(names)} names")
        body["tp_pieces"] = [
            [[_ints(p, f"piece of {n}") for p in ps] for ps in ranks] for n, ranks in zip(names, tp_pieces)
        ]
    return body


def weights_piece_checksums_body(names: Sequence[str], boxes: Sequence[Sequence[Sequence[int]]]) -> dict[str, Any]:
    """``POST /weights_piece_checksums`` (our extension): checksums of boxes of tensors, ``boxes[i]`` a list of
    ``[lo0, hi0, lo1, hi1, ...]`` of ``names[i]``."""
    if len(boxes) != len(names):
        raise ValueError(f"boxes has {len(boxes)} entries for {len(names)} names")
    return {
        "names": [str(n) for n in names],
        "boxes": [[_ints(b, f"box of {n}") for b in bs] for n, bs in zip(names, boxes)],
    }


def update_weights_from_delta_body(
    manifest_path: str,
    *,
    base_version: str | None,
    weight_version: str | None = None,
    flush_cache: bool | None = None,
    abort_all_requests: bool | None = None,
) -> dict[str, Any]:
    """``POST /update_weights_from_delta`` (our extension, docs/engine.md): apply the weight version whose manifest
    and payload files are in directory ``manifest_path``; ``base_version`` is the version the delta was coded
    against (None: the manifest holds full tensors)."""
    body: dict[str, Any] = {"manifest_path": str(manifest_path)}
    _set(body, "base_version", None if base_version is None else str(base_version))
    _set(body, "weight_version", None if weight_version is None else str(weight_version))
    _set(body, "flush_cache", flush_cache)
    _set(body, "abort_all_requests", abort_all_requests)
    return body


def destroy_weights_update_group_body(group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
    """``POST /destroy_weights_update_group`` (``DestroyWeightsUpdateGroupReqInput``)."""
    return {"group_name": group_name}


def load_lora_adapter_body(lora_name: str, lora_path: str, *, pinned: bool | None = None) -> dict[str, Any]:
    """``POST /load_lora_adapter`` (``LoadLoRAAdapterReqInput``)."""
    body: dict[str, Any] = {"lora_name": lora_name, "lora_path": str(lora_path)}
    _set(body, "pinned", pinned)
    return body


def unload_lora_adapter_body(lora_name: str) -> dict[str, Any]:
    """``POST /unload_lora_adapter`` (``UnloadLoRAAdapterReqInput``)."""
    return {"lora_name": lora_name}
