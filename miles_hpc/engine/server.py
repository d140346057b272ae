"""The embedded engine's HTTP server: SGLang's native endpoints over one `Engine` (aiohttp), and `serve()`.

Stage: engine (the only process-facing part of it). Rollout, trainer and launcher reach this server over HTTP and
process groups exactly as they reach real SGLang; request/response shapes live in protocol.py, auth rules in
miles_hpc/auth.py, the weight routes and the distributed weight receive in weight_receiver.py; the route table is
`EngineServer.app`.

Invariants:
- The event loop never waits for an engine step: on the loop it only calls what takes no step lock (`submit`,
  `resume`, stats/info); what waits for a step (abort, pause, weight updates, checksums, flush) runs in a worker
  thread, and results come back through `loop.call_soon_threadsafe`.
- Every request gets an answer and the server keeps serving: bad input -> 4xx JSON `{"error": {"message", "type",
  "code"}}` naming the field (a body that is not JSON, invalid UTF-8, nested deeper than the parser goes or with
  a number of more than 4300 digits: a 400 naming that); an unexpected exception -> 500 with the same shape;
  weight endpoints answer SGLang's `{"success", "message"}` (400 on failure).
- Pause lease (pause_lease.py): every admin call renews it; a pause that nothing continues or follows with a
  weight-sync call within `pause_lease_s` ends by itself (a warning, then generation continues), unless the
  weights are half-updated: then `/health` and `/health_generate` answer 503 naming that. While paused within the
  lease `/health_generate` answers 200 saying so (a paused engine cannot generate its probe token); otherwise it
  answers 200 once the engine makes progress (health.py: a busy engine is healthy). Both answer 503 naming the
  rank once a tensor-parallel rank has exited (the server stops within a second: tp.py `watch`).
- A top-level request key that no handler reads is ignored, as SGLang's server ignores it, with one warning per
  key name in the log (protocol.py says which keys are refused instead).
- A client that disconnects from `/generate` has its requests aborted (aiohttp handler cancellation).
- Weight endpoints (weight_receiver.WeightEndpoints) run one at a time, in arrival order.
- `serve()` listens only once the engine is loaded and started, then writes the rendezvous file (tmp + rename),
  so a rendezvous file always names a ready server; SIGTERM/SIGINT abort in-flight requests, close the port,
  stop the engine and remove the rendezvous file. Started by a launcher (``MILES_PARENT_PID``), it ends the same
  way when the launcher dies, even by SIGKILL (cluster/lease.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web

from miles_hpc import __version__
from miles_hpc.atomic import write_text_atomic
from miles_hpc.auth import ApiKeys, AuthLevel, decide, read_key
from miles_hpc.cluster.lease import parent_pid_from_env, watch_parent

from . import health, http_body, http_log, protocol
from .config import EngineConfig
from .core import Engine, RequestError
from .launch import EngineLaunch
from .pause_lease import PauseLease
from .protocol import BadRequest
from .tp import rank_device
from .types import GenerateRequest, GenerateResult
from .weight_receiver import WeightEndpoints, WeightReceiver

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to bind; 0.0.0.0 / :: binds all interfaces (the rendezvous file then names this host)."""
    port: int = 30000
    """TCP port (SGLang's default); 0 picks a free one (read it from the rendezvous file)."""
    keys: ApiKeys = field(default_factory=ApiKeys)
    """--api-key / --admin-api-key (miles_hpc/auth.py)."""
    max_request_bytes: int = 64 << 20
    """Largest request body (413 beyond), except /update_weights_from_tensor."""
    max_weights_request_bytes: int = 4 << 30
    """Largest /update_weights_from_tensor body (base64 safetensors of one bucket)."""
    body_idle_timeout_s: float = 60.0
    """A request body that sends no byte for this long fails with 408 (--request-body-timeout): a stalled client does
    not hold its handler for ever."""
    health_timeout_s: float = 20.0
    """/health_generate answers 503 when the engine completes no step for this long (SGLang's 20 s)."""
    weight_sync_timeout_s: float = 600.0
    """Joining a weight-update group and each broadcast in it fail after this long."""
    pause_lease_s: float | None = None
    """A pause with no admin call for this long ends by itself (pause_lease.py); None: `weight_sync_timeout_s`,
    0: no lease (a pause lasts until /continue_generation)."""
    shutdown_timeout_s: float = 10.0
    """On SIGTERM, how long open connections may take to finish after requests were aborted."""
    rendezvous: str | None = None
    """Where to write {host, port, pid, url, model_path, tp_size, gpu_ids} once listening."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if min(self.max_request_bytes, self.max_weights_request_bytes) <= 0:
            raise ValueError("max_request_bytes and max_weights_request_bytes must be > 0")
        if not 0 < self.body_idle_timeout_s < float("inf"):
            raise ValueError(
                f"body_idle_timeout_s (--request-body-timeout) must be > 0 seconds, got {self.body_idle_timeout_s}"
            )
        if self.pause_lease_s is not None and not 0 <= self.pause_lease_s < float("inf"):
            raise ValueError(f"pause_lease_s must be >= 0 seconds (0: no lease), got {self.pause_lease_s}")

    def lease_s(self) -> float | None:
        """The pause lease in seconds, None for none (see `pause_lease_s`)."""
        if self.pause_lease_s is None:
            return self.weight_sync_timeout_s
        return self.pause_lease_s or None


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": HTTPStatus(status).phrase, "code": status}}
    return web.json_response(body, status=status)


class EngineServer:
    """The aiohttp application around one started `Engine`."""

    def __init__(self, engine: Engine, config: ServerConfig, *, receiver: WeightReceiver | None = None) -> None:
        self.engine = engine
        self.config = config
        self.receiver = receiver or WeightReceiver(
            str(engine.device), timeout_s=config.weight_sync_timeout_s, tp=engine.tp
        )
        self.closing = False
        self.limits = protocol.ModelLimits(
            vocab_size=engine.vocab_size,
            max_context_len=engine.max_context_len,
            kv_capacity_tokens=engine.limits.kv_capacity_tokens,
        )
        self.lease = PauseLease(config.lease_s())
        self.pausing = asyncio.Lock()  # pause, continue and the lease's own continue: one at a time
        self.ignored: set[str] = set()  # unknown request keys already logged (`unknown_key`)
        self.weights = WeightEndpoints(
            engine,
            self.receiver,
            self._json,
            config.max_weights_request_bytes,
            lease=self.lease,
            on_unknown=self.unknown_key,
        )
        self._tokenizer = _load_tokenizer(engine.model_path)
        hf_config = Path(engine.model_path or "") / "config.json"
        self._architectures = json.loads(hf_config.read_text()).get("architectures") if hf_config.is_file() else None
        self.levels: dict[str, AuthLevel] = {}  # path -> auth level, filled by app(); unknown paths are NORMAL

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.config.max_weights_request_bytes)
        probes = {
            "/health": self.health,
            "/ready": self.health,
            "/health_generate": self.health_generate,
            "/metrics": self.metrics,
        }
        info = {
            "/get_server_info": self.server_info,
            "/server_info": self.server_info,
            "/get_model_info": self.model_info,
            "/model_info": self.model_info,
        }
        admin = {
            "/abort_request": self.abort_request,
            "/pause_generation": self.pause,
            "/continue_generation": self.resume,
            "/flush_cache": self.flush_cache,
            **self.weights.routes(),
            "/load_lora_adapter": self.load_lora_adapter,
            "/unload_lora_adapter": self.unload_lora_adapter,
            "/lora_adapter_checksums": self.lora_adapter_checksums,
        }  # the last: our extension
        for path, handler in {**probes, **info}.items():
            app.router.add_get(path, handler, allow_head=False)
        for path, handler in {"/generate": self.generate, **admin}.items():
            app.router.add_post(path, handler)
        app.router.add_put("/generate", self.generate)  # as SGLang's
        for path in ("/flush_cache", "/weights_checker"):  # GET too, as SGLang
            app.router.add_get(path, admin[path], allow_head=False)
        self.levels = {**{p: AuthLevel.OPEN for p in probes}, **{p: AuthLevel.ADMIN for p in admin}}
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        status = decide(
            self.levels.get(request.path, AuthLevel.NORMAL), request.headers.get("Authorization"), self.config.keys
        )
        if status is not None:
            return _error(status, "Unauthorized")
        if self.levels.get(request.path) is AuthLevel.ADMIN:
            with self.lease.hold():  # the controller is alive: a pause it made may last (pause_lease.py)
                return await self._answer(request, handler)
        return await self._answer(request, handler)

    async def _answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (BadRequest, RequestError) as e:
            return _error(400, str(e))
        except web.HTTPException as e:  # 404/405 from the router, 408 and 413 from _json
            return _error(e.status, e.text if e.status in (408, 413) else (e.reason or str(e)))
        except Exception as e:  # a bug: say so, log it, keep serving
            log.exception("%s %s failed", request.method, request.path)
            return _error(500, f"internal server error: {type(e).__name__}: {e}")

    def unknown_key(self, name: str) -> None:
        """A request key no handler reads: ignored, as SGLang ignores it, and logged once per name (at most 256
        names, so a client inventing keys cannot grow the set or the log without end)."""
        if name not in self.ignored and len(self.ignored) < 256:
            self.ignored.add(name)
            log.warning(
                "ignoring request field %r: not one this engine reads (SGLang ignores it too); logged once", name
            )

    async def _json(self, request: web.Request, limit: int | None = None) -> Any:
        """The request body as JSON, None when empty (http_body.read_json: 400, 408, 413)."""
        idle = self.config.body_idle_timeout_s
        return await http_body.read_json(request, limit or self.config.max_request_bytes, idle)

    # ------------------------------------------------------------------ generation
    async def generate(self, request: web.Request) -> web.Response:
        if self.closing:
            return _error(503, "the server is shutting down")
        body = await self._json(request)
        parsed = protocol.parse_generate(body, self.limits, lambda: uuid.uuid4().hex, self.unknown_key)
        results = await self._run(parsed.requests)
        failed = next((r.error for r in results if r.error is not None), None)
        if failed is not None:  # the engine's step broke (engine log has the traceback); it keeps serving
            return _error(500, failed)
        items = zip(parsed.requests, results, parsed.text)
        out = [protocol.generate_response(req, res, self._decode(res, text)) for req, res, text in items]
        return web.json_response(out if parsed.batched else out[0])

    async def _run(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """Submit and await every request; on failure or cancellation (client gone) abort those still running."""
        loop = asyncio.get_running_loop()
        futs: list[tuple[str, asyncio.Future[GenerateResult]]] = []
        try:
            for req in reqs:
                fut: asyncio.Future[GenerateResult] = loop.create_future()
                self.engine.submit(req, _resolver(loop, fut))
                futs.append((req.rid, fut))
            return list(await asyncio.gather(*(f for _, f in futs)))
        except BaseException:
            # gather() cancels its children when we are cancelled, so "not finished with a result" is the test.
            live = [rid for rid, f in futs if not f.done() or f.cancelled()]
            if live:
                loop.run_in_executor(None, self._abort_each, live)
            raise

    def _abort_each(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.abort(rid, message="client disconnected")

    def _decode(self, res: GenerateResult, options: protocol.TextOptions) -> str | None:
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode(protocol.text_ids(res, options), skip_special_tokens=options.skip_special_tokens)

    # ------------------------------------------------------------------ health and info
    def _unhealthy(self) -> str | None:
        """Why the engine cannot serve although its server answers: a tensor-parallel rank gone (the server is
        about to stop), or half-updated weights past the pause lease."""
        dead = self.engine.tp.dead_rank() if self.engine.tp is not None else None
        return dead or self.lease.stuck_reason(self.engine)

    async def health(self, request: web.Request) -> web.Response:
        if self.closing:
            return web.Response(status=503)
        stuck = self._unhealthy()
        return _error(503, stuck) if stuck else web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.closing:
            return web.Response(status=503)
        stuck = self._unhealthy()
        if stuck:
            return _error(503, stuck)
        if self.engine.paused:  # paused on purpose (weight sync): a 1-token request would wait, not fail
            left = self.lease.remaining_s()
            message = "generation is paused" + (
                " (weights half-updated: an update is in progress)" if self.engine.half_updated else ""
            )
            if left is not None and self.engine.half_updated:
                message += f"; with no weight-sync call in {left:.0f} s this engine is reported unhealthy"
            elif left is not None:
                message += f"; the pause ends by itself in {left:.0f} s unless continued or sent weights first"
            return web.json_response({"status": "paused", "message": message, "lease_remaining_s": left})
        failure = await health.check_progress(self.engine, self._run, self.config.health_timeout_s)
        if failure is not None:
            log.error("health check failed: %s", failure)
            return _error(503, failure)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        path = self.engine.model_path
        info = {
            "tokenizer_path": path if self._tokenizer else None,
            "served_model_name": path,
            "preferred_sampling_params": None,
            "architectures": self._architectures,
            **self.engine.model_info(),
        }
        return web.json_response(info)

    async def server_info(self, request: web.Request) -> web.Response:
        keys = self.config.keys
        info = {
            **self.engine.server_info(),
            "host": self.config.host,
            "port": request.url.port,
            "tp_size": self.engine.config.tp_size,
            "dp_size": 1,
            "version": __version__,
            "internal_states": [self.engine.stats()],
            "weight_update_groups": self.receiver.group_names(),
            "api_key_set": keys.api_key is not None,
            "admin_api_key_set": keys.admin_api_key is not None,
        }
        return web.json_response(info)

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self.engine.stats(), self.engine.weight_version, str(self.engine.model_path))
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # ------------------------------------------------------------------ control
    async def abort_request(self, request: web.Request) -> web.Response:
        p = protocol.parse_control("abort_request", await self._json(request), self.unknown_key)
        rid = None if p["abort_all"] else p["rid"]
        n = await asyncio.to_thread(self.engine.abort, rid, message=p["abort_message"]) if rid != "" else 0
        return web.json_response({"success": True, "num_aborted": n})

    async def pause(self, request: web.Request) -> web.Response:
        p = protocol.parse_control("pause_generation", await self._json(request), self.unknown_key)
        async with self.pausing:
            await asyncio.to_thread(self.engine.pause, p["mode"])
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        protocol.parse_control("continue_generation", await self._json(request), self.unknown_key)
        async with self.pausing:
            await asyncio.to_thread(self.engine.resume)  # may abort requests whose LoRA adapter was unloaded
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ------------------------------------------------------------------ LoRA adapters (engine/lora.py)
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        p = protocol.parse_control("load_lora_adapter", await self._json(request), self.unknown_key)
        await asyncio.to_thread(self.engine.load_lora_adapter, p["lora_name"], p["lora_path"])
        return web.json_response(self._lora_answer())

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        p = protocol.parse_control("unload_lora_adapter", await self._json(request), self.unknown_key)
        await asyncio.to_thread(self.engine.unload_lora_adapter, p["lora_name"])
        return web.json_response(self._lora_answer())

    async def lora_adapter_checksums(self, request: web.Request) -> web.Response:
        """Our extension: PEFT name -> checksum of each tensor of a loaded adapter (the lora sync verifies them)."""
        p = protocol.parse_control("lora_adapter_checksums", await self._json(request))
        sums = await asyncio.to_thread(self.engine.lora_checksums, p["lora_name"])
        return web.json_response({"lora_name": p["lora_name"], "checksums": sums})

    def _lora_answer(self) -> dict[str, Any]:
        """SGLang's LoRA update answer: success, error message, the adapters now loaded (name -> path)."""
        return {"success": True, "error_message": None, "loaded_adapters": dict(self.engine.loras.paths)}

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang: optional query `timeout` (s) to wait for running requests; plain-text answer, 400 when busy."""
        timeout = protocol.parse_control("flush_cache", await self._json(request), self.unknown_key)["timeout_s"]
        if "timeout" in request.query:
            try:
                timeout = float(request.query["timeout"])
            except ValueError:
                timeout = math.nan
            if not math.isfinite(timeout):  # inf and nan too: a wait without end
                raise BadRequest(f"query `timeout`: expected seconds, got {request.query['timeout']!r}")
            timeout = max(0.0, timeout)
        deadline = time.monotonic() + timeout
        while not (ok := await asyncio.to_thread(self.engine.flush_cache)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if ok:
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")


# ---------------------------------------------------------------------- helpers
def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[GenerateResult]) -> Callable[[GenerateResult], None]:
    def set_result(res: GenerateResult) -> None:
        if not fut.done():
            fut.set_result(res)

    def on_done(res: GenerateResult) -> None:  # engine thread (or an aborting thread)
        try:
            loop.call_soon_threadsafe(set_result, res)
        except RuntimeError:  # the loop is closed: the server is gone, nobody waits for this result
            pass

    return on_done


_METRICS = (  # (stats key, SGLang metric name, type, help)
    ("num_running_reqs", "sglang:num_running_reqs", "gauge", "Requests decoding now"),
    ("num_queue_reqs", "sglang:num_queue_reqs", "gauge", "Requests waiting to run"),
    ("gen_throughput", "sglang:gen_throughput", "gauge", "Generated tokens per second (last ~10 s)"),
    ("cache_hit_rate", "sglang:cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / admitted"),
    ("token_usage", "sglang:token_usage", "gauge", "Fraction of KV-cache blocks in use"),
    ("prompt_tokens_total", "sglang:prompt_tokens_total", "counter", "Prompt tokens received"),
    ("generation_tokens_total", "sglang:generation_tokens_total", "counter", "Tokens generated"),
    ("cached_tokens_total", "sglang:cached_tokens_total", "counter", "Prompt tokens served from the prefix cache"),
    ("num_requests_total", "sglang:num_requests_total", "counter", "Requests received"),
    ("num_retractions_total", "miles:num_retractions_total", "counter", "Requests retracted to the waiting queue"),
    ("paused", "miles:paused", "gauge", "1 while generation is paused"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(stats: dict[str, float | int], weight_version: str, model_name: str) -> str:
    """Prometheus text exposition (format 0.0.4) of the engine's stats; SGLang's metric names where they exist."""
    labels = f'model_name="{_label(model_name)}"'
    lines = []
    for key, name, kind, help_text in _METRICS:
        if key in stats:
            value = float(stats[key])
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value!r}"]
    lines += [
        "# HELP miles:weight_version_info The weight version being served (value always 1)",
        "# TYPE miles:weight_version_info gauge",
        f'miles:weight_version_info{{{labels},weight_version="{_label(weight_version)}"}} 1.0',
    ]
    return "\n".join(lines) + "\n"


def _load_tokenizer(model_path: str | None) -> Any:
    """The checkpoint's `tokenizer.json` (fast `tokenizers` only: no transformers import) or None."""
    path = Path(model_path or "") / "tokenizer.json"
    if not model_path or not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


