"""The router's HTTP face (aiohttp): Triton's generate extension, health, metadata, metrics.

- ``POST /v2/models/{model}/generate`` and ``generate_stream``: the body is checked here
  (``generate_body.validate_generate_body``: a JSON object of known inputs with the right JSON
  types, within the limits; else 400 naming the problem, where tritonserver itself would
  answer 500); a body for pagoda's model is read into its ``WireRequest`` (the replica's own
  reader, so a value it would refuse is refused here, naming it: ``generate_request``),
  given the tenant's ``cache_salt`` (``gate``), routed by its prompt and salt, and forwarded
  to the chosen replica's HTTP port in the wire's JSON form, with the token ids routing made
  of the prompt and one key added, ``traceparent`` (Triton turns top-level keys that are not
  inputs into request parameters, the channel that reaches the backend); a body for one of
  TensorRT-LLM's front models goes as it came, salted in its ``parameters``. The replica's status, body and SSE
  events come back byte for byte (less the token ids the router asked for, ``http_relay``), except an
  overload refusal: the request is tried on
  another replica, and only when all are full does the client get 503 + ``Retry-After``.
  With prefill and decode replicas, a generate body runs in two stages (``http_stages``;
  a streaming one gets the prefill replica's first token first).
- a LoRA control request on ``generate`` (a body with ``lora_action``; ``pagoda lora
  --url`` the router) is the router's own: ``list`` answers the adapters the router
  serves; ``load``/``unload`` go to every replica as ``/v1/load_lora_adapter`` does
  (``lora_admin``; refused with 403 unless ``--allow-runtime-lora``). The answer has the
  replica's shape: ``{"text_output": "<JSON document>"}`` or ``{"error": "..."}``.
- ``POST /v2/models/{model}[/versions/{v}]/infer`` is checked as a KServe v2 request (``fleet/gate/infer_body``:
  strict JSON, the protocol's keys and types, the prompt and sampling limits) and forwarded; every other
  ``GET /v2/...`` is forwarded.
- ``GET /v2/health/live`` (the router runs) and ``/v2/health/ready`` (some replica is
  routable) are answered here; ``GET /metrics`` shows the router's own counters and every
  replica's ``vllm:`` series with a ``replica_id`` label (``fleet_metrics``).
- The OpenAI routes come from ``pagoda.fleet.api.openai_api``.
- Collaborators (router, tracer, ``Gate``, ``LoRAAdmin``) are given to ``make_app`` by
  ``RouterService`` and kept on the application (``ROUTER_KEY``, ``GATE_KEY``, ...); the
  door creates none of them. Its own upstream client is the aiohttp session it opens.
- ``http_gate.gate_middleware`` runs first on every ``/v1`` request and every ``POST /v2/models``:
  the body size from ``Content-Length`` (413 before reading a byte), then the API key
  (401). A client that disconnects mid-answer is logged at INFO, not as an error. A handler
  that ends in ``CancelledError`` its client did not cause (a gRPC call whose channel closed
  under it) answers 502 naming it, rather than a connection closed without a response.

Faults as in ``grpc_proxy``: a refused connection is retried on another replica; a replica
that fails a request (its connection breaks, or it answers with an error that is its own
fault) is marked unhealthy and the request is migrated (``api.migration``): sent again whole
when its client has nothing yet, resumed on another replica when it streamed (the SSE answer
stays open, the next replica's events follow, ``http_relay``). Not migrated, a stream ends
with one SSE event ``data: {"error": "..."}`` (Triton's own SSE error shape) naming the
replica, and a non-streaming request gets 502 (or the replica's own error as it sent it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import TYPE_CHECKING, Any, Optional

import aiohttp
from aiohttp import web

from pagoda.contracts.errors import ErrorKind, spec_of
from pagoda.fleet.gate.gate import (TENANT_KEY, Gate, LimitError, QueueRefused, RateLimited, Turn,
                                    retry_after_header)
from pagoda.fleet.api import http_stages
from pagoda.fleet.api.http_gate import GATE_KEY, gate_middleware, triton_error as _error
from pagoda.fleet.api.fleet_metrics import merge_vllm_series, scrape_replicas
from pagoda.fleet.api.generate_request import GenerateRequest
from pagoda.fleet.api.routed_request import analysis_chars, as_released
from pagoda.fleet.api.http_relay import Broken, Relay
from pagoda.fleet.api.migration import CONNECTION_LOST, NO_REPLICA, Journal, Migrations, Plan
from pagoda.fleet.gate.infer_body import validate_infer_body
from pagoda.fleet.gate.generate_body import FRONT_INPUTS, validate_generate_body
from pagoda.fleet.api.lora_admin import LoRAAdmin, check_change
from pagoda.fleet.routing.router import Analysis, NoReplicaAvailable, Router
from pagoda.fleet.api.tracing import TRACEPARENT, RouterTracer

if TYPE_CHECKING:
    from pagoda.fleet.api.openai_api import OpenAIApi

logger = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", Router)
TRACER_KEY = web.AppKey("tracer", RouterTracer)
LORA_KEY = web.AppKey("lora_admin", LoRAAdmin)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
MIGRATIONS_KEY = web.AppKey("migrations", Migrations)
SCRAPE_FAILURES_KEY = web.AppKey("scrape_failures", list)  # [count]: replicas' /metrics that did not answer
MAX_ATTEMPTS = 2
_FORWARDED_HEADERS = ("Content-Type", "Content-Length")


def make_app(router: Router, tracer: RouterTracer, gate: Gate, lora_admin: LoRAAdmin,
             openai: Optional["OpenAIApi"] = None, migrations: Optional[Migrations] = None) -> web.Application:
    """The HTTP application over the collaborators ``RouterService`` composed; ``openai``
    (an ``OpenAIApi``) adds the ``/v1`` routes; ``migrations``: the router's (the upstream
    client's, so ``/metrics`` counts every door's; a default one when ``None``)."""
    # A chunked body (no Content-Length) is cut off at the same size while it is read.
    app = web.Application(client_max_size=gate.limits.max_body_bytes, middlewares=[gate_middleware])
    app[ROUTER_KEY] = router
    app[TRACER_KEY] = tracer
    app[GATE_KEY] = gate
    app[LORA_KEY] = lora_admin
    app[MIGRATIONS_KEY] = migrations if migrations is not None else Migrations()
    app[SCRAPE_FAILURES_KEY] = [0]
    app.cleanup_ctx.append(_client_session)
    app.router.add_get("/v2/health/live", _live)
    app.router.add_get("/v2/health/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v2/models/{model}/generate", _generate)
    app.router.add_post("/v2/models/{model}/generate_stream", _generate)
    app.router.add_post("/v2/models/{model}/versions/{version}/generate", _generate)
    app.router.add_post("/v2/models/{model}/versions/{version}/generate_stream", _generate)
    app.router.add_post("/v2/models/{model}/infer", _generate)
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", _generate)
    app.router.add_get("/v2{tail:.*}", _forward_get)
    if openai is not None:
        openai.add_routes(app)
    return app


async def _client_session(app: web.Application):
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        app[SESSION_KEY] = session
        yield


async def _live(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _ready(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ROUTER_KEY].replicas.routable() else 503)


def _kind_error(kind: ErrorKind, message: str, headers: Optional[dict[str, str]] = None) -> web.Response:
    """Triton's ``{"error"}`` answer with the status ``pagoda.contracts.errors`` gives ``kind``."""
    return _error(spec_of(kind).triton_http_status, message, headers)


