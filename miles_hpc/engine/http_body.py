"""Reading a request body as JSON on the engine server: bounded in size and in silence, errors the client can act on.

Stage: engine (server.py's handlers call `read_json`).

Invariants: a body announced larger than the limit is refused before a byte of it is read, and one that grows past
it while being read, as soon as it does (413); a body that sends no byte for `idle_s` seconds fails with 408 naming
`--request-body-timeout`, so a stalled client never holds its handler for ever; malformed JSON (invalid UTF-8,
nesting deeper than the parser goes, numbers of more than 4300 digits) is a 400 naming the problem.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from .protocol import BadRequest


async def read_json(request: web.Request, limit: int, idle_s: float) -> Any:
    """The request body as JSON (None when empty or blank)."""
    too_large = web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length or limit + 1)
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    data = bytearray()
    chunks = request.content.iter_chunked(1 << 16).__aiter__()
    while True:
        try:
            data += await asyncio.wait_for(chunks.__anext__(), idle_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise web.HTTPRequestTimeout(
                text=f"request body: no byte for {idle_s:g} s (--request-body-timeout)"
            ) from None
        if len(data) > limit:
            raise too_large
    if not data.strip():
        return None
    try:
        return json.loads(data)
    except RecursionError:  # the C scanner stops near the interpreter's recursion limit (~1000 levels)
        raise BadRequest("malformed JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # invalid UTF-8 and numbers of > 4300 digits included
        raise BadRequest(f"malformed JSON body: {str(e).split(';')[0]}") from None
