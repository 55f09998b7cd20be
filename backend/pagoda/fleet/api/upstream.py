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
replica is left. With flow control on (``gate.flow_control``) a request first waits for its
``turn`` in the router's queue while the fleet is saturated (``Gate.choose``), and one a
replica refuses as full goes back to that queue (``FlowControl.requeue``) instead, until its
deadline.

The request is a ``RoutedRequest``: pagoda's model's ``WireRequest`` (or another model's
request, forwarded as it came, to which neither the two stages nor peer pulls apply); each
attempt builds the replica's ``ModelInferRequest`` from it.

Disaggregated serving (docs/kv_transfer.md): when the routable replicas include a
``prefill`` and a ``decode`` role, a request runs in two stages: its prefill stage
(``first_token.prefill_stage``: ``kv_transfer_params: {"do_remote_decode": true}`` and the
stage's ``max_tokens``/``min_tokens``) on a prefill replica (chosen among prefill replicas by the same policy:
prefix affinity, load), whose final response carries the KV handle; then the request
itself, with that handle as its ``kv_transfer_params``, on a decode or mixed replica,
which pulls the prompt's blocks and streams the answer. A streaming request gets the
prefill stage's first token as its first response, as soon as it is sampled, and then the
decode replica's stream with that token cut from its front (``first_token``: exact for
greedy and seeded requests; an unseeded sampled one is given one seed for both stages).
A failed first stage (no prefill replica, an error, no handle) is logged and the request
runs whole on the decode side: the same answer, later. A request that already carries
``kv_transfer_params`` (a client driving the stages itself) is routed as is.

Peer prefix pull (``routing.peer_pull``): otherwise, when the chosen replica lacks a prefix
another replica holds and pulling it is estimated faster than recomputing it, the request
goes with that holder as its ``kv_transfer_params`` handle; the replica pulls the blocks it
lacks (a failed pull: it computes them). Set per attempt: a retry on another replica decides again.

