"""A router handler cancelled under it (not by its client) still answers its client.

grpc.aio raises ``asyncio.CancelledError`` from a call whose channel was closed; before
``http_gate`` answered it, the CancelledError left the handler, aiohttp closed the connection
without a response and ``urllib`` (the soak's client) raised ``RemoteDisconnected`` on a
request it had sent whole (issue 43's hostile soak). Real sockets, the router's own runner.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request

from aiohttp import web

from pagoda.fleet.api.http_gate import CANCELLED_UNDER_MESSAGE, gate_middleware
from pagoda.fleet.api.http_runner import make_runner


async def _cancelled_under(request: web.Request) -> web.Response:
    await request.read()
    inner = asyncio.get_running_loop().create_future()  # stands for a gRPC call on a channel being closed
    asyncio.get_running_loop().call_later(0.01, inner.cancel)
    await inner
    return web.Response(text="unreachable")


async def _served(handler, body: bytes) -> tuple[object, bytes]:
    app = web.Application(middlewares=[gate_middleware])
    app.router.add_post("/cancelled", handler)
    runner = make_runner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]

    def post() -> tuple[object, bytes]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/cancelled", data=body)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                try:
                    return response.status, response.read()
                except http.client.IncompleteRead as exc:  # a started answer cut short
                    return response.status, exc.partial
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except http.client.RemoteDisconnected as exc:
            return exc, b""

    try:
        return await asyncio.to_thread(post)
    finally:
        await runner.cleanup()


def test_a_handler_cancelled_under_it_answers_502_instead_of_hanging_up():
    status, body = asyncio.run(_served(_cancelled_under, b"tea " * 2**16))
    assert status == 502, f"the client got {status!r} instead of an answer"
    assert json.loads(body) == {"error": CANCELLED_UNDER_MESSAGE}


async def _streams_then_cancelled(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"data: 1\n\n")
    return await _cancelled_under(request)


def test_a_started_answer_cancelled_under_it_is_cut_not_answered_twice():
    status, body = asyncio.run(_served(_streams_then_cancelled, b"{}"))
    assert (status, body) == (200, b"data: 1\n\n")  # cut after what it sent; no second status line follows
