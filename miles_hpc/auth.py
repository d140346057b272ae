"""API-key auth with SGLang's semantics (``sglang.srt.utils.auth.decide_request_auth``), for the engine server
(`engine/server.py`) and the OpenAI session server (`rollout/openai_server.py`).

Stage: shared by engine and rollout (their HTTP layers). Pure functions; each server's middleware calls
:func:`decide` once per request.

Levels (each route declares one; see engine/server.py's route table):
- OPEN: ``/health``, ``/health_generate``, ``/ready``, ``/metrics``: never need a key (probes and Prometheus
  scrapers carry no secrets).
- NORMAL (``/generate``, ``/get_server_info``, ``/get_model_info`` and their aliases): with ``--api-key`` they need
  ``Authorization: Bearer <api-key>``; the admin key does NOT unlock them (as SGLang); without ``--api-key`` they
  are open, even when an admin key is set.
- ADMIN (SGLang's ``ADMIN_OPTIONAL``: every weight-update, pause/continue, abort_request, flush_cache,
  update_weight_version, weights_checker route; every route of ``WeightEndpoints.routes()``, so also our
  ``/update_weights_from_delta``, which makes the engine read files it names): with ``--admin-api-key`` they need
  the admin key and the plain key is refused (401); with only ``--api-key`` the plain key unlocks them; with no key
  they are open. SGLang marks ``/abort_request`` admin too, so a plain-key client cannot abort other tenants'
  requests when an admin key is set.
- Unknown paths are NORMAL (so a probe without the key learns nothing but 401, as with SGLang's middleware).

Invariants: keys are compared with ``hmac.compare_digest`` (constant time); a missing or malformed header is a 401,
never a 500; no key ever appears in a response or a log line. SGLang's ``ADMIN_FORCE`` level (403 when no admin
key is configured) is used by none of our routes.
"""

from __future__ import annotations

import enum
import hmac
import os
from dataclasses import dataclass
from pathlib import Path


class AuthLevel(enum.Enum):
    OPEN = "open"
    NORMAL = "normal"
    ADMIN = "admin"


@dataclass(frozen=True, kw_only=True, slots=True)
class ApiKeys:
    api_key: str | None = None
    admin_api_key: str | None = None

    def __repr__(self) -> str:  # never print the secrets (configs and errors get logged)
        shown = {k: "set" if getattr(self, k) else None for k in ("api_key", "admin_api_key")}
        return f"ApiKeys(api_key={shown['api_key']}, admin_api_key={shown['admin_api_key']})"


def _bearer_matches(header: str | None, expected: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")  # exactly "Bearer <key>", as SGLang splits it (no stripping)
    if scheme.lower() != "bearer" or not token:
        return False
    # compare_digest needs equal types; encoding keeps non-ASCII keys comparable without a TypeError.
    return hmac.compare_digest(token.encode(), expected.encode())


def decide(level: AuthLevel, authorization: str | None, keys: ApiKeys) -> int | None:
    """None when the request may proceed, else the HTTP status to answer (401)."""
    if level is AuthLevel.OPEN:
        return None
    if level is AuthLevel.ADMIN and keys.admin_api_key:
        return None if _bearer_matches(authorization, keys.admin_api_key) else 401
    if keys.api_key:
        return None if _bearer_matches(authorization, keys.api_key) else 401
    return None


def read_key(value: str | None, file: str | None, what: str) -> str | None:
    """A key given inline (``--api-key``, visible in ``ps``) or in a file (``--api-key-file``, first line, the way
    the launcher hands keys over with mode 0600). Both, or an empty key, is an error naming the flag."""
    if value is not None and file is not None:
        raise ValueError(f"give --{what} or --{what}-file, not both")
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"--{what}-file {file}: no such file")
        if os.name == "posix" and path.stat().st_mode & 0o077:
            # Not fatal (shared filesystems may not keep modes) but worth saying: a readable key is no key.
            print(f"[miles-hpc serve] warning: --{what}-file {file} is readable by group/others (chmod 600 it)")
        lines = path.read_text().splitlines()
        value = lines[0].strip() if lines else ""
    if value is not None and not value.strip():
        raise ValueError(f"--{what}{'-file' if file else ''}: the key is empty")
    return value.strip() if value is not None else None
