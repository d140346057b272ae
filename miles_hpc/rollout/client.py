"""Async HTTP client of one engine server: our embedded engine or real SGLang (stage: rollout, client side).

One :class:`EngineClient` per engine URL, over an aiohttp session. Bodies come from :mod:`.requests` (pure, checked
against SGLang's own request types), answers are parsed by :mod:`.responses` into typed records.

Invariants:
- The client never re-sends a request that may have reached the engine unless the endpoint is idempotent: a failure
  to *connect* (refused, DNS, connect timeout) is retried with backoff, ``connect_retries`` times; a connection that
  breaks after the request went out is retried only for idempotent endpoints (health, info, pause, ...), never for
  ``/generate`` or a weight update. Resubmitting a generation elsewhere is the router's decision, not the client's.
- Every failure is an :class:`EngineError` whose message names the engine URL, the endpoint and, for HTTP errors, the
  server's own message; the API keys appear in no message, repr or log.
- Admin endpoints (weights, pause/continue, abort, flush, version) carry the admin key when one is set, else the
  plain key (SGLang's ADMIN_OPTIONAL rule); the others carry the plain key. ``/health*`` and ``/metrics`` need none.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import aiohttp

from miles_hpc.rollout import requests as rq
from miles_hpc.rollout.errors import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeoutError,
    EngineUnreachableError,
    server_message,
)
from miles_hpc.rollout.responses import (
    GenerateOutput,
    WeightsChecksums,
    parse_generate,
    parse_prometheus,
    parse_weights_checksums,
)

__all__ = [
    "EngineClient",
    "EngineError",
    "EngineHTTPError",
    "EngineProtocolError",
    "EngineTimeoutError",
    "EngineUnreachableError",
]

# aiohttp >= 3.10 tells a connect timeout (nothing was sent: safe to retry) from a read timeout.
_CONNECT_TIMEOUT: tuple[type[BaseException], ...] = (
    (aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()
)


class EngineClient:
    """Async client of one SGLang-compatible engine. Use as ``async with EngineClient(url) as c: ...`` or call
    :meth:`close`; a ``session`` passed in is shared and not closed here."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout: float = 600.0,
        admin_timeout: float | None = None,
        connect_timeout: float = 10.0,
        connect_retries: int = 3,
        retry_backoff_s: float = 0.2,
        session: aiohttp.ClientSession | None = None,
        max_connections: int = 4096,
        routing_shape: tuple[int | None, int | None] | None = None,
        indexer_shape: tuple[int, int] | None = None,
    ) -> None:
        """``timeout``: seconds for one request end to end (a long generation included); ``admin_timeout``: the
        same for an admin call (pause, continue, weight-update group and transfers, checksums) when the caller gives
        none, so a hung engine cannot hold a weight sync for a generation's timeout (None: ``timeout``);
        ``routing_shape``:
        ``(num_layers, top_k)`` of the model for decoding routed experts, either may be None (then looked up once
        from ``/get_model_info`` or the model's ``config.json``); ``indexer_shape``: ``(indexer_layers,
        index_topk)`` for decoding indexer records (None: looked up once from our engine's ``/get_model_info``)."""
        self.url = url.rstrip("/")
        self._api_key = api_key
        self._admin_key = admin_api_key
        self.timeout = timeout
        self.admin_timeout = admin_timeout
        self.connect_timeout = connect_timeout
        self.connect_retries = connect_retries
        self.retry_backoff_s = retry_backoff_s
        self._session = session
        self._owns_session = session is None
        self._max_connections = max_connections
        self._routing_dims = routing_shape
        self._routing_lock = asyncio.Lock()  # the first routed generations look the model up once, not each
        self._indexer_dims = indexer_shape

    def __repr__(self) -> str:  # never the keys
        return f"EngineClient({self.url!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # The default pool caps at 100 connections per host; a rollout keeps thousands of generations open.
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0)
            self._session = aiohttp.ClientSession(connector=connector)
            self._owns_session = True
        return self._session

    def _headers(self, ep: rq.Endpoint) -> dict[str, str]:
        key = (self._admin_key or self._api_key) if ep.admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _call(
        self,
        ep: rq.Endpoint,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        expect: Literal["json", "text"] = "json",
    ) -> Any:
        """Send one request, retrying only where nothing can have run twice (module invariants)."""
        where = f"{ep.method} {ep.path}"
        if timeout is not None:
            total = timeout
        else:
            total = self.admin_timeout if ep.admin and self.admin_timeout is not None else self.timeout
        client_timeout = aiohttp.ClientTimeout(total=total, connect=min(self.connect_timeout, total))
        retries = self.connect_retries if retries is None else retries
        attempt = 0
        while True:
            try:
                async with self._http().request(
                    ep.method,
                    self.url + ep.path,
                    json=body,
                    params=params,
                    headers=self._headers(ep),
                    timeout=client_timeout,
                ) as resp:
                    raw = await resp.read()
                    text = raw.decode("utf-8", errors="replace")
                    if resp.status >= 400:
                        raise EngineHTTPError(self.url, where, resp.status, server_message(text))
                    if expect == "text":
                        return text
                    try:
                        obj = json.loads(raw) if raw.strip() else None
                    except ValueError as e:
                        raise EngineProtocolError(self.url, where, f"answer is not JSON ({e}): {text[:200]}") from e
                    if isinstance(obj, dict) and obj.get("success") is False:
                        raise EngineHTTPError(self.url, where, resp.status, server_message(text))
                    return obj
            except EngineError:
                raise
            except _CONNECT_TIMEOUT as e:
                failure: EngineError = EngineUnreachableError(
                    self.url, where, f"connect timed out after {self.connect_timeout:g} s", sent=False
                )
                cause: BaseException = e
                may_retry = True
            except aiohttp.ClientConnectorError as e:  # refused / unresolvable: the request never left
                failure = EngineUnreachableError(self.url, where, f"cannot connect: {e.os_error or e}", sent=False)
                cause, may_retry = e, True
            except (TimeoutError, aiohttp.ServerTimeoutError) as e:
                raise EngineTimeoutError(self.url, where, f"no answer within {total:g} s") from e
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                # Reset or closed after sending: the engine may have run it (or died running it).
                failure = EngineUnreachableError(
                    self.url, where, f"connection lost: {type(e).__name__}: {e}".rstrip(": "), sent=True
                )
                cause, may_retry = e, ep.idempotent
            if not may_retry or attempt >= retries:
                raise failure from cause
            # Exponential backoff with jitter so many clients of one restarting engine do not reconnect in lockstep.
            await asyncio.sleep(self.retry_backoff_s * (2**attempt) * (0.5 + random.random()))
            attempt += 1

    # ---------------------------------------------------------------------------------------------------------
    # Generation and control.

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int | None = None,
        return_indexer_topk: bool = False,
        indexer_topk_start_len: int | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
        timeout: float | None = None,
    ) -> GenerateOutput:
        """``POST /generate`` for one prompt. A ``rid`` is made up when not given, so :meth:`abort` can reach it.
        ``return_indexer_topk``: DSA indexer records, our engine's extension (requests.EXTENSION_FIELDS)."""
        rid = rid or uuid.uuid4().hex
        body = rq.generate_body(
            input_ids,
            sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
            return_indexer_topk=return_indexer_topk,
            indexer_topk_start_len=indexer_topk_start_len,
            lora_path=lora_path,
        )
        dims = await self._routing_shape() if return_routed_experts else (None, None)
        index_dims = await self._indexer_shape() if return_indexer_topk else None
        obj = await self._call(rq.GENERATE, body, timeout=timeout)
        try:
            out = parse_generate(
                obj,
                return_logprob=return_logprob,
                return_routed_experts=return_routed_experts,
                routed_experts_start_len=routed_experts_start_len or 0,
                routing_dims=dims,
                return_indexer_topk=return_indexer_topk,
                indexer_topk_start_len=indexer_topk_start_len or 0,
                indexer_dims=index_dims,
                engine_url=self.url,
            )
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise EngineProtocolError(self.url, "POST /generate", f"bad answer for rid {rid}: {e}") from e
        return out if out.rid else replace(out, rid=rid)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False, timeout: float | None = None) -> None:
        """``POST /abort_request``: one request (``rid``) or all (``abort_all=True``); unknown rids are ignored."""
        await self._call(rq.ABORT, rq.abort_body(rid, abort_all=abort_all), timeout=timeout)

    async def pause(self, mode: rq.PauseMode = "abort") -> None:
        """``POST /pause_generation``: abort | retract | in_place (SGLang's modes; docs/engine.md)."""
        await self._call(rq.PAUSE, rq.pause_body(mode))

    async def continue_generation(self) -> None:
        await self._call(rq.CONTINUE, rq.continue_body())

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """``POST /flush_cache``; fails (HTTP 400) while requests run unless they drain within ``timeout_s``."""
        await self._call(rq.FLUSH_CACHE, None, params=rq.flush_cache_query(timeout_s), expect="text")

    async def health(self, *, timeout: float | None = None, retries: int | None = None) -> None:
        """``GET /health``: returns when the engine answers 200, raises :class:`EngineError` otherwise."""
        await self._call(rq.HEALTH, timeout=timeout, retries=retries, expect="text")

    async def health_generate(self, *, timeout: float | None = None, retries: int | None = None) -> None:
        """``GET /health_generate``: like :meth:`health`, but the engine proves it can still generate a token."""
        await self._call(rq.HEALTH_GENERATE, timeout=timeout, retries=retries, expect="text")

    async def server_info(self) -> dict[str, Any]:
        return await self._json_object(rq.SERVER_INFO)

    async def model_info(self) -> dict[str, Any]:
        return await self._json_object(rq.MODEL_INFO)

    async def metrics(self) -> dict[str, float]:
        """``GET /metrics`` as ``{name or name{labels}: value}`` (SGLang needs ``--enable-metrics``)."""
        text = await self._call(rq.METRICS, expect="text")
        try:
            return parse_prometheus(text)
        except (ValueError, IndexError) as e:
            raise EngineProtocolError(self.url, "GET /metrics", f"not Prometheus text: {e}") from e

    async def _json_object(self, ep: rq.Endpoint, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        obj = await self._call(ep, body)
        if not isinstance(obj, dict):
            raise EngineProtocolError(self.url, f"{ep.method} {ep.path}", f"expected a JSON object, got {obj!r}"[:300])
        return obj

    # ---------------------------------------------------------------------------------------------------------
    # Weights.

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        await self._call(
            rq.UPDATE_WEIGHT_VERSION, rq.update_weight_version_body(new_version, abort_all_requests=abort_all_requests)
        )

    async def weights_checksums(self, *, skip_tensor_list: Sequence[str] | None = None) -> WeightsChecksums:
        """``POST /weights_checker {"action": "checksum"}``: per-rank, per-tensor checksums."""
        obj = await self._call(
            rq.WEIGHTS_CHECKER, rq.weights_checker_body("checksum", skip_tensor_list=skip_tensor_list)
        )
        try:
            return parse_weights_checksums(obj)
        except (ValueError, AttributeError, TypeError) as e:
            raise EngineProtocolError(self.url, "POST /weights_checker", str(e)) from e

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = rq.DEFAULT_GROUP,
        backend: str = "nccl",
    ) -> str:
        body = rq.init_weights_update_group_body(
            master_address, master_port, rank_offset, world_size, group_name=group_name, backend=backend
        )
        return _message(await self._call(rq.INIT_WEIGHTS_UPDATE_GROUP, body))

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[object],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = rq.DEFAULT_GROUP,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
    ) -> str:
        """Announce one bucket; returns when the engine has received it over the group (the caller broadcasts
        concurrently, so run this as a task)."""
        body = rq.update_weights_from_distributed_body(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        return _message(await self._call(rq.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body))

    async def update_weights_from_disk(
        self,
        model_path: str | Path,
        *,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
    ) -> str:
        body = rq.update_weights_from_disk_body(
            str(model_path),
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        return _message(await self._call(rq.UPDATE_WEIGHTS_FROM_DISK, body))

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
        timeout: float | None = None,
    ) -> str:
        """One update part by tensor handles or bytes, one entry per TP rank (``sync/strategies/colocated.py`` builds them)."""
        body = rq.update_weights_from_tensor_body(
            serialized_named_tensors,
            load_format=load_format,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        return _message(await self._call(rq.UPDATE_WEIGHTS_FROM_TENSOR, body, timeout=timeout))

    async def update_weights_from_delta(
        self,
        manifest_path: str | Path,
        *,
        base_version: str | None,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        timeout: float | None = None,
    ) -> str:
        """Our extension (embedded engine only): apply the version written under ``manifest_path`` by the delta
        strategy (``sync/strategies/delta.py``); ``base_version`` None for a manifest of full tensors."""
        body = rq.update_weights_from_delta_body(
            str(manifest_path), base_version=base_version, weight_version=weight_version, flush_cache=flush_cache
        )
        return _message(await self._call(rq.EXTENSIONS["update_weights_from_delta"], body, timeout=timeout))

    async def update_weights_from_p2p(
        self,
        names: Sequence[str],
        dtypes: Sequence[object],
        shapes: Sequence[Sequence[int]],
        pieces: Sequence[Sequence[Sequence[int]]],
        *,
        group_name: str = rq.DEFAULT_GROUP,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        tp_pieces: Sequence[Sequence[Sequence[Sequence[int]]]] | None = None,
    ) -> str:
        """Our extension (embedded engine only): announce one bucket the trainer ranks send point-to-point (the
        p2p strategy, ``sync/strategies/p2p.py``); returns when the engine has received and applied it."""
        body = rq.update_weights_from_p2p_body(
            names,
            dtypes,
            shapes,
            pieces,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            tp_pieces=tp_pieces,
        )
        return _message(await self._call(rq.EXTENSIONS["update_weights_from_p2p"], body))

    async def weights_piece_checksums(
        self, names: Sequence[str], boxes: Sequence[Sequence[Sequence[int]]]
    ) -> dict[str, str]:
        """Our extension: ``sync.wire.checksum.piece_key`` -> checksum of each box of each named tensor."""
        obj = await self._call(rq.EXTENSIONS["weights_piece_checksums"], rq.weights_piece_checksums_body(names, boxes))
        sums = obj.get("checksums") if isinstance(obj, dict) else None
        if not isinstance(sums, dict):
            raise EngineProtocolError(self.url, "POST /weights_piece_checksums", f"no checksums in {str(obj)[:200]}")
        return {str(k): str(v) for k, v in sums.items()}

    async def destroy_weights_update_group(self, group_name: str = rq.DEFAULT_GROUP) -> str:
        return _message(
            await self._call(rq.DESTROY_WEIGHTS_UPDATE_GROUP, rq.destroy_weights_update_group_body(group_name))
        )

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str | Path, *, pinned: bool | None = None
    ) -> dict[str, str]:
        """Serve the PEFT adapter at `lora_path` (on the engine's file system) as `lora_name`; returns the adapters
        loaded now (name -> path). A refusal raises `EngineProtocolError` with the engine's message."""
        body = rq.load_lora_adapter_body(lora_name, str(lora_path), pinned=pinned)
        return self._lora_answer(await self._call(rq.LOAD_LORA_ADAPTER, body), "POST /load_lora_adapter")

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        obj = await self._call(rq.UNLOAD_LORA_ADAPTER, rq.unload_lora_adapter_body(lora_name))
        return self._lora_answer(obj, "POST /unload_lora_adapter")

    async def lora_adapter_checksums(self, lora_name: str) -> dict[str, str]:
        """Our engine's extension: PEFT name -> checksum of each tensor of a loaded adapter."""
        obj = await self._call(rq.EXTENSIONS["lora_adapter_checksums"], {"lora_name": lora_name})
        sums = obj.get("checksums") if isinstance(obj, dict) else None
        if not isinstance(sums, dict):
            raise EngineProtocolError(self.url, "POST /lora_adapter_checksums", f"no checksums in {str(obj)[:200]}")
        return {str(k): str(v) for k, v in sums.items()}

    async def weights_ipc_handles(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Our engine's extension (engine/direct_weights.py): {instance, payload, entries} of its parameters."""
        obj = await self._call(rq.EXTENSIONS["weights_ipc_handles"], {}, timeout=timeout)
        if not isinstance(obj, dict) or not all(k in obj for k in ("instance", "payload", "entries")):
            raise EngineProtocolError(self.url, "POST /weights_ipc_handles", f"unexpected answer {str(obj)[:200]}")
        return obj

    async def weights_direct_begin(self) -> str:
        """Our engine's extension: a direct weight write begins (engine paused); returns the engine's instance id."""
        obj = await self._call(rq.EXTENSIONS["weights_direct_begin"], {})
        if not isinstance(obj, dict) or not isinstance(obj.get("instance"), str):
            raise EngineProtocolError(self.url, "POST /weights_direct_begin", f"no instance in {str(obj)[:200]}")
        return obj["instance"]

    async def weights_direct_commit(
        self, *, weight_version: str | None, flush_cache: bool = True, timeout: float | None = None
    ) -> str:
        """Our engine's extension: the direct write is complete; name the weights `weight_version`."""
        body: dict[str, Any] = {"flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return _message(await self._call(rq.EXTENSIONS["weights_direct_commit"], body, timeout=timeout))

    def _lora_answer(self, obj: Any, what: str) -> dict[str, str]:
        """SGLang's LoRA answer: {success, error_message, loaded_adapters}."""
        if not isinstance(obj, dict) or not obj.get("success", False):
            why = obj.get("error_message") if isinstance(obj, dict) else obj
            raise EngineProtocolError(self.url, what, f"refused: {str(why)[:300]}")
        loaded = obj.get("loaded_adapters") or {}
        return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}

    # ---------------------------------------------------------------------------------------------------------

    async def _routing_shape(self) -> tuple[int | None, int | None]:
        """``(num_layers, top_k)`` for decoding routed experts, looked up once. SGLang's /get_model_info does not
        carry them, so fall back to the checkpoint's config.json (on a shared file system, as on HPC clusters)."""
        async with self._routing_lock:
            if self._routing_dims is None:
                self._routing_dims = await self._lookup_routing_shape()
        return self._routing_dims

    async def _lookup_routing_shape(self) -> tuple[int | None, int | None]:
        info = await self.model_info()
        layers = info.get("num_moe_layers") or info.get("num_hidden_layers")
        top_k = info.get("num_experts_per_tok") or info.get("top_k")
        if top_k is None and layers is None:
            try:
                cfg = json.loads((Path(str(info.get("model_path", ""))) / "config.json").read_text())
            except (OSError, ValueError):
                cfg = {}
            # Only top_k: the layer count then follows from the answer's size, which fits SGLang (every layer)
            # and engines that send MoE layers only.
            top_k = cfg.get("text_config", cfg).get("num_experts_per_tok")
        if top_k is None and layers is None:
            raise EngineProtocolError(
                self.url,
                "GET /get_model_info",
                "cannot tell the model's MoE top_k to decode routed_experts; pass routing_shape=(layers, top_k)",
            )
        return layers, top_k

    async def _indexer_shape(self) -> tuple[int, int]:
        """``(indexer_layers, index_topk)`` for decoding indexer records, looked up once from /get_model_info (our
        engine's ``num_indexer_layers``, ``index_topk``)."""
        async with self._routing_lock:
            if self._indexer_dims is None:
                info = await self.model_info()
                layers, topk = info.get("num_indexer_layers"), info.get("index_topk")
                if not (isinstance(layers, int) and isinstance(topk, int) and layers > 0 and topk > 0):
                    raise EngineProtocolError(
                        self.url,
                        "GET /get_model_info",
                        "no num_indexer_layers/index_topk: not our engine serving a DSA model, so it returns no "
                        "indexer_topk (pass indexer_shape=(layers, index_topk) to decode one that does)",
                    )
                self._indexer_dims = (layers, topk)
        return self._indexer_dims


def _message(obj: Any) -> str:
    return str(obj.get("message", "")) if isinstance(obj, dict) else ""