# ---------------------------------------------------------------------- process entry
def _gpu_ids(device: str) -> list[int | str]:
    """Physical ids of the engine's GPUs (as CUDA_/HIP_VISIBLE_DEVICES name them), for the launcher's bookkeeping."""
    if not device.startswith("cuda"):
        return []
    index = int(device.partition(":")[2] or 0)
    env = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("HIP_VISIBLE_DEVICES") or ""
    visible = [x for x in env.split(",") if x]
    gpu = visible[index] if index < len(visible) else str(index)
    return [int(gpu) if gpu.isdigit() else gpu]


def write_rendezvous(path: str, info: dict[str, Any]) -> None:
    """Atomically (tmp + rename in the same directory): a reader sees no file or the whole file."""
    write_text_atomic(path, json.dumps(info, indent=2) + "\n")


async def run_server(engine: Engine, config: ServerConfig, model_path: str, sock: socket.socket) -> None:
    """Serve `engine` (started) on `sock` (bound) until SIGTERM/SIGINT, then shut down cleanly."""
    loop = asyncio.get_running_loop()
    # Worker threads wait for engine steps, trainer broadcasts and group joins: more than the default min(32, cpus+4).
    loop.set_default_executor(ThreadPoolExecutor(max_workers=64, thread_name_prefix="engine-http"))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = EngineServer(engine, config)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
    runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=config.shutdown_timeout_s)
    await runner.setup()
    sock.listen(1024)
    await web.SockSite(runner, sock).start()
    lease_watch = asyncio.create_task(server.lease.watch(server.engine, server.pausing, lambda: server.closing))
    port = int(sock.getsockname()[1])
    # A wildcard bind is reachable under this machine's name, not under the wildcard address.
    host = socket.getfqdn() if config.host in ("0.0.0.0", "::", "") else config.host
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    info = {
        "host": host,
        "port": port,
        "pid": os.getpid(),
        "url": url,
        "model_path": model_path,
        "tp_size": engine.config.tp_size,
        "gpu_ids": [g for r in range(engine.config.tp_size) for g in _gpu_ids(rank_device(str(engine.device), r))],
    }
    if config.rendezvous:
        write_rendezvous(config.rendezvous, info)
    print(f"[miles-hpc serve] listening on {url} (model {model_path}, pid {os.getpid()})", flush=True)
    try:
        await stop.wait()
    finally:
        print("[miles-hpc serve] shutting down", flush=True)
        server.closing = True
        lease_watch.cancel()
        # Finish every in-flight /generate (finish_reason abort) so open handlers return before the port closes.
        await asyncio.to_thread(engine.abort, None)
        await runner.cleanup()
        await asyncio.to_thread(server.receiver.destroy_all)
        if config.rendezvous:
            try:
                if json.loads(Path(config.rendezvous).read_text()).get("pid") == os.getpid():
                    Path(config.rendezvous).unlink()  # a stale file would name a dead server
            except (OSError, ValueError):
                pass


