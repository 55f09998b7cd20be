"""A router handler cancelled under it (not by its client) still answers its client; the
soak says which prompt met a hang-up.

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


def test_the_soaks_big_prompt_names_which_prompt_met_a_closed_connection():
    """The hostile soak's record of such a hang-up says which of its two prompt sizes it was
    (issue 43's report could not: only a 900k-character prompt reaches a replica)."""
    import random
    import socket
    import threading

    from pagoda.bench.soak_clients import Endpoints
    from pagoda.bench.soak_hostile import big_prompt

    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up_after_reading() -> None:
        connection, _ = listener.accept()
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                head += connection.recv(65536)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            received = len(head.split(b"\r\n\r\n", 1)[1])
            while received < length:
                received += len(connection.recv(65536))

    server = threading.Thread(target=hang_up_after_reading)
    server.start()
    endpoint = Endpoints(http=f"127.0.0.1:{listener.getsockname()[1]}", grpc="", key="k", other_key="k2")
    rng = random.Random(0)
    size = random.Random(0).choice([3 * 2**20, 900_000])
    outcome = big_prompt(endpoint, rng, 2)
    server.join(10)
    listener.close()
    assert outcome == f"unexpected:connection RemoteDisconnected ({size}-character prompt)"
