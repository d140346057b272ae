"""An OpenAI-compatible chat endpoint in front of the router (stage: rollout): `/v1/chat/completions` and
`/v1/models` over `rollout/sessions.SessionStore`, so agent harnesses written for the OpenAI client (`openai`
package, `base_url` pointed here) run unchanged while the trainer gets token-level samples (TITO).

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (NORMAL: ``Authorization: Bearer <api key>`` when a key
is set, the engine's rules, `miles_hpc/auth.py`), ``GET /health`` (open). The session is the body's ``session_id`` or
the ``X-Session-Id`` header (every call of a session goes to one engine: prefix affinity); without either, each
call is a conversation of its own, answered and forgotten (nothing recorded). Errors answer OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``: 400 for a request the session cannot serve (`SessionError`: history not the session's, a template
that rewrites it, an unsupported field), 401 without the key, 502 when the engines fail.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from miles_hpc.auth import ApiKeys, AuthLevel, decide
from miles_hpc.rollout.sessions import SessionError, SessionStore

__all__ = ["OpenAISessionServer"]

SESSION_HEADER = "X-Session-Id"


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


class OpenAISessionServer:
    """Serves `store` on ``host:port`` (port 0: a free one); `start` returns the base URL (``.../v1``)."""

    def __init__(self, store: SessionStore, *, model_name: str, keys: ApiKeys | None = None) -> None:
        self.store, self.model_name, self.keys = store, model_name, keys or ApiKeys()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        level = AuthLevel.OPEN if request.path == "/health" else AuthLevel.NORMAL
        status = decide(level, request.headers.get("Authorization"), self.keys)
        if status is not None:
            return _error(status, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.store.sessions)})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "miles-hpc"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, json.JSONDecodeError):
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object", "invalid_request_error")
        sid = body.get("session_id") or request.headers.get(SESSION_HEADER)
        session = self.store.get(None if sid is None else str(sid))
        try:
            answer = await session.chat(body)
        except SessionError as e:
            return _error(400, str(e), "invalid_request_error")
        except Exception as e:  # noqa: BLE001 (the engines failed: the harness gets an answer, not a hang)
            return _error(502, f"generation failed: {type(e).__name__}: {e}", "api_error")
        finally:
            if sid is None:  # a call without a session is its own conversation: nothing to continue or record
                self.store.sessions.pop(session.id, None)
        return web.json_response(answer)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{host}:{bound}/v1"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