def configs_of(launch: EngineLaunch) -> tuple[EngineConfig, ServerConfig]:
    """`miles-hpc serve`'s flags (engine/launch.py) -> the engine's and the server's configs (ValueError names the
    field)."""
    keys = ApiKeys(
        api_key=read_key(launch.api_key, launch.api_key_file, "api-key"),
        admin_api_key=read_key(launch.admin_api_key, launch.admin_api_key_file, "admin-api-key"),
    )
    engine_cfg = EngineConfig(
        device=launch.device,
        dtype=launch.dtype,
        max_total_tokens=launch.max_total_tokens,
        block_size=launch.page_size,
        kv_cache_fraction=launch.kv_cache_fraction,
        max_context_len=launch.max_context_len,
        max_running_requests=launch.max_running_requests,
        seed=launch.seed,
        batch_invariant=launch.batch_invariant,
        record_indexer_topk=launch.enable_return_indexer_topk,
        tp_size=launch.tp_size,
    )
    server_cfg = ServerConfig(
        host=launch.host,
        port=launch.port,
        keys=keys,
        rendezvous=launch.rendezvous,
        max_request_bytes=int(launch.max_request_mb * (1 << 20)),
        body_idle_timeout_s=launch.request_body_timeout,
        weight_sync_timeout_s=launch.weight_update_timeout,
        pause_lease_s=launch.pause_lease,
    )
    return engine_cfg, server_cfg


