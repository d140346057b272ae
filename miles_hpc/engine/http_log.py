"""The engine server's log under malformed HTTP (stage: engine, HTTP layer).

aiohttp answers a request it cannot parse (a bad Content-Length, a bad chunk size, a header over its limit) with a
400 before any handler or key check runs, and logs it on ``aiohttp.server`` at ERROR with the parser's traceback:
any client could fill the log with tracebacks. :class:`ClientFramingErrors` turns those records into one WARNING
line without the traceback; every other record (a handler's own exception included) passes as it was.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["ClientFramingErrors", "install"]


class ClientFramingErrors(logging.Filter):
    """A record whose exception is aiohttp's parser error becomes ``WARNING bad HTTP request: WHAT`` (no traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "bad HTTP request from a client (answered 400): %s", (exc.message or exc,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install() -> None:
    """Attach the filter to ``aiohttp.server`` (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientFramingErrors) for f in logger.filters):
        logger.addFilter(ClientFramingErrors())
