"""Router spans: one OpenTelemetry span per routed request, its context sent to the replica.

A routed request gets the span ``pagoda.router.request`` from the moment the router reads
it until its last response leaves. Its attributes record the decision:

- ``pagoda.policy`` (the policy that decided: the configured one, or ``least_loaded``
  when Redis is unavailable and routing fell back to load only), ``pagoda.replica_id``,
  ``pagoda.matched_blocks`` (exact: the KV-event index), ``pagoda.pending_blocks``
  (routing-time affinity beyond the exact match), ``pagoda.shared_blocks`` (the KV shared tier
  the replica mounts, beyond the exact match), ``pagoda.match_kind``
  (exact|pending|none), ``pagoda.num_prompt_tokens``, ``pagoda.num_prompt_blocks``,
  ``pagoda.redis_available``, ``pagoda.decision_ms``, ``pagoda.protocol`` and
  ``pagoda.num_attempts`` (more than one when a replica refused the connection);
- OpenTelemetry's ``gen_ai`` attributes under the names the engine's span uses
  (``serving.tracing``): ``gen_ai.request.id`` and the sampling values (``.n``,
  ``.max_tokens``, ``.temperature``, ``.top_p``, ``.top_k``) of pagoda's model's requests,
  ``gen_ai.usage.prompt_tokens`` (the router's own count, from routing) and, for a request
  the router journaled (``api.migration``: it reads every token id the client gets),
  ``gen_ai.usage.completion_tokens``;
- an error status when the request failed (the replica died, no replica was available);
- a ``pagoda.migration`` event per replica failure the request met (``api.migration``):
  the replica, the reason, the outcome (restarted, resumed, or why not migrated), the
  tokens the client had.

Propagation (W3C Trace Context): a ``traceparent`` the client sent (gRPC metadata or HTTP
header) becomes the span's parent; the span's own ``traceparent`` is forwarded to the
replica as the Triton request parameter ``traceparent``, the one channel that reaches the
Python backend (``pagoda.serving.tracing`` builds the engine spans from it).

With tracing off (no exporter configured) no span is made and a client's ``traceparent``
is forwarded unchanged, so a trace started upstream still reaches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

TRACEPARENT = "traceparent"


class RouteSpan:
    """The handle a request holds while it is routed: attributes, errors, the context to forward."""

    def __init__(self, span: Optional["Span"] = None, traceparent: Optional[str] = None) -> None:
        self._span = span
        self.traceparent = traceparent
        self._journal: Any = None

    def set_request(self, request_id: Optional[str], wire: Any, journal: Any = None) -> None:
        """The ``gen_ai.request.*`` attributes of pagoda's model's request (``request_id``: the
        client's, when it sent one; ``wire``: its ``WireRequest``, ``None`` for another model's);
        ``journal``: the migration journal whose token ids become ``gen_ai.usage.completion_tokens``
        at the end."""
        if self._span is None:
            return
        from pagoda.serving.tracing import gen_ai_request_attributes

        if request_id:
            self._span.set_attribute("gen_ai.request.id", request_id)
        if wire is not None:
            self._span.set_attributes(gen_ai_request_attributes(wire.params))
        self._journal = journal

    def set_decision(self, decision: Any) -> None:
        if self._span is None:
            return
        self._span.set_attributes({
            "pagoda.policy": decision.policy,
            "pagoda.replica_id": decision.replica.replica_id,
            "pagoda.matched_blocks": decision.matched_blocks,
            "pagoda.pending_blocks": getattr(decision, "pending_blocks", 0),
            "pagoda.shared_blocks": getattr(decision, "shared_blocks", 0),
            "pagoda.match_kind": getattr(decision, "match_kind", "exact" if decision.matched_blocks else "none"),
            "pagoda.num_prompt_tokens": decision.num_prompt_tokens,
            "pagoda.num_prompt_blocks": decision.num_prompt_blocks,
            "pagoda.redis_available": decision.redis_available,
            "pagoda.decision_ms": round(decision.decision_s * 1e3, 4),
            "pagoda.num_attempts": decision.attempt,
        })
        if decision.num_prompt_tokens:
            self._span.set_attribute("gen_ai.usage.prompt_tokens", decision.num_prompt_tokens)

    def finish(self) -> None:
        """The usage known when the request ends (``set_request``'s journal)."""
        journal = self._journal
        if self._span is not None and journal is not None and journal.is_journaled and journal.has_token_ids:
            self._span.set_attribute("gen_ai.usage.completion_tokens", len(journal.token_ids))

    def set_attribute(self, key: str, value: Any) -> None:
        if self._span is not None:
            self._span.set_attribute(key, value)

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        """An event on the span (a migration: ``api.upstream``)."""
        if self._span is not None:
            self._span.add_event(name, attributes)

    def fail(self, message: str) -> None:
        if self._span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))


class RouterTracer:
    """Makes router spans on a local ``TracerProvider``.

    Args:
        exporter: a ``SpanExporter``; ``None`` turns tracing off.
        batch: export through a ``BatchSpanProcessor`` (off in tests that read spans at once).
        service_name: the ``service.name`` resource attribute.
    """

    def __init__(self, exporter: Optional["SpanExporter"] = None, batch: bool = True,
                 service_name: str = "pagoda-router") -> None:
        self.enabled = exporter is not None
        self._provider = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagoda.fleet.service")
        self._propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def route_span(self, protocol: str, carrier: Optional[Mapping[str, str]] = None) -> Iterator[RouteSpan]:
        """A span for one routed request; ``carrier`` holds the client's ``traceparent`` if any.

        Yields:
            A ``RouteSpan`` whose ``traceparent`` goes to the replica.
        """
        incoming = (carrier or {}).get(TRACEPARENT)
        if not self.enabled:
            yield RouteSpan(None, incoming)
            return
        parent = self._propagator.extract({TRACEPARENT: incoming}) if incoming else None
        # Not made "current": the request's work spans tasks and async generators, where
        # attaching a context in one and detaching it in another is an error.
        span = self._tracer.start_span("pagoda.router.request", context=parent, kind=_server_kind(),
                                       attributes={"pagoda.protocol": protocol})
        from opentelemetry import trace

        outgoing: dict[str, str] = {}
        self._propagator.inject(outgoing, context=trace.set_span_in_context(span))
        handle = RouteSpan(span, outgoing.get(TRACEPARENT))
        try:
            yield handle
        except (GeneratorExit, asyncio.CancelledError):
            span.set_attribute("pagoda.cancelled", True)  # the client went away: not an error
            raise
        except BaseException as exc:
            handle.fail(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            handle.finish()
            span.end()

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()

    def force_flush(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()


def _server_kind() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER


def make_router_tracer(otlp_endpoint: Optional[str]) -> RouterTracer:
    """Tracing over OTLP/gRPC to ``otlp_endpoint``; off when it is ``None``.

    Raises:
        RuntimeError: an endpoint is given but the OTLP exporter package is missing.
    """
    if not otlp_endpoint:
        return RouterTracer(None)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise RuntimeError(
            "--otlp-endpoint needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-grpc") from None
    return RouterTracer(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=not otlp_endpoint.startswith("https://")))
