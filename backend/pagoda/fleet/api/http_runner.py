"""The router's HTTP server: aiohttp's ``AppRunner``, minus echoing what it cannot parse.

aiohttp answers a request it cannot parse (a control character or a bad byte in a header
line, an over-long line, a bad request line) itself, before any handler or middleware
runs: a 400 whose body quotes the offending line, and an ERROR with a traceback quoting
it again. For an ``Authorization`` header that line holds a credential, so the router's
runner (``make_runner``) answers such requests with a fixed text, ``400 Bad Request:
malformed HTTP request``, and logs one INFO line naming only the error's class. Every
other error keeps aiohttp's handling. Headers that parse reach ``http_api``'s middleware,
whose messages never contain a key either (``gate.auth``).

Invariant: nothing a client sent in its request line or headers appears in a parse-error
answer or log line.
"""

from __future__ import annotations

import logging
from typing import Optional

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger(__name__)

MALFORMED_MESSAGE = ("400 Bad Request: malformed HTTP request (an invalid request line or header; the router does "
                     "not repeat it)\n")


class _RedactingHandler(RequestHandler):
    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        logger.info("refused a malformed HTTP request from %s (%s)", request.remote, type(exc).__name__)
        response = web.Response(status=400, text=MALFORMED_MESSAGE)
        response.force_close()
        return response


class _Server(web.Server):
    __slots__ = ()

    def __call__(self) -> RequestHandler:
        return _RedactingHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    __slots__ = ()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server; only its protocol factory differs
        return server


def make_runner(app: web.Application, shutdown_timeout: float = 60.0) -> web.AppRunner:
    """The runner the router serves ``app`` with (no access log; a client that hangs up
    cancels its handler; ``shutdown_timeout`` bounds the wait for open connections)."""
    return _Runner(app, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
