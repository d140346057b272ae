"""Errors of the rollout client: one engine request failed, and how (stage: rollout, client side).

Invariant: every message reads ``engine <url> <METHOD> <path>: <reason>``, with the server's own message for HTTP
errors; no API key ever appears in one.
"""

from __future__ import annotations

import json


class EngineError(RuntimeError):
    """A request to one engine failed. ``url`` and ``endpoint`` say where; the message says why."""

    def __init__(self, url: str, endpoint: str, reason: str) -> None:
        super().__init__(f"engine {url} {endpoint}: {reason}")
        self.url = url
        self.endpoint = endpoint
        self.reason = reason


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error status (or ``success: false``); ``server_message`` is its text."""

    def __init__(self, url: str, endpoint: str, status: int, server_message: str) -> None:
        super().__init__(url, endpoint, f"HTTP {status}: {server_message}")
        self.status = status
        self.server_message = server_message


class EngineUnreachableError(EngineError):
    """No answer: connection refused/reset or closed mid-request. ``sent`` says whether the request may have
    reached the engine (False = the connection was never made, so nothing ran)."""

    def __init__(self, url: str, endpoint: str, reason: str, *, sent: bool) -> None:
        super().__init__(url, endpoint, reason)
        self.sent = sent


class EngineTimeoutError(EngineError):
    """No answer within the timeout (the engine may still be working on it)."""


class EngineProtocolError(EngineError):
    """The engine answered 2xx with something that is not the SGLang shape (or breaks an invariant)."""


def server_message(text: str) -> str:
    """The human part of an error body: SGLang's ``{"message"}``/``{"error"}``, FastAPI's ``{"detail"}``, or text."""
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        for key in ("message", "error", "detail"):
            value = obj.get(key)
            if isinstance(value, dict) and "message" in value:
                value = value["message"]
            if value:
                return str(value)[:1000]
    return text.strip()[:1000] or "(empty body)"