Faults: a replica that refuses the connection (gRPC: "failed to connect") is marked unhealthy
and the request goes to another replica (``max_attempts`` in all). A replica that breaks the
call once the request reached it (it died, before its first response or after; or the router's
channel to it closed under the call, which ``grpc.aio`` reports as ``CancelledError``, told from
the caller's own cancellation by ``Task.cancelling``), or answers
with an error that is its own fault (``contracts.errors.is_replica_fault``: shutting down,
its stub died), is marked unhealthy so new requests avoid it until the health prober sees
it ready again, and the request is migrated (``api.migration``): sent again whole when its
client has nothing yet, resumed (``RequestOptions.resume``) on another replica when it
streamed, the client's stream continuing with no token lost or repeated; each migration is counted
(``pagoda_router_migrations_total``) and is an event (``pagoda.migration``) on the router's
span. The journal reads each response before the P/D splice cuts it (the decode stream's
own tokens); a resume clears the splice (the new replica sends nothing the client has).
Only when the request is not migrated (opted out, the limit spent, not resumable, no
replica left) does the client get ``ReplicaFailed`` naming the replica (or, for a replica's
own error, that error as it was sent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import struct
from typing import Any, AsyncIterator, Optional

import grpc
from tritonclient.grpc import service_pb2

from pagoda.contracts.errors import is_overloaded, is_replica_fault
from pagoda.fleet.api.first_token import FirstTokenMismatch, Splice, is_early, prefill_stage, seeded_for_stages
from pagoda.fleet.api.migration import (CONNECTION_LOST, NO_REPLICA, REPLICA_FAULT, RESUMED, TOKEN_IDS_OUTPUT, Journal,
                                        Migrations, Plan)
from pagoda.fleet.api.routed_request import RoutedRequest
from pagoda.fleet.api.tracing import RouteSpan
from pagoda.fleet.gate.gate import Gate
from pagoda.fleet.routing.peer_pull import PeerPull
from pagoda.fleet.routing.router import Analysis, NoReplicaAvailable, Router
from pagoda.fleet.triton_wire import (bytes_raw, drop_output, keep_outputs, output_number, output_text,
                                      replace_output)

logger = logging.getLogger(__name__)

# gRPC codes that mean "this replica is not there" (connection refused / reset / closed).
DEAD_CODES = (grpc.StatusCode.UNAVAILABLE,)
BROKEN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.CANCELLED)


class ReplicaFailed(RuntimeError):
    """A replica failed while serving a request; the message is meant for the client.

    ``replica_id``: the replica (``None``: not one replica's failure); ``reason``: what
    failed, when migration may help (``migration.CONNECTION_LOST`` or ``REPLICA_FAULT``; ""
    for a failure another replica would repeat, e.g. an error status about the request);
    ``response``: the replica's own error response, relayed as it was when not migrated."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 replica_id: Optional[str] = None, reason: str = "",
                 response: Optional[service_pb2.ModelStreamInferResponse] = None) -> None:
        super().__init__(message)
        self.code = code
        self.replica_id = replica_id
        self.reason = reason
        self.response = response


class GrpcUpstream:
    """Streams routed requests to replicas (module docstring).

    Args:
        router: routing decisions and in-flight accounting.
        gate: the overload memory (``choose``, ``mark_full``).
        max_attempts: replicas tried when a connection is refused.
    """

    def __init__(self, router: Router, gate: Gate, max_attempts: int = 2, peer_pull_min_blocks: int = 4,
                 migrations: Optional[Migrations] = None) -> None:
        self.router = router
        self.gate = gate
        self.max_attempts = max_attempts
        self.migrations = migrations or Migrations()  # pagoda router --migration-limit
        # pagoda router --peer-pull-min-blocks (0: never pull)
        self.peer_pull = PeerPull(min_blocks=max(1, peer_pull_min_blocks), enabled=peer_pull_min_blocks > 0)

    async def stream(self, analysis: Optional[Analysis], request: RoutedRequest,
                     span: RouteSpan) -> AsyncIterator[Any]:
        """Route ``request`` and yield the replica's ``ModelStreamInferResponse`` messages.

        With prefill and decode replicas in the fleet, in two stages (module docstring); a
        streaming request's first response then comes from the prefill stage (``first_token``).

        Raises:
            NoReplicaAvailable: no replica could be chosen.
            ReplicaFailed: the chosen replica failed and the request was not migrated (module
                docstring), or the decode replica's first token differs from the one already streamed.
        """
        skip, may_pull, stage = [], False, _StageOne()
        if self._is_disaggregated(request):
            skip = [r.replica_id for r in self.router.replicas.all() if r.role == "prefill"]
            early = is_early(request.wire)
            request.wire = seeded_for_stages(request.wire, early)
            async for response in self._prefill(analysis, request, span, stage, early):
                yield response
            if stage.handle is not None:
                request.wire = request.wire.with_options(kv_transfer_params=stage.handle)
                self.router.num_two_stage += 1
        else:
            may_pull = self._may_pull(request)
        journal = self.migrations.journal(request.wire)
        span.set_request(request.request_id, request.wire, journal)
        sent, failure = _journaled(request, journal), None
        hides = journal.hides_token_ids or (journal.is_journaled and bool(request.outputs)
                                            and TOKEN_IDS_OUTPUT not in request.outputs)
        while True:
            responses = self._stream_on(analysis, sent, span, skip + journal.failed_replicas, may_pull)
            try:
                async for response in responses:
                    if not response.error_message:
                        _observe(journal, response.infer_response)
                    if stage.splice is not None and not stage.splice.is_done and not response.error_message:
                        _cut_front(response.infer_response, stage.splice)
                    if hides and not response.error_message:
                        drop_output(response.infer_response, TOKEN_IDS_OUTPUT)
                    yield response
                return
            except ReplicaFailed as exc:
                if not exc.reason:
                    raise
                failure = exc
                sent, may_pull = self._migrated(request, journal, exc, stage, span), False
                if sent is None:
                    yield exc.response  # the replica's own error, as it sent it (not migrated)
                    return
            except NoReplicaAvailable as exc:
                if stage.splice is None and failure is None:
                    raise
                if failure is not None:
                    self.migrations.record(failure.reason, Plan(NO_REPLICA, None, str(exc)), failure.replica_id or "",
                                           span, len(journal.token_ids))
                    raise ReplicaFailed(f"{failure} No other replica could continue it: {exc}", failure.code) from None
                raise ReplicaFailed(str(exc)) from None  # the client already has a token: a mid-stream failure
            finally:
                await responses.aclose()

    def _migrated(self, request: RoutedRequest, journal: Journal, failure: ReplicaFailed, stage: "_StageOne",
                  span: RouteSpan) -> Optional[RoutedRequest]:
        """The request to send after ``failure`` (``api.migration``'s plan, counted and traced);
        ``None`` when the failure is the replica's own error response, relayed as it was.

        Raises:
            ReplicaFailed: ``failure`` (the request is not migrated).
        """
        splice = stage.splice if stage.splice is not None and not stage.splice.is_done else None
        plan = journal.plan(failure.replica_id or "", len(splice.text) if splice is not None else 0)
        self.migrations.record(failure.reason, plan, failure.replica_id or "", span, len(journal.token_ids))
        if not plan.migrates:
            if failure.response is not None:
                return None
            raise ReplicaFailed(f"{failure} Not migrated: {plan.detail}.", failure.code, failure.replica_id,
                                failure.reason) from None
        if plan.outcome == RESUMED:
            stage.splice = None  # the resumed replica sends only what the client lacks
        return _routed(request, plan.wire, journal)

    def _is_disaggregated(self, request: RoutedRequest) -> bool:
        roles = {r.role for r in self.router.replicas.routable()}
        # Images take no part in KV transfers yet (serving.kv_transfer_control): one stage.
        return "prefill" in roles and "decode" in roles and request.wire is not None and \
            request.wire.options.kv_transfer_params is None and not request.wire.images

    def _may_pull(self, request: RoutedRequest) -> bool:
        return self.peer_pull.enabled and request.wire is not None and \
            request.wire.options.kv_transfer_params is None and not request.wire.images

    async def _prefill(self, analysis: Optional[Analysis], request: RoutedRequest, span: RouteSpan,
                       stage: "_StageOne", early: bool) -> AsyncIterator[Any]:
        """The first stage on a prefill replica: the prompt computed, the KV handle back into
        ``stage.handle`` (None, and the request runs whole on a decode replica, when it fails).
        Yields its first token's response when that goes to the client early (``first_token``;
        ``stage.splice`` then says what to cut from the decode stream)."""
        # Every output (no ``outputs``): the client's and the KV handle.
        first = RoutedRequest(request.request_id, prefill_stage(request.wire, early),
                              model_version=request.model_version, parameters=request.parameters, turn=request.turn)
        skip = [r.replica_id for r in self.router.replicas.all() if r.role != "prefill"]
        responses = self._stream_on(analysis, first, span, skip)
        try:
            async for response in responses:
                if response.error_message:
                    logger.warning("prefill stage refused: %s", response.error_message)
                    return
                text = output_text(response.infer_response, "kv_transfer_params")
                if text:
                    stage.handle = json.loads(text)
                    return
                if early and stage.splice is None:
                    stage.splice = _splice_of(response.infer_response)
                    yield _early_response(response, request)
        except (NoReplicaAvailable, ReplicaFailed) as exc:
            logger.warning("prefill stage failed (%s); the decode replica computes the prompt", exc)
            return
        finally:
            await responses.aclose()  # the stage's replica is released now, not at collection
        logger.warning("prefill stage gave no KV handle; the decode replica computes the prompt")

    async def _stream_on(self, analysis: Optional[Analysis], request: RoutedRequest, span: RouteSpan,
                         skip: list[str], may_pull: bool = False) -> AsyncIterator[Any]:
        """One stage: a replica not in ``skip`` chosen, retried on refusal or overload;
        ``may_pull``: with a peer's prefix to pull when that is worth it (``peer_pull``)."""
        router, gate = self.router, self.gate
        tried: list[str] = list(skip)
        num_dead = 0
        for attempt in itertools.count(1):
            decision = await gate.choose(router, analysis, tried, attempt, request.turn)
            span.set_decision(decision)
            replica = decision.replica
            wire = self._with_peer_pull(request, decision) if may_pull else None
            message = request.infer_request(span.traceparent, wire)
            num_responses = 0
            call = None
            try:
                call = replica.grpc_stub().ModelStreamInfer(iter((message,)))
                async for response in call:
                    if num_responses == 0 and is_overloaded(response.error_message):
                        gate.mark_full(replica.replica_id)
                        if gate.flow.requeue(request.turn):
                            break  # it waits in the router's queue again (flow control), then goes anywhere
                        tried.append(replica.replica_id)
                        if router.replicas.routable(tried, include_draining=True):
                            break  # another replica may have room
                    if is_replica_fault(response.error_message):  # its own failure: migrated (stream())
                        router.replicas.mark_unhealthy(replica, response.error_message)
                        raise ReplicaFailed(f"replica {replica.replica_id} failed: {response.error_message}",
                                            replica_id=replica.replica_id, reason=REPLICA_FAULT, response=response)
                    num_responses += 1
                    yield response
                else:
                    return
                continue
            except asyncio.CancelledError:
                if _cancelled_by_caller():
                    raise  # its client went (or a sibling prompt failed): the call is cancelled below
                # grpc.aio raises CancelledError from a call cancelled under it, its channel closed
                # (a replica's channel replaced, the fleet closing): the connection was lost.
                raise ReplicaFailed(f"replica {replica.replica_id} ({replica.endpoints['grpc']}): the router's "
                                    "channel to it closed under this request; retry the request",
                                    grpc.StatusCode.CANCELLED, replica.replica_id, CONNECTION_LOST) from None
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code in BROKEN_CODES and not (code == grpc.StatusCode.CANCELLED and num_responses == 0):
                    router.replicas.mark_unhealthy(replica, f"{code.name}: {exc.details()}")
                num_dead += 1
                # Never connected: another replica, as before (not a migration: the request never
                # reached this one). Lost once sent: the migration plan (stream()).
                if num_responses == 0 and code in DEAD_CODES and num_dead < self.max_attempts \
                        and "failed to connect" in (exc.details() or "").lower():
                    tried.append(replica.replica_id)
                    continue
                where = "while streaming this request" if num_responses else "before answering"
                raise ReplicaFailed(f"replica {replica.replica_id} ({replica.endpoints['grpc']}) failed {where}: "
                                    f"{code.name}: {exc.details()}. The router avoids it until it is healthy "
                                    "again; retry the request.", code, replica.replica_id,
                                    CONNECTION_LOST if code in BROKEN_CODES else "") from None
            finally:
                if call is not None and not call.done():
                    call.cancel()
                router.release(decision)

    def _with_peer_pull(self, request: RoutedRequest, decision: Any) -> Optional[Any]:
        """The request's wire with the handle of a peer to pull its prefix from, or None (send it as it is)."""
        params = self.peer_pull.params(decision, self.router.replicas, self.router.block_size)
        if params is None:
            return None
        self.router.num_peer_pulls += 1
        return request.wire.with_options(kv_transfer_params=params)


def _cancelled_by_caller() -> bool:
    """Whether the running task is being cancelled (its client went, a deadline, a sibling's
    failure) rather than handed a ``CancelledError`` by something it awaited."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _journaled(request: RoutedRequest, journal: Journal) -> RoutedRequest:
    """The request as sent: its wire asks for token ids when the router may resume it."""
    return request if journal.wire is request.wire else _routed(request, journal.wire, journal)


def _routed(request: RoutedRequest, wire: Optional[Any], journal: Journal) -> RoutedRequest:
    """``request`` with ``wire``; a client that listed its outputs gets the token ids asked for too."""
    outputs = request.outputs
    if outputs and journal.is_journaled and TOKEN_IDS_OUTPUT not in outputs:
        outputs = (*outputs, TOKEN_IDS_OUTPUT)
    return dataclasses.replace(request, wire=wire, outputs=outputs)


def _observe(journal: Journal, response: Any) -> None:
    """One response relayed: what the journal keeps of it."""
    journal.observe(output_text(response, "text_output"), output_text(response, TOKEN_IDS_OUTPUT),
                    output_number(response, "cumulative_logprob"))


class _StageOne:
    """What the first stage left for the second: the KV handle, and the splice when its first
    token went to the client early."""

    def __init__(self) -> None:
        self.handle: Optional[dict] = None
        self.splice: Optional[Splice] = None


def _splice_of(response: Any) -> Splice:
    return Splice.of(output_text(response, "text_output"), output_number(response, "num_output_tokens"),
                     output_text(response, "logprobs"))


def _early_response(response: Any, request: RoutedRequest) -> Any:
    """The prefill stage's first response as the client's: only the outputs it asked for."""
    if request.outputs:
        keep_outputs(response.infer_response, set(request.outputs))
    return response


def _cut_front(response: Any, splice: Splice) -> None:
    """Cut what the client already has from a decode response (``Splice``), in place.

    Raises:
        ReplicaFailed: the decode stream does not continue the token already streamed.
    """
    outputs = {"text_output": output_text(response, "text_output"),
               "num_output_tokens": output_number(response, "num_output_tokens"),
               "logprobs": output_text(response, "logprobs")}
    try:
        cut = splice.cut({name: value for name, value in outputs.items() if value is not None})
    except FirstTokenMismatch as exc:
        raise ReplicaFailed(str(exc), grpc.StatusCode.INTERNAL) from None
    for name, value in cut.items():
        raw = struct.pack("<I", value) if name == "num_output_tokens" else bytes_raw([value.encode("utf-8")])
        replace_output(response, name, raw)
