"""Triton's ``GRPCInferenceService`` in front of many replicas (the router's gRPC face).

- ``ModelStreamInfer``: every request on a client's stream is routed on its own and sent on
  its own upstream stream to the chosen replica (``upstream.GrpcUpstream``, given by
  ``RouterService`` and shared with the OpenAI door); the replica's responses go back on
  the client's stream unchanged (ids, parameters, outputs), interleaved as they arrive.
  A request for pagoda's model is read once, here, into its ``WireRequest`` (the replica's
  own reader, so a bad input is refused naming it before any replica is asked), salted,
  given the token ids routing made of its prompt, and sent in the wire's canonical form
  (``routed_request``); a request for one of TensorRT-LLM's front models goes as it came.
- ``ModelInfer``: routed the same way, one unary call.
- ``ServerLive`` is the router's own; ``ServerReady`` is true while some replica is
  routable; ``ModelReady``, ``ServerMetadata``, ``ModelMetadata``, ``ModelConfig`` are
  forwarded to a routable replica. Other methods answer UNIMPLEMENTED.

A message over the router's body limit (``--max-body-bytes``) is refused by gRPC itself
with RESOURCE_EXHAUSTED (``make_grpc_server``). A LoRA control request (``lora_action``) is refused here with
INVALID_ARGUMENT: it must reach every replica, which the HTTP door and ``/v1/load_lora_adapter`` do (``lora_admin``).

Faults (``upstream``): a refused connection is retried on another replica; a stream broken
after it began ends with one error response naming the replica. A unary call is retried
the same way on a refused connection (``max_attempts``) and otherwise gets the replica's
gRPC status.

Collaborators come in through the constructor (the router, the tracer, the ``Gate``, the
upstream client); the door keeps no state of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Optional

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pagoda.contracts.errors import ErrorKind, spec_of
from pagoda.fleet.api.routed_request import MAX_ROUTED_PROMPT_CHARS, RoutedRequest, analysis_chars, analyzed
from pagoda.fleet.api.tracing import RouterTracer
from pagoda.fleet.api.upstream import DEAD_CODES, GrpcUpstream, ReplicaFailed
from pagoda.fleet.gate.gate import AuthError, Gate, LimitError, RateLimited
from pagoda.fleet.gate.limits import sampling_of_infer_request
from pagoda.fleet.routing.router import Analysis, NoReplicaAvailable, Router
from pagoda.fleet.triton_wire import read_string_input

# How long a stream refused for its key waits for its first request before ending (see ModelStreamInfer).
AUTH_REFUSAL_READ_S = 5.0

logger = logging.getLogger(__name__)


def analyze_routed(router: Router, request: RoutedRequest) -> Optional[Analysis]:
    """Routing analysis of a request, or ``None`` when its prompt cannot be read (a front's
    request is analyzed by its ``text_input``, ``cache_salt`` and ``lora_name`` as sent). A
    wire request gets the token ids routing made of its prompt (``routed_request.analyzed``)."""
    if request.wire is not None:
        analysis, request.wire = analyzed(router, request.wire)
        return analysis
    prompt = read_string_input(request.raw, "text_input")
    if not prompt or len(prompt) > MAX_ROUTED_PROMPT_CHARS:
        return None
    sampling = read_string_input(request.raw, "sampling_parameters")
    adapter = read_string_input(request.raw, "lora_name") or option_of(sampling, "lora_name")
    return router.analyze(prompt, cache_salt_of(sampling), adapter)


def option_of(sampling_parameters: Any, key: str) -> Optional[str]:
    """A string request option (``cache_salt``, ``lora_name``) of a sampling-parameters JSON
    text or dict (``None`` if absent or invalid: the replica reports invalid ones)."""
    if isinstance(sampling_parameters, str):
        try:
            sampling_parameters = json.loads(sampling_parameters)
        except ValueError:
            return None
    if isinstance(sampling_parameters, dict):
        value = sampling_parameters.get(key)
        return value if isinstance(value, str) and value else None
    return None


def cache_salt_of(sampling_parameters: Any) -> Optional[str]:
    """The ``cache_salt`` of a sampling-parameters JSON text or dict (``None`` if none/invalid)."""
    return option_of(sampling_parameters, "cache_salt")


class GrpcProxy(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The servicer; see the module docstring.

    Args:
        router: routing decisions (unary calls, metadata forwarding, readiness).
        tracer: router spans.
        gate: limits, tenants and overload memory.
        upstream: the streaming client (its ``max_attempts`` bounds unary retries too).
    """

    def __init__(self, router: Router, tracer: RouterTracer, gate: Gate, upstream: GrpcUpstream) -> None:
        self.router = router
        self.tracer = tracer
        self.gate = gate
        self.upstream = upstream
        self.max_attempts = upstream.max_attempts

    # ---------------------------------------------------------------- inference
    async def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - gRPC method name
        carrier = _metadata(context)
        try:
            tenant = self.gate.authenticate(carrier.get("authorization"))
        except AuthError as exc:
            # Refused once the first request is read: a client (tritonclient's stream) that is still
            # sending it would otherwise find its stream broken instead of hearing why.
            with contextlib.suppress(StopAsyncIteration, asyncio.TimeoutError):
                await asyncio.wait_for(request_iterator.__anext__(), AUTH_REFUSAL_READ_S)
            await context.abort(grpc_status(ErrorKind.UNAUTHORIZED), str(exc))
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        tasks: set[asyncio.Task] = set()

        async def serve_one(request: Any) -> None:
            async for response in self._stream_one(request, carrier, tenant):
                await queue.put(response)

        async def read_requests() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(serve_one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                await queue.put(end)

        reader = asyncio.create_task(read_requests())
        try:
            while True:
                item = await queue.get()
                if item is end:
                    break
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _stream_one(self, request: Any, carrier: dict[str, str], tenant: Any) -> AsyncIterator[Any]:
        with self.tracer.route_span("grpc", carrier) as span:
            ticket, relayed = None, False
            try:
                routed, analysis, ticket = await self._admit(request, tenant)
                async for response in self.upstream.stream(analysis, routed, span):
                    if not relayed and response.error_message:
                        ticket.settle(0)  # refused before generating: the quota gets it all back
                    relayed = True
                    yield response
            except (NoReplicaAvailable, ReplicaFailed, LimitError, RateLimited) as exc:
                span.fail(str(exc))
                if ticket is not None and not relayed:
                    ticket.settle(0)
                yield service_pb2.ModelStreamInferResponse(
                    error_message=str(exc),
                    infer_response=service_pb2.ModelInferResponse(
                        id=request.id, model_name=request.model_name, model_version=request.model_version))
            finally:
                if ticket is not None:
                    ticket.release()

    async def _admit(self, request: Any, tenant: Any) -> tuple[RoutedRequest, Optional[Analysis], Any]:
        """Read, limits, tenant salt, routing analysis (and the ids it made), rate limits.

        Raises:
            LimitError: a bad input (naming it) or a limit exceeded.
            RateLimited: the tenant's rate limits.
        """
        gate = self.gate
        if read_string_input(request, "lora_action") is not None:
            gate.count("invalid_input")
            raise LimitError("lora_action: the router's gRPC door routes each request to one replica; send LoRA "
                             "control requests to its HTTP door (`pagoda lora --url http://ROUTER:8080`) or "
                             "/v1/load_lora_adapter, which apply them to every replica", "lora_action")
        try:
            routed = self._read(request, tenant)
        except LimitError:
            gate.count("invalid_input")
            raise
        prompt = routed.prompt or read_string_input(request, "text_input") or ""
        analysis = await gate.analyze(analysis_chars(prompt, routed.wire), analyze_routed, self.router, routed)
        sampling = routed.wire.params if routed.wire is not None else sampling_of_infer_request(request)
        ticket = gate.charge(tenant, analysis.num_prompt_tokens if analysis else 0, sampling)
        routed.turn = gate.turn(tenant, analysis, sampling, routed.wire.options if routed.wire is not None else None)
        return routed, analysis, ticket

    def _read(self, request: Any, tenant: Any) -> RoutedRequest:
        """The client's request read (pagoda's model: into its wire request), checked against the
        limits and salted for its tenant. Raises LimitError naming the problem."""
        limits = self.gate.limits
        prompt = read_string_input(request, "text_input") or ""
        limits.check_prompt(prompt, "text_input")
        encode = getattr(self.router.tokenizer, "encode", None)
        try:
            routed = RoutedRequest.of_infer_request(
                request, encode and (lambda text: encode(text, add_special_tokens=False)))
        except ValueError as exc:
            raise LimitError(str(exc), str(exc).split(":", 1)[0]) from None
        if routed.wire is None:
            limits.check_sampling(sampling_of_infer_request(request))
            return routed
        limits.check_params(routed.wire.params)
        if tenant is not None:
            routed.wire = routed.wire.with_options(cache_salt=self.gate.salt(tenant, routed.wire.options.cache_salt))
        return routed

    async def ModelInfer(self, request, context):  # noqa: N802
        carrier = _metadata(context)
        with self.tracer.route_span("grpc", carrier) as span:
            tried: list[str] = []
            try:
                tenant = self.gate.authenticate(carrier.get("authorization"))
                routed, analysis, ticket = await self._admit(request, tenant)
            except AuthError as exc:
                await context.abort(grpc_status(ErrorKind.UNAUTHORIZED), str(exc))
            except LimitError as exc:
                await context.abort(grpc_status(ErrorKind.INVALID_REQUEST), str(exc))
            except RateLimited as exc:
                await context.abort(grpc_status(ErrorKind.RATE_LIMITED), str(exc))
            try:
                return await self._infer_routed(routed, context, span, analysis, tried)
            except BaseException:
                ticket.settle(0)  # the client got no answer: the quota gets it all back
                raise
            finally:
                ticket.release()

    async def _infer_routed(self, request: RoutedRequest, context: Any, span: Any, analysis: Optional[Analysis],
                            tried: list[str]) -> Any:
        """One unary call, retried on another replica when the connection is refused."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                decision = await self.gate.choose(self.router, analysis, tried, attempt, request.turn)
            except RateLimited as exc:  # the router's queue (flow control) could not hold it
                span.fail(str(exc))
                await context.abort(grpc_status(ErrorKind.RATE_LIMITED), str(exc))
            except NoReplicaAvailable as exc:
                span.fail(str(exc))
                await context.abort(grpc_status(ErrorKind.UNAVAILABLE), str(exc))
            span.set_decision(decision)
            try:
                return await decision.replica.grpc_stub().ModelInfer(request.infer_request(span.traceparent))
            except grpc.aio.AioRpcError as exc:
                if exc.code() in DEAD_CODES:
                    self.router.replicas.mark_unhealthy(decision.replica, f"{exc.code().name}: {exc.details()}")
                    tried.append(decision.replica.replica_id)
                    if attempt < self.max_attempts:
                        continue
                await context.abort(exc.code(), exc.details())
            finally:
                self.router.release(decision)

    # ---------------------------------------------------------------- health and metadata
    async def ServerLive(self, request, context):  # noqa: N802
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # noqa: N802
        return service_pb2.ServerReadyResponse(ready=bool(self.router.replicas.routable()))

    async def ModelReady(self, request, context):  # noqa: N802
        if not self.router.replicas.routable():
            return service_pb2.ModelReadyResponse(ready=False)
        return await self._forward("ModelReady", request, context)

    async def ServerMetadata(self, request, context):  # noqa: N802
        return await self._forward("ServerMetadata", request, context)

    async def ModelMetadata(self, request, context):  # noqa: N802
        return await self._forward("ModelMetadata", request, context)

    async def ModelConfig(self, request, context):  # noqa: N802
        # The engine's configuration is not for anonymous callers when the router has keys.
        try:
            self.gate.authenticate(_metadata(context).get("authorization"))
        except AuthError as exc:
            await context.abort(grpc_status(ErrorKind.UNAUTHORIZED), str(exc))
        return await self._forward("ModelConfig", request, context)

    async def _forward(self, method: str, request: Any, context: Any) -> Any:
        """Send a metadata call to the least busy routable replica, trying the next if one is gone."""
        for replica in sorted(self.router.replicas.routable(), key=lambda r: r.in_flight):
            try:
                return await getattr(replica.grpc_stub(), method)(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in DEAD_CODES:
                    await context.abort(exc.code(), exc.details())
                self.router.replicas.mark_unhealthy(replica, f"{exc.code().name}: {exc.details()}")
        await context.abort(grpc_status(ErrorKind.UNAVAILABLE), self.router._no_replica_message(()))


def grpc_status(kind: ErrorKind) -> grpc.StatusCode:
    """The gRPC status the router answers ``kind`` with (``pagoda.contracts.errors``)."""
    return grpc.StatusCode[spec_of(kind).grpc_status]


def _metadata(context: Any) -> dict[str, str]:
    try:
        return {key.lower(): value for key, value in (context.invocation_metadata() or ())
                if isinstance(value, str)}
    except Exception:  # noqa: BLE001 - metadata is optional
        return {}


def make_grpc_server(proxy: GrpcProxy, host: str, port: int) -> tuple[Any, int]:
    """A ``grpc.aio`` server with the proxy on ``host:port``; returns (server, bound port).

    It receives messages of at most the HTTP body limit (``RequestLimits.max_body_bytes``,
    ``--max-body-bytes``): gRPC refuses a larger one from its length prefix, before it is
    buffered or parsed, with RESOURCE_EXHAUSTED ``Received message larger than max (N vs.
    LIMIT)``, ending that call only. Answers are not limited (the replica bounds them).
    """
    options = [("grpc.max_send_message_length", -1),
               ("grpc.max_receive_message_length", proxy.gate.limits.max_body_bytes)]
    server = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(proxy, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the router's gRPC port {host}:{port}")
    return server, bound
