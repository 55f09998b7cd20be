"""Engine spans of a traced request, joined to the caller's trace (W3C ``traceparent``).

The router (``pagoda.fleet.api.tracing``) puts a ``traceparent`` into each forwarded request as
a Triton *request parameter* (gRPC ``ModelInferRequest.parameters``; a top-level key of an
HTTP ``generate`` body). Request parameters reach the Python backend through
``request.parameters()`` (a JSON object); HTTP headers do not. ``model.py`` reads it with
``read_traceparent`` and the engine loop calls ``RequestTracer.record`` once, when the
request finishes, with its final ``RequestOutput``.

Spans are built after the fact from ``RequestMetrics``'s wall-clock timestamps, so the
engine thread never holds a span open and tracing costs nothing per step::

    pagoda.engine.request   [arrival .......................................... finished]
      engine.queued         [arrival .. first scheduled]
      engine.prefill                    [first scheduled .. first token]
      engine.first_token                                    | (zero length)
      engine.decode                                         [first token ...... finished]
      engine.finished                                                                    |

Tracing is on only when an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``PAGODA_OTLP_ENDPOINT``) and the OpenTelemetry SDK is installed; requests without a
``traceparent`` are never traced. Spans leave through a ``BatchSpanProcessor`` (its own
thread), on a local ``TracerProvider`` (the process-global one is left alone).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

TRACEPARENT_PARAMETER = "traceparent"
ENDPOINT_ENV_VARS = ("PAGODA_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def read_traceparent(parameters: Any) -> Optional[str]:
    """The ``traceparent`` request parameter, or ``None``.

    Args:
        parameters: what ``request.parameters()`` returns (a JSON object as text) or a dict.
    """
    if isinstance(parameters, (str, bytes)):
        try:
            parameters = json.loads(parameters or "{}")
        except ValueError:
            return None
    if not isinstance(parameters, Mapping):
        return None
    value = parameters.get(TRACEPARENT_PARAMETER)
    return value if isinstance(value, str) and value else None


def _ns(seconds: Optional[float]) -> Optional[int]:
    return None if seconds is None else int(seconds * 1e9)


class RequestTracer:
    """Turns a finished request's timestamps into spans under its caller's trace.

    Args:
        exporter: an OpenTelemetry ``SpanExporter`` (OTLP in production, in-memory in tests).
        service_name: the ``service.name`` resource attribute.
        batch: export through a ``BatchSpanProcessor`` (else a synchronous one, for tests).
    """

    def __init__(self, exporter: Any, service_name: str = "pagoda-replica", batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagoda.serving")
        self._propagator = TraceContextTextMapPropagator()

    def record(self, traceparent: Optional[str], output: Any) -> None:
        """Emit the spans of one finished request (nothing without a valid traceparent).

        Args:
            traceparent: the W3C header value the request carried.
            output: the request's final ``RequestOutput``.
        """
        if not traceparent:
            return
        context = self._propagator.extract({TRACEPARENT_PARAMETER: traceparent})
        metrics = output.metrics
        start = _ns(metrics.arrival_time)
        end = _ns(metrics.finished_time or metrics.last_token_time or metrics.first_token_time or metrics.arrival_time)
        scheduled = _ns(metrics.first_scheduled_time)
        first_token = _ns(metrics.first_token_time)
        finish_reasons = [c.finish_reason or "" for c in output.outputs]
        root = self._tracer.start_span("pagoda.engine.request", context=context, start_time=start, attributes={
            "pagoda.request_id": output.request_id,
            "pagoda.num_prompt_tokens": len(output.prompt_token_ids),
            "pagoda.num_cached_tokens": int(output.num_cached_tokens),
            "pagoda.num_output_tokens": sum(len(c.token_ids) for c in output.outputs),
            "pagoda.finish_reason": ",".join(finish_reasons),
        })
        from opentelemetry import trace

        child_context = trace.set_span_in_context(root)

        def child(name: str, begin: Optional[int], finish: Optional[int]) -> None:
            if begin is None or finish is None:
                return
            self._tracer.start_span(name, context=child_context, start_time=begin).end(end_time=max(begin, finish))

        child("engine.queued", start, scheduled)
        child("engine.prefill", scheduled, first_token)
        child("engine.first_token", first_token, first_token)
        child("engine.decode", first_token, end)
        child("engine.finished", end, end)
        root.end(end_time=max(start, end))

    def shutdown(self) -> None:
        """Flush what is queued and stop the export thread."""
        self._provider.shutdown()


def otlp_endpoint_from_env(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    for name in ENDPOINT_ENV_VARS:
        if environ.get(name):
            return environ[name]
    return None


def make_request_tracer(endpoint: Optional[str] = None) -> Optional[RequestTracer]:
    """A tracer exporting over OTLP/gRPC, or ``None`` when tracing is off.

    Args:
        endpoint: ``host:port`` or ``http://host:port`` of an OTLP/gRPC receiver; ``None``
            reads ``PAGODA_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``.

    Returns:
        ``None`` when no endpoint is set or the OpenTelemetry packages are missing (logged).
    """
    endpoint = endpoint or otlp_endpoint_from_env()
    if not endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        logger.warning("OTLP endpoint %s set but opentelemetry-exporter-otlp-proto-grpc is not installed; "
                       "engine tracing is off", endpoint)
        return None
    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    return RequestTracer(exporter, service_name=os.environ.get("OTEL_SERVICE_NAME", "pagoda-replica"))
