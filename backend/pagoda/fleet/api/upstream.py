"""The doors' upstream client: one routed request on its own gRPC stream to a replica.

``GrpcUpstream.stream`` chooses a replica (``Gate.choose``: the router's decision, avoiding
replicas known full), sends the request on its own ``ModelStreamInfer`` stream and yields
the replica's responses unchanged; the stream carries exactly one request and ends when
the replica has sent that request's last response, which is when its in-flight count is
released. The gRPC door (``grpc_proxy``) and the OpenAI door (``openai_api``) are given
the same instance by ``RouterService``; neither owns it.

Overload: a replica whose first response is an overload refusal
(``pagoda.contracts.errors.is_overloaded``) is remembered as full (``Gate.mark_full``) and
the request goes to a replica not yet tried; the refusal reaches the caller only when no
replica is left.

Faults: a replica that refuses the connection before answering is marked unhealthy and
the request goes to another replica (``max_attempts`` in all). A replica that breaks a
stream after it began (it died) cannot be retried transparently (tokens were already
sent): ``ReplicaFailed`` names the replica, and the replica is marked unhealthy so new
requests avoid it until the health prober sees it ready again.
"""

from __future__ import annotations

import itertools
from typing import Any, AsyncIterator, Optional

import grpc

from pagoda.contracts.errors import is_overloaded
from pagoda.fleet.api.tracing import TRACEPARENT, RouteSpan
from pagoda.fleet.gate.gate import Gate
from pagoda.fleet.routing.router import Analysis, Router

# gRPC codes that mean "this replica is not there" (connection refused / reset / closed).
DEAD_CODES = (grpc.StatusCode.UNAVAILABLE,)
BROKEN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.CANCELLED)


class ReplicaFailed(RuntimeError):
    """A replica failed while serving a request; the message is meant for the client."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


class GrpcUpstream:
    """Streams routed requests to replicas (module docstring).

    Args:
        router: routing decisions and in-flight accounting.
        gate: the overload memory (``choose``, ``mark_full``).
        max_attempts: replicas tried when a connection is refused.
    """

    def __init__(self, router: Router, gate: Gate, max_attempts: int = 2) -> None:
        self.router = router
        self.gate = gate
        self.max_attempts = max_attempts

    async def stream(self, analysis: Optional[Analysis], request: Any, span: RouteSpan) -> AsyncIterator[Any]:
        """Route ``request`` and yield the replica's ``ModelStreamInferResponse`` messages.

        Raises:
            NoReplicaAvailable: no replica could be chosen.
            ReplicaFailed: the chosen replica failed (after any retries that were safe).
        """
        router, gate = self.router, self.gate
        tried: list[str] = []
        num_dead = 0
        for attempt in itertools.count(1):
            decision = await gate.choose(router, analysis, tried, attempt)
            span.set_decision(decision)
            replica = decision.replica
            if span.traceparent:
                request.parameters[TRACEPARENT].string_param = span.traceparent
            num_responses = 0
            call = None
            try:
                call = replica.grpc_stub().ModelStreamInfer(iter((request,)))
                async for response in call:
                    if num_responses == 0 and is_overloaded(response.error_message):
                        gate.mark_full(replica.replica_id)
                        tried.append(replica.replica_id)
                        if router.replicas.routable(tried, include_draining=True):
                            break  # another replica may have room
                    num_responses += 1
                    yield response
                else:
                    return
                continue
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code in BROKEN_CODES and not (code == grpc.StatusCode.CANCELLED and num_responses == 0):
                    router.replicas.mark_unhealthy(replica, f"{code.name}: {exc.details()}")
                num_dead += 1
                if num_responses == 0 and code in DEAD_CODES and num_dead < self.max_attempts:
                    tried.append(replica.replica_id)
                    continue
                where = "while streaming this request" if num_responses else "before answering"
                raise ReplicaFailed(f"replica {replica.replica_id} ({replica.endpoints['grpc']}) failed {where}: "
                                    f"{code.name}: {exc.details()}. The router avoids it until it is healthy "
                                    "again; retry the request.", code) from None
            finally:
                if call is not None and not call.done():
                    call.cancel()
                router.release(decision)