async def _generate(request: web.Request) -> web.StreamResponse:
    router, tracer, gate = request.app[ROUTER_KEY], request.app[TRACER_KEY], request.app[GATE_KEY]
    body = await request.read()
    generate, analysis, ticket, turn = None, None, None, None
    if request.path.endswith(("generate", "generate_stream")):
        try:
            model = request.match_info.get("model", "pagoda")
            document = validate_generate_body(body, gate.limits, model)
            if "lora_action" in document:
                return await _lora_control(request, router, document)
            generate = _read_generate(document, model, router)
            tenant = request.get(TENANT_KEY)
            if tenant is not None:
                salt = generate.wire.options.cache_salt if generate.wire is not None else None
                generate = generate.salted(gate.salt(tenant, salt))
            size = analysis_chars(generate.prompt, generate.wire)
            analysis, generate = await gate.analyze(size, generate.analyzed, router)
            ticket = gate.charge(tenant, analysis.num_prompt_tokens if analysis else 0, generate.sampling)
            turn = gate.turn(tenant, analysis, generate.sampling, generate.wire.options if generate.wire else None)
        except LimitError as exc:
            gate.count("invalid_input")
            return _error(exc.status, str(exc))
        except RateLimited as exc:
            return _kind_error(ErrorKind.RATE_LIMITED, str(exc), retry_after_header(exc.retry_after_s))
    else:  # /infer: KServe v2 bodies, checked before they reach a replica (fleet/gate/infer_body.py)
        try:
            validate_infer_body(body, request.headers.get("Inference-Header-Content-Length"), gate.limits)
        except LimitError as exc:
            gate.count("invalid_input")
            return _error(exc.status, str(exc))
    carrier = {TRACEPARENT: request.headers[TRACEPARENT]} if TRACEPARENT in request.headers else {}
    try:
        with tracer.route_span("http", carrier) as span:
            response = await _route(request, body, generate, analysis, span, turn)
        if ticket is not None and response.status != 200:
            ticket.settle(0)  # refused or failed before generating: the quota gets it all back
        return response
    finally:
        if ticket is not None:
            ticket.release()


