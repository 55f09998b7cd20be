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

The root span carries OpenTelemetry's ``gen_ai`` attributes under the names vLLM's spans use
(``gen_ai_attributes``): usage (``gen_ai.usage.prompt_tokens`` / ``completion_tokens`` /
``cached_tokens`` / ``num_sequences``), the request (``gen_ai.request.id``, ``.n``,
``.max_tokens``, ``.temperature``, ``.top_p``, ``.top_k``), the response (``gen_ai.response.model``,
``.finish_reasons``) and the latencies in seconds (``gen_ai.latency.time_in_queue``,
``.time_to_first_token``, ``.e2e``, ``.time_in_model_prefill`` / ``_decode`` / ``_inference``).

Each replica's spans name it: the resource's ``service.instance.id`` is its replica id
(``PAGODA_REPLICA_ID``), so a request traced through two replicas (a P/D request's two
stages, a migrated stream) shows which did what.

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


def _seconds(begin: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if begin is None or end is None else max(0.0, end - begin)


def gen_ai_request_attributes(params: Any) -> dict[str, Any]:
    """The ``gen_ai.request.*`` sampling values of a request's ``SamplingParams`` (the engine's
    span and the router's carry the same names).

    Returns:
        ``n``, ``temperature``, ``top_p``, ``top_k`` and, when set, ``max_tokens``.
    """
    attributes: dict[str, Any] = {
        "gen_ai.request.n": params.n, "gen_ai.request.temperature": float(params.temperature),
        "gen_ai.request.top_p": float(params.top_p), "gen_ai.request.top_k": int(params.top_k)}
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = int(params.max_tokens)
    return attributes


def gen_ai_attributes(output: Any, params: Any = None, model_name: Optional[str] = None) -> dict[str, Any]:
    """The ``gen_ai.*`` attributes of one finished request (module docstring).

    Args:
        output: its final ``RequestOutput``.
        params: its ``SamplingParams`` (``None``: no ``gen_ai.request.*`` sampling values).
        model_name: the served model name (``gen_ai.response.model``; ``None``: left out).

    Returns:
        Attribute name -> value; a latency whose timestamps are missing is left out.
    """
    m = output.metrics
    finished = m.finished_time or m.last_token_time
    attributes: dict[str, Any] = {
        "gen_ai.request.id": output.request_id,
        "gen_ai.usage.prompt_tokens": len(output.prompt_token_ids),
        "gen_ai.usage.completion_tokens": sum(len(c.token_ids) for c in output.outputs),
        "gen_ai.usage.cached_tokens": int(output.num_cached_tokens),
        "gen_ai.usage.num_sequences": len(output.outputs),
        "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in output.outputs],
    }
    if model_name:
        attributes["gen_ai.response.model"] = model_name
    if params is not None:
        attributes.update(gen_ai_request_attributes(params))
    latencies = {"time_in_queue": _seconds(m.arrival_time, m.first_scheduled_time),
                 "time_to_first_token": _seconds(m.arrival_time, m.first_token_time),
                 "e2e": _seconds(m.arrival_time, finished),
                 "time_in_model_prefill": _seconds(m.first_scheduled_time, m.first_token_time),
                 "time_in_model_decode": _seconds(m.first_token_time, finished),
                 "time_in_model_inference": _seconds(m.first_scheduled_time, finished)}
    attributes.update({f"gen_ai.latency.{k}": v for k, v in latencies.items() if v is not None})
    return attributes


class RequestTracer:
    """Turns a finished request's timestamps into spans under its caller's trace.

    Args:
        exporter: an OpenTelemetry ``SpanExporter`` (OTLP in production, in-memory in tests).
        service_name: the ``service.name`` resource attribute.
        batch: export through a ``BatchSpanProcessor`` (else a synchronous one, for tests).
        model_name: the served model name, ``gen_ai.response.model`` on every request span.
        instance_id: the ``service.instance.id`` resource attribute (the replica id).
    """

    def __init__(self, exporter: Any, service_name: str = "pagoda-replica", batch: bool = True,
                 model_name: Optional[str] = None, instance_id: Optional[str] = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = {"service.name": service_name}
        if instance_id:
            resource["service.instance.id"] = instance_id
        self._provider = TracerProvider(resource=Resource.create(resource))
        self._provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagoda.serving")
        self._propagator = TraceContextTextMapPropagator()
        self.model_name = model_name

    def record(self, traceparent: Optional[str], output: Any, params: Any = None) -> None:
        """Emit the spans of one finished request (nothing without a valid traceparent).

        Args:
            traceparent: the W3C header value the request carried.
            output: the request's final ``RequestOutput``.
            params: its ``SamplingParams`` (the ``gen_ai.request.*`` values), if known.
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
            **gen_ai_attributes(output, params, self.model_name),
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


def make_request_tracer(endpoint: Optional[str] = None, model_name: Optional[str] = None) -> Optional[RequestTracer]:
    """A tracer exporting over OTLP/gRPC, or ``None`` when tracing is off.

    Args:
        endpoint: ``host:port`` or ``http://host:port`` of an OTLP/gRPC receiver; ``None``
            reads ``PAGODA_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``.
        model_name: the served model name (``gen_ai.response.model``).

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
    return RequestTracer(exporter, service_name=os.environ.get("OTEL_SERVICE_NAME", "pagoda-replica"),
                         model_name=model_name, instance_id=os.environ.get("PAGODA_REPLICA_ID"))
