"""The router's HTTP face (aiohttp): Triton's generate extension, health, metadata, metrics.

- ``POST /v2/models/{model}/generate`` and ``generate_stream``: the JSON body is routed by
  its ``text_input`` (and ``sampling_parameters.cache_salt``) and forwarded to the chosen
  replica's HTTP port with one key added, ``traceparent`` (Triton turns top-level keys
  that are not inputs into request parameters, the channel that reaches the backend). The
  replica's status, body and SSE events come back byte for byte. A body that is not a JSON
  object is forwarded unchanged, routed by load, so its error is the replica's own.
- ``POST /v2/models/{model}/infer`` and every other ``GET /v2/...`` are forwarded.
- ``GET /v2/health/live`` (the router runs) and ``/v2/health/ready`` (some replica is
  routable) are answered here; ``GET /metrics`` shows the router's own counters.
- The OpenAI routes come from ``pagoda.fleet.openai_api``.

Faults as in ``grpc_proxy``: a refused connection is retried on another replica; a stream
broken mid-way ends with one SSE event ``data: {"error": "..."}`` (Triton's own SSE error
shape) naming the replica, which is marked unhealthy; a non-streaming request gets 502.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

import aiohttp
from aiohttp import web

from pagoda.fleet.grpc_proxy import MAX_ROUTED_PROMPT_CHARS, cache_salt_of, option_of
from pagoda.fleet.router_core import Analysis, NoReplicaAvailable, Router
from pagoda.fleet.tracing import TRACEPARENT, RouterTracer

logger = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", Router)
TRACER_KEY = web.AppKey("tracer", RouterTracer)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
MAX_ATTEMPTS = 2
_FORWARDED_HEADERS = ("Content-Type", "Content-Length")


def make_app(router: Router, tracer: RouterTracer, openai: Any = None) -> web.Application:
    """The HTTP application; ``openai`` (an ``OpenAIApi``) adds the ``/v1`` routes."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ROUTER_KEY] = router
    app[TRACER_KEY] = tracer
    app.cleanup_ctx.append(_client_session)
    app.router.add_get("/v2/health/live", _live)
    app.router.add_get("/v2/health/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v2/models/{model}/generate", _generate)
    app.router.add_post("/v2/models/{model}/generate_stream", _generate)
    app.router.add_post("/v2/models/{model}/versions/{version}/generate", _generate)
    app.router.add_post("/v2/models/{model}/versions/{version}/generate_stream", _generate)
    app.router.add_post("/v2/models/{model}/infer", _generate)
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


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _analysis_of(router: Router, document: Any) -> Optional[Analysis]:
    if not isinstance(document, dict):
        return None
    prompt = document.get("text_input")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_ROUTED_PROMPT_CHARS:
        return None
    sampling = document.get("sampling_parameters")
    adapter = document.get("lora_name") if isinstance(document.get("lora_name"), str) else None
    return router.analyze(prompt, cache_salt_of(sampling), adapter or option_of(sampling, "lora_name"))


async def _generate(request: web.Request) -> web.StreamResponse:
    router, tracer = request.app[ROUTER_KEY], request.app[TRACER_KEY]
    body = await request.read()
    try:
        document = json.loads(body) if request.path.endswith(("generate", "generate_stream")) else None
    except ValueError:
        document = None
    carrier = {TRACEPARENT: request.headers[TRACEPARENT]} if TRACEPARENT in request.headers else {}
    with tracer.route_span("http", carrier) as span:
        analysis = _analysis_of(router, document)
        tried: list[str] = []
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                decision = await router.choose(analysis, exclude=tried, attempt=attempt)
            except NoReplicaAvailable as exc:
                span.fail(str(exc))
                return _error(503, str(exc))
            span.set_decision(decision)
            payload = body
            if isinstance(document, dict) and span.traceparent:
                payload = json.dumps({**document, TRACEPARENT: span.traceparent}).encode()
            replica = decision.replica
            try:
                headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
                upstream = await request.app[SESSION_KEY].post(
                    f"http://{replica.endpoints['http']}{request.path_qs}", data=payload, headers=headers)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                router.release(decision)
                router.replicas.mark_unhealthy(replica, f"HTTP connection failed: {exc}")
                tried.append(replica.replica_id)
                if attempt < MAX_ATTEMPTS:
                    continue
                span.fail(str(exc))
                return _error(502, f"replica {replica.replica_id} is unreachable: {exc}")
            try:
                return await _relay(request, upstream, router, decision, span)
            finally:
                upstream.close()
                router.release(decision)
    raise AssertionError("unreachable: the attempt loop always returns")


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse, router: Router, decision: Any,
                 span: Any) -> web.StreamResponse:
    """Copy the replica's answer to the client; an SSE answer chunk by chunk."""
    replica = decision.replica
    content_type = upstream.headers.get("Content-Type", "application/json")
    is_sse = content_type.startswith("text/event-stream")
    failure = None
    if not is_sse:
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            failure = f"replica {replica.replica_id} failed before answering: {type(exc).__name__}: {exc}"
            router.replicas.mark_unhealthy(replica, failure)
            span.fail(failure)
            return _error(502, failure + ". The router avoids it until it is healthy again; retry the request.")
        return web.Response(status=upstream.status, body=data, headers={"Content-Type": content_type})
    response = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type,
                                                                    "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        failure = (f"replica {replica.replica_id} failed while streaming this request: {type(exc).__name__}: "
                   f"{exc}. The router avoids it until it is healthy again; retry the request.")
        router.replicas.mark_unhealthy(replica, failure)
        span.fail(failure)
        await response.write(f"data: {json.dumps({'error': failure})}\n\n".encode())
    await response.write_eof()
    return response


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
    return _error(503, router._no_replica_message(()))


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=render_metrics(request.app[ROUTER_KEY]), content_type="text/plain")


def render_metrics(router: Router) -> str:
    """The router's counters in the Prometheus text format."""
    times = sorted(router.decision_times_s)

    def quantile(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))] if times else 0.0

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
        *(f'pagoda_router_replica_in_flight{{replica_id="{r.replica_id}"}} {r.in_flight}' for r in router.replicas.all()),
        "# TYPE pagoda_router_replica_requests_total counter",
        *(f'pagoda_router_replica_requests_total{{replica_id="{r.replica_id}"}} {r.num_routed}' for r in router.replicas.all()),
        "# TYPE pagoda_router_replica_healthy gauge",
        *(f'pagoda_router_replica_healthy{{replica_id="{r.replica_id}"}} {int(r.healthy)}' for r in router.replicas.all()),
        *router.metric_lines(),
    ]
    return "\n".join(lines) + "\n"