def _read_generate(document: dict[str, Any], model: str, router: Router) -> GenerateRequest:
    """A checked body as the door forwards it (``generate_request``). Raises LimitError naming what
    pagoda's model would refuse."""
    encode = getattr(router.tokenizer, "encode", None)
    try:
        return GenerateRequest.of_document(document, model, model in FRONT_INPUTS,
                                           encode and (lambda text: encode(text, add_special_tokens=False)))
    except ValueError as exc:
        raise LimitError(str(exc), str(exc).split(":", 1)[0]) from None


async def _lora_control(request: web.Request, router: Router, document: dict[str, Any]) -> web.Response:
    """A LoRA control request at the router: listed from its own state, or applied to every replica."""
    admin = request.app[LORA_KEY]
    action, name, path = (document.get(key) for key in ("lora_action", "lora_name", "lora_path"))
    extra = sorted(set(document) - {"lora_action", "lora_name", "lora_path", TRACEPARENT})
    if extra:
        return _error(400, f"lora_action: a LoRA control request takes only lora_action, lora_name and lora_path; "
                           f"it cannot be combined with generation inputs ({', '.join(extra)})")
    if action == "list":
        answer = admin.list_document()
    elif action not in ("load", "unload"):
        return _error(400, f"lora_action: must be one of load, unload, list, got {action!r}")
    elif not admin.allow_runtime:
        return _kind_error(ErrorKind.PERMISSION_DENIED, f"lora_action {action!r}: runtime LoRA updating is not enabled "
                           "on this router; start it with `pagoda router --allow-runtime-lora`")
    elif not name or (action == "load" and not path):
        missing = "lora_name" if not name else "lora_path"
        return _error(400, f"{missing}: required by lora_action {action!r}")
    elif (refused := check_change(request.get(TENANT_KEY), name)) is not None:
        if refused[0] == "forbidden":
            return _kind_error(ErrorKind.PERMISSION_DENIED, refused[1])
        return _error(400, refused[1])
    else:
        replicas = router.replicas.routable()
        result = await (admin.load(replicas, name, path) if action == "load" else admin.unload(replicas, name))
        if result.error is not None:
            return _error(result.status, result.error)
        answer = result.document
    return web.json_response({"model_name": request.match_info.get("model", "pagoda"),
                              "text_output": json.dumps(answer)})


