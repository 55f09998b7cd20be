"""A replica's gRPC channel closed under a request in flight (``api.upstream``).

``grpc.aio`` cancels a closed channel's calls and raises ``asyncio.CancelledError`` to whoever
awaits them. Before ``_stream_on`` told that from its own task's cancellation, the error left
the door's handler as if its client had hung up: aiohttp then closed the client's connection
without a response (issue 43's ``RemoteDisconnected`` in the hostile soak). Now it is a lost
connection (``ReplicaFailed``, ``connection_lost``: migrated, or named to the client), while a
caller's own cancellation still cancels. A real ``grpc.aio`` server and channel.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.fleet.api.migration import CONNECTION_LOST, Migrations
from pagoda.fleet.api.routed_request import RoutedRequest
from pagoda.fleet.api.tracing import RouteSpan
from pagoda.fleet.api.upstream import GrpcUpstream, ReplicaFailed
from pagoda.fleet.gate.gate import Gate
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.routing.router import Router
from pagoda.serving.wire import WireRequest

_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


async def _silent_server() -> tuple[grpc.aio.Server, int]:
    """A replica that takes the request and never answers."""
    async def never_answers(requests, context):
        async for _ in requests:
            await asyncio.sleep(3600)
        yield b""  # pragma: no cover - unreachable; makes this an async generator

    handler = grpc.stream_stream_rpc_method_handler(never_answers)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelStreamInfer": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _scenario(cancel_caller: bool) -> BaseException:
    server, port = await _silent_server()
    replicas = ReplicaSet("static")
    replicas.set_members([("r0", {"grpc": f"127.0.0.1:{port}", "http": "127.0.0.1:1"})])
    router = Router(replicas, tokenizer=None, hash_model_id="m", policy_name="round_robin")
    # No migration: the failure itself reaches the caller.
    upstream = GrpcUpstream(router, Gate(), migrations=Migrations(0), peer_pull_min_blocks=0)
    wire = WireRequest.from_json({"text_input": "hi", "max_tokens": 4})

    async def consume():
        async for _ in upstream.stream(None, RoutedRequest("id", wire), RouteSpan()):
            pass

    task = asyncio.create_task(consume())
    try:
        for _ in range(500):  # until the call is on the channel
            await asyncio.sleep(0.01)
            if replicas.get("r0").in_flight:
                break
        assert replicas.get("r0").in_flight == 1, "the request never reached the replica"
        await asyncio.sleep(0.05)
        if cancel_caller:
            task.cancel()
        else:
            await replicas.get("r0").close()  # the channel closes under the call
        try:
            await asyncio.wait_for(task, 10)
        except BaseException as exc:  # noqa: BLE001 - the outcome is what the test reads
            return exc
        raise AssertionError("the stream ended without an error")
    finally:
        await replicas.close()
        await server.stop(0)


def test_a_channel_closed_under_a_call_is_a_lost_connection_not_a_cancellation():
    outcome = asyncio.run(_scenario(cancel_caller=False))
    assert isinstance(outcome, ReplicaFailed), f"{type(outcome).__name__} left the upstream stream"
    assert outcome.reason == CONNECTION_LOST and outcome.replica_id == "r0"
    assert "channel to it closed under this request" in str(outcome)


def test_the_callers_own_cancellation_still_cancels():
    with pytest.raises(asyncio.CancelledError):
        raise asyncio.run(_scenario(cancel_caller=True))
