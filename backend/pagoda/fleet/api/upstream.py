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

Disaggregated serving (docs/kv_transfer.md): when the routable replicas include a
``prefill`` and a ``decode`` role, a request runs in two stages: a copy with
``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}`` on a prefill
replica (chosen among prefill replicas by the same policy: prefix affinity, load), whose
final response carries the KV handle; then the request itself, with that handle as its
``kv_transfer_params``, on a decode or mixed replica, which pulls the prompt's blocks and
streams the answer, the one stream the client sees. A failed first stage (no prefill
replica, an error, no handle) is logged and the request runs whole on the decode side:
the same answer, later. A request that already carries ``kv_transfer_params`` (a client
driving the stages itself) is routed as is.

Peer prefix pull (``routing.peer_pull``): otherwise, when the chosen replica lacks a prefix
another replica holds and pulling it is estimated faster than recomputing it, the request
goes with that holder as its ``kv_transfer_params`` handle; the replica pulls the blocks it
lacks (a failed pull: it computes them). Set per attempt: a retry on another replica decides again.

Faults: a replica that refuses the connection before answering is marked unhealthy and
the request goes to another replica (``max_attempts`` in all). A replica that breaks a
stream after it began (it died) cannot be retried transparently (tokens were already
sent): ``ReplicaFailed`` names the replica, and the replica is marked unhealthy so new
requests avoid it until the health prober sees it ready again.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any, AsyncIterator, Optional

import grpc
from tritonclient.grpc import service_pb2

from pagoda.contracts.errors import is_overloaded
from pagoda.fleet.api.tracing import TRACEPARENT, RouteSpan
from pagoda.fleet.gate.gate import Gate
from pagoda.fleet.gate.limits import remove_sampling_value, sampling_of_infer_request, set_sampling_value
from pagoda.fleet.routing.peer_pull import PeerPull
from pagoda.fleet.routing.router import Analysis, NoReplicaAvailable, Router
from pagoda.fleet.triton_wire import drop_inputs, output_text

logger = logging.getLogger(__name__)

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

    def __init__(self, router: Router, gate: Gate, max_attempts: int = 2, peer_pull_min_blocks: int = 4) -> None:
        self.router = router
        self.gate = gate
        self.max_attempts = max_attempts
        # pagoda router --peer-pull-min-blocks (0: never pull)
        self.peer_pull = PeerPull(min_blocks=max(1, peer_pull_min_blocks), enabled=peer_pull_min_blocks > 0)

    async def stream(self, analysis: Optional[Analysis], request: Any, span: RouteSpan) -> AsyncIterator[Any]:
        """Route ``request`` and yield the replica's ``ModelStreamInferResponse`` messages.

        With prefill and decode replicas in the fleet, in two stages (module docstring).

        Raises:
            NoReplicaAvailable: no replica could be chosen.
            ReplicaFailed: the chosen replica failed (after any retries that were safe).
        """
        skip, may_pull = [], False
        if self._is_disaggregated(request):
            skip = [r.replica_id for r in self.router.replicas.all() if r.role == "prefill"]
            handle = await self._prefill(analysis, request, span)
            if handle is not None:
                set_sampling_value(request, "kv_transfer_params", handle)
                self.router.num_two_stage += 1
        else:
            may_pull = self.peer_pull.enabled and "kv_transfer_params" not in sampling_of_infer_request(request)
        async for response in self._stream_on(analysis, request, span, skip, may_pull):
            yield response

    def _is_disaggregated(self, request: Any) -> bool:
        roles = {r.role for r in self.router.replicas.routable()}
        return "prefill" in roles and "decode" in roles and \
            "kv_transfer_params" not in sampling_of_infer_request(request)

    async def _prefill(self, analysis: Optional[Analysis], request: Any, span: RouteSpan) -> Optional[dict]:
        """The first stage on a prefill replica: the prompt computed, one token, the KV handle
        back. None (the request then runs whole on a decode replica) when it fails."""
        first = service_pb2.ModelInferRequest()
        first.CopyFrom(request)
        del first.outputs[:]  # every output: the handle too
        for key, value in (("max_tokens", 1), ("min_tokens", 0), ("kv_transfer_params", {"do_remote_decode": True})):
            set_sampling_value(first, key, value)
        drop_inputs(first, ("max_tokens", "min_tokens", "min_length"))  # the JSON values above rule
        skip = [r.replica_id for r in self.router.replicas.all() if r.role != "prefill"]
        responses = self._stream_on(analysis, first, span, skip)
        try:
            async for response in responses:
                if response.error_message:
                    logger.warning("prefill stage refused: %s", response.error_message)
                    return None
                text = output_text(response.infer_response, "kv_transfer_params")
                if text:
                    return json.loads(text)
        except (NoReplicaAvailable, ReplicaFailed) as exc:
            logger.warning("prefill stage failed (%s); the decode replica computes the prompt", exc)
            return None
        finally:
            await responses.aclose()  # the stage's replica is released now, not at collection
        logger.warning("prefill stage gave no KV handle; the decode replica computes the prompt")
        return None

    async def _stream_on(self, analysis: Optional[Analysis], request: Any, span: RouteSpan,
                         skip: list[str], may_pull: bool = False) -> AsyncIterator[Any]:
        """One stage: a replica not in ``skip`` chosen, retried on refusal or overload;
        ``may_pull``: with a peer's prefix to pull when that is worth it (``peer_pull``)."""
        router, gate = self.router, self.gate
        tried: list[str] = list(skip)
        num_dead = 0
        for attempt in itertools.count(1):
            decision = await gate.choose(router, analysis, tried, attempt)
            span.set_decision(decision)
            replica = decision.replica
            if may_pull:
                self._set_peer_pull(request, decision)
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

    def _set_peer_pull(self, request: Any, decision: Any) -> None:
        """Give ``request`` the handle of a peer to pull its prefix from, or take it away."""
        params = self.peer_pull.params(decision, self.router.replicas, self.router.block_size)
        if params is not None:
            self.router.num_peer_pulls += 1
            set_sampling_value(request, "kv_transfer_params", params)
        elif "kv_transfer_params" in sampling_of_infer_request(request):
            remove_sampling_value(request, "kv_transfer_params")  # an earlier attempt's