async def _route(request: web.Request, body: bytes, generate: Optional[GenerateRequest],
                 analysis: Optional[Analysis], span: Any, turn: Optional[Turn] = None) -> web.StreamResponse:
    """Choose a replica and relay its answer (``http_relay``); retry on a refused connection or an
    overload (with flow control: wait in the router's queue for ``turn``, again after an overload);
    when the replica fails the request, migrate it (``api.migration``'s plan)."""
    router, gate, migrations = request.app[ROUTER_KEY], request.app[GATE_KEY], request.app[MIGRATIONS_KEY]
    tried: list[str] = []
    stage = http_stages.StageOne()
    if generate is not None and http_stages.is_disaggregated(router, generate):  # two stages (http_stages)
        tried = [r.replica_id for r in router.replicas.all() if r.role == "prefill"]
        try:
            generate, stage = await http_stages.prefill(request.app[SESSION_KEY], router, gate, analysis, generate,
                                                        request, turn)
        except QueueRefused as exc:
            return _kind_error(ErrorKind.RATE_LIMITED, str(exc), retry_after_header(exc.retry_after_s))
    # An early first token's stream is relayed by http_stages (its own failure handling): not journaled.
    journal = migrations.journal(generate.wire if generate is not None and stage.response is None else None)
    relay, wire = Relay(request, journal, journal.hides_token_ids), journal.wire
    span.set_request(None, generate.wire if generate is not None else None, journal)

    async def failed(kind: ErrorKind, message: str, headers: Optional[dict[str, str]] = None) -> web.StreamResponse:
        span.fail(message)
        if stage.response is not None:  # the early first token went out: the answer is open
            return await http_stages.end_with_error(stage.response, message)
        if relay.response is not None:  # the replica's answer is open: an SSE error event
            return await relay.finish_failed(message)
        return _kind_error(kind, message, headers)

    num_dead = 0
    payload = body
    for attempt in itertools.count(1):
        try:
            decision = await gate.choose(router, analysis, tried + journal.failed_replicas, attempt, turn)
        except QueueRefused as exc:
            return await failed(ErrorKind.RATE_LIMITED, str(exc), retry_after_header(exc.retry_after_s))
        except NoReplicaAvailable as exc:
            return await failed(ErrorKind.REPLICA_FAILED if journal.failed_replicas else ErrorKind.UNAVAILABLE,
                                _no_replica_left(migrations, journal, exc, span))
        span.set_decision(decision)
        if generate is not None:
            payload = await _encoded(generate.body(span.traceparent, wire and as_released(wire, turn)), gate,
                                     len(generate.prompt))
        replica = decision.replica
        try:
            headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
            upstream = await request.app[SESSION_KEY].post(
                f"http://{replica.endpoints['http']}{request.path_qs}", data=payload, headers=headers)
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as exc:  # never connected: not a migration
            router.release(decision)
            router.replicas.mark_unhealthy(replica, f"HTTP connection failed: {exc}")
            tried.append(replica.replica_id)
            num_dead += 1
            if num_dead < MAX_ATTEMPTS:
                continue
            return await failed(ErrorKind.REPLICA_FAILED, f"replica {replica.replica_id} is unreachable: {exc}")
        except aiohttp.ClientConnectionError as exc:  # it took the request and died before answering
            router.release(decision)
            answer: Any = Broken(f"replica {replica.replica_id} failed before answering: {type(exc).__name__}: {exc}")
        else:
            try:
                answer = await (relay.relay(upstream, replica.replica_id) if stage.response is None else
                                http_stages.relay_into(stage, upstream, router, replica, span))
            finally:
                upstream.close()
                router.release(decision)
        if isinstance(answer, Broken):
            router.replicas.mark_unhealthy(replica, answer.message)
            plan = journal.plan(replica.replica_id)
            migrations.record(answer.reason, plan, replica.replica_id, span, len(journal.token_ids))
            if plan.migrates:
                wire = plan.wire
                continue
            if answer.answer is not None:  # the replica's own error, as it sent it
                span.fail(answer.message)
                return web.Response(status=answer.answer[0], body=answer.answer[1],
                                    headers={"Content-Type": "application/json"})
            return await failed(ErrorKind.REPLICA_FAILED, f"{answer.message}. The router avoids it until it is "
                                f"healthy again; retry the request. Not migrated: {plan.detail}.")
        if not isinstance(answer, str):
            return answer
        gate.mark_full(replica.replica_id)
        if gate.flow.requeue(turn):
            continue  # back to the router's queue (flow control) until a replica has room or its deadline
        tried.append(replica.replica_id)
        if not router.replicas.routable(tried, include_draining=True):
            gate.count("overloaded")
            return await failed(ErrorKind.OVERLOADED, answer, retry_after_header())
    raise AssertionError("unreachable: the attempt loop always returns")