def serve(model_path: str, engine_config: EngineConfig, config: ServerConfig) -> int:
    """`miles-hpc serve`: bind, load the model, start the engine, listen, serve until a signal; the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    http_log.install()  # a malformed request is one WARNING line, not a traceback
    try:  # started by a launcher (MILES_PARENT_PID): end with it, even during the load, even after its SIGKILL
        watch_parent(parent_pid_from_env(), grace_s=config.shutdown_timeout_s + 20)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # bound before the (maybe minutes-long) load so a taken port fails at once; listening only once ready
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        print(f"error: cannot bind {config.host}:{config.port}: {e}", file=sys.stderr)
        return 2
    try:
        engine = Engine.from_pretrained(model_path, engine_config)
    except ValueError as e:  # a mode this model cannot be served in (Engine names it), a bad checkpoint
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine.start()
    lost: list[str] = []
    if engine.tp is not None:  # a rank that dies ends the server (tp.py): its supervisor restarts the engine
        devices = [rank_device(str(engine.device), r) for r in range(engine.tp.tp_size)]
        pids = [os.getpid(), *(p.pid for p in engine.tp.procs)]
        print(f"[miles-hpc serve] tensor-parallel: {engine.tp.tp_size} ranks on {devices} (pids {pids})", flush=True)
        engine.tp.watch(lambda msg: (lost.append(msg), os.kill(os.getpid(), signal.SIGTERM)))
    try:
        asyncio.run(run_server(engine, config, str(model_path), sock))
    finally:
        engine.shutdown()
        sock.close()
    if lost:
        print(f"error: {lost[0]}", file=sys.stderr, flush=True)
        return 1
    print("[miles-hpc serve] stopped", flush=True)
    return 0
