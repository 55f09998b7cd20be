"""The router's HTTP gate: body size and API key before any handler, and what a handler's
cancellation means.

- ``gate_middleware`` runs first on every ``/v1`` request, every ``POST /v2/models`` and every
  ``/v2`` GET that is not open (liveness, readiness, metadata): the body size from
  ``Content-Length`` (413 before reading a byte), then the API key (401), each answered in
  the door's own error shape (``gate_error``).
- A handler that ends in ``CancelledError``: when its own task is being cancelled (the
  router runs with ``handler_cancellation``: its client hung up) it is an INFO line and the
  cancellation goes on. Otherwise something the handler awaited was cancelled under it
  (``grpc.aio`` raises ``CancelledError`` from a call whose channel was closed); let
  through, aiohttp would close the connection without a response and the client, which had
  sent its request whole, would see ``RemoteDisconnected``. It answers 502 naming it,
  ``Connection: close``, when no byte of an answer reached the socket yet (a stream already
  started can only be cut).

Invariant: every request whose client is still there gets an HTTP answer.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Optional

from aiohttp import web

from pagoda.contracts.errors import ErrorKind, spec_of
from pagoda.fleet.api.messages_api import anthropic_error
from pagoda.fleet.api.openai_responses import error_body
from pagoda.fleet.gate.gate import TENANT_KEY, AuthError, Gate, LimitError

logger = logging.getLogger(__name__)

GATE_KEY = web.AppKey("gate", Gate)
CANCELLED_UNDER_MESSAGE = ("the router lost this request's upstream call before it answered (it was cancelled inside "
                           "the router, e.g. its replica's channel closed); retry the request")


def triton_error(status: int, message: str, headers: Optional[dict[str, str]] = None) -> web.Response:
    """Triton's ``{"error"}`` answer."""
    return web.json_response({"error": message}, status=status, headers=headers)


def _authorization(request: web.Request) -> Optional[str]:
    """The request's API key as an ``Authorization`` value: that header, or ``x-api-key`` (Anthropic's SDK)."""
    if "Authorization" in request.headers or "x-api-key" not in request.headers:
        return request.headers.get("Authorization")
    return f"Bearer {request.headers['x-api-key']}"


def _gate_error(request: web.Request, status: int, message: str, kind: str, param: Optional[str] = None,
                headers: Optional[dict[str, str]] = None) -> web.Response:
    """An error in the door's own shape: Anthropic's on ``/v1/messages``, OpenAI's on ``/v1``,
    Triton's ``{"error"}`` elsewhere."""
    if request.path.startswith("/v1/messages"):
        return anthropic_error(status, message, headers)
    if request.path.startswith("/v1/"):
        return web.json_response(error_body(message, kind, param), status=status, headers=headers)
    return triton_error(status, message, headers)


# GETs anyone may make (liveness, readiness, server and model metadata); every other /v2
# GET (model configuration, statistics, logging and trace settings, the repository) needs
# a key when the router has keys, like the generation doors.
_OPEN_GET = re.compile(r"^/v2(/health/(live|ready))?/?$|^/v2/models/[^/]+(/versions/[^/]+)?(/ready)?/?$")


@web.middleware
async def gate_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Body size and API key before the handler; a client disconnect is an INFO line."""
    guarded = request.path.startswith("/v1/") or (request.method == "POST" and request.path.startswith("/v2/models/")) \
        or (request.path.startswith("/v2") and not _OPEN_GET.match(request.path))
    if guarded:
        gate = request.app[GATE_KEY]
        try:
            gate.limits.check_body_size(request.content_length)
        except LimitError as exc:
            gate.count("body_too_large")
            return _gate_error(request, exc.status, str(exc), "invalid_request_error", exc.param)
        try:
            request[TENANT_KEY] = gate.authenticate(_authorization(request))
        except AuthError as exc:
            spec = spec_of(ErrorKind.UNAUTHORIZED)
            return _gate_error(request, spec.triton_http_status, str(exc), spec.openai_type,
                               headers={"WWW-Authenticate": "Bearer"})
    try:
        return await handler(request)
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one too
        logger.info("client disconnected during %s %s: %s", request.method, request.path, exc)
        return web.Response(status=499)  # never sent: the connection is gone
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling() or request.writer.output_size:
            # The router runs with handler_cancellation: a client that hangs up cancels its
            # handler (and so its upstream stream). An ordinary event: INFO, then let it unwind.
            logger.info("client disconnected during %s %s: request cancelled", request.method, request.path)
            raise
        # Nobody cancelled this handler: something it awaited was cancelled under it (a gRPC
        # call whose channel closed raises CancelledError). Let through, aiohttp would close
        # the connection without a word and the client would see it hang up on a request it
        # had sent whole; answer it instead (nothing reached the socket yet, so this answer
        # replaces any headers still buffered).
        logger.warning("%s %s: an operation it awaited was cancelled under it (not by its client); answering 502",
                       request.method, request.path)
        response = _gate_error(request, 502, CANCELLED_UNDER_MESSAGE, "server_error")
        response.force_close()
        return response