def _no_replica_left(migrations: Migrations, journal: Journal, exc: NoReplicaAvailable, span: Any) -> str:
    """The message when no replica can take the request (after a failure: counted as a migration that found none)."""
    if not journal.failed_replicas:
        return str(exc)
    replica_id = journal.failed_replicas[-1]
    migrations.record(CONNECTION_LOST, Plan(NO_REPLICA, None, str(exc)), replica_id, span, len(journal.token_ids))
    return f"replica {replica_id} failed this request and no other replica could continue it: {exc}"


async def _encoded(document: dict[str, Any], gate: Gate, num_chars: int) -> bytes:
    """A body as JSON bytes; a long prompt's (its text and token ids) off the event loop."""
    return await gate.analyze(num_chars, lambda: json.dumps(document).encode())


async def _forward_get(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    for replica in sorted(router.replicas.routable(), key=lambda r: r.in_flight):
        try:
            async with request.app[SESSION_KEY].get(f"http://{replica.endpoints['http']}{request.path_qs}") as upstream:
                return web.Response(status=upstream.status, body=await upstream.read(),
                                    headers={k: upstream.headers[k] for k in _FORWARDED_HEADERS[:1]
                                             if k in upstream.headers})
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            router.replicas.mark_unhealthy(replica, f"HTTP connection failed: {exc}")
    return _kind_error(ErrorKind.UNAVAILABLE, router._no_replica_message(()))


async def _metrics(request: web.Request) -> web.Response:
    """The router's own series, then every replica's ``vllm:`` series labelled (``fleet_metrics``)."""
    router = request.app[ROUTER_KEY]
    scrapes, num_failed = await scrape_replicas(request.app[SESSION_KEY], router.replicas.all())
    counters = request.app[SCRAPE_FAILURES_KEY]
    counters[0] += num_failed
    text = render_metrics(router, request.app[GATE_KEY]) + "\n".join([
        *request.app[MIGRATIONS_KEY].metric_lines(),
        "# TYPE pagoda_router_metrics_scrape_failures_total counter",
        f"pagoda_router_metrics_scrape_failures_total {counters[0]}",
        *merge_vllm_series(scrapes)]) + "\n"
    return web.Response(text=text, content_type="text/plain")


def render_metrics(router: Router, gate: Gate) -> str:
    """The router's counters in the Prometheus text format."""
    times = sorted(router.decision_times_s)

    def quantile(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))] if times else 0.0

    replicas = router.replicas.all()
    refused = {**gate.num_refused, **{f"rate_limited_{k}": v for k, v in gate.limiter.num_limited.items()}}
    lines = [
        "# TYPE pagoda_router_decisions_total counter",
        f"pagoda_router_decisions_total {router.num_decisions}",
        "# TYPE pagoda_router_load_only_decisions_total counter",
        f"pagoda_router_load_only_decisions_total {router.num_fallback_decisions}",
        "# TYPE pagoda_router_redis_available gauge",
        f"pagoda_router_redis_available {int(router.fleet is not None and router.fleet.available)}",
        "# TYPE pagoda_router_decision_seconds summary",
        *(f'pagoda_router_decision_seconds{{quantile="{q}"}} {quantile(q):.6f}' for q in (0.5, 0.9, 0.99)),
        "# TYPE pagoda_router_replica_in_flight gauge",
        *(f'pagoda_router_replica_in_flight{{replica_id="{r.replica_id}"}} {r.in_flight}' for r in replicas),
        "# TYPE pagoda_router_replica_requests_total counter",
        *(f'pagoda_router_replica_requests_total{{replica_id="{r.replica_id}"}} {r.num_routed}' for r in replicas),
        "# TYPE pagoda_router_replica_healthy gauge",
        *(f'pagoda_router_replica_healthy{{replica_id="{r.replica_id}"}} {int(r.healthy)}' for r in replicas),
        *router.metric_lines(),
        *gate.flow.metric_lines(),
        "# TYPE pagoda_router_refused_total counter",
        *(f'pagoda_router_refused_total{{reason="{reason}"}} {count}'
          for reason, count in sorted(refused.items())),
    ]
    return "\n".join(lines) + "\n"
