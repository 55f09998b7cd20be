"""Router and engine spans with an in-memory exporter: attributes, parentage, timestamps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from pagoda.engine.sampling_params import SamplingParams  # noqa: E402
from pagoda.fleet.api.tracing import RouterTracer  # noqa: E402
from pagoda.serving.tracing import RequestTracer, make_request_tracer, read_traceparent  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_router_span_records_the_decision_and_propagates():
    exporter = InMemorySpanExporter()
    tracer = RouterTracer(exporter, batch=False)
    decision = SimpleNamespace(policy="prefix_aware", replica=SimpleNamespace(replica_id="r1"), matched_blocks=12,
                               num_prompt_tokens=200, num_prompt_blocks=12, redis_available=True, decision_s=0.0004,
                               attempt=1)
    with tracer.route_span("grpc", {"traceparent": TRACEPARENT}) as span:
        span.set_decision(decision)
        outgoing = span.traceparent
    [finished] = exporter.get_finished_spans()
    assert finished.name == "pagoda.router.request"
    assert format(finished.context.trace_id, "032x") == TRACE_ID
    assert format(finished.parent.span_id, "016x") == PARENT_ID
    assert outgoing == f"00-{TRACE_ID}-{format(finished.context.span_id, '016x')}-01"
    assert finished.attributes["pagoda.replica_id"] == "r1" and finished.attributes["pagoda.matched_blocks"] == 12
    assert finished.attributes["pagoda.policy"] == "prefix_aware" and finished.attributes["pagoda.protocol"] == "grpc"

    with pytest.raises(RuntimeError):
        with tracer.route_span("http") as span:
            raise RuntimeError("replica died")
    assert not exporter.get_finished_spans()[-1].status.is_ok


def test_router_span_carries_the_gen_ai_request_and_usage():
    """The router's span: the engine span's ``gen_ai.request.*`` names, the prompt tokens it
    counted to route, and the completion tokens its migration journal read (a journaled stream)."""
    from pagoda.fleet.api.migration import Migrations
    from pagoda.serving.wire import OutputOptions, WireRequest

    exporter = InMemorySpanExporter()
    tracer = RouterTracer(exporter, batch=False)
    wire = WireRequest(prompt="hi", params=SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, seed=1),
                       output=OutputOptions(stream=True))
    journal = Migrations(limit=1).journal(wire)
    assert journal.is_journaled
    decision = SimpleNamespace(policy="prefix_aware", replica=SimpleNamespace(replica_id="r0"), matched_blocks=0,
                               num_prompt_tokens=3, num_prompt_blocks=1, redis_available=True, decision_s=0.0,
                               attempt=1)
    with tracer.route_span("grpc") as span:
        span.set_request("req-9", journal.wire, journal)
        span.set_decision(decision)
        journal.observe("a b", "[11, 12]", None)
    with tracer.route_span("grpc") as span:
        span.set_request(None, None)  # another model's request: nothing of pagoda's sampling
    journaled, front = (dict(s.attributes) for s in exporter.get_finished_spans())
    assert {k: v for k, v in journaled.items() if k.startswith("gen_ai.")} == {
        "gen_ai.request.id": "req-9", "gen_ai.request.n": 1, "gen_ai.request.max_tokens": 7,
        "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9, "gen_ai.request.top_k": 4,
        "gen_ai.usage.prompt_tokens": 3, "gen_ai.usage.completion_tokens": 2}
    assert not any(k.startswith("gen_ai.") for k in front)


def test_tracing_off_forwards_the_client_context():
    tracer = RouterTracer(None)
    with tracer.route_span("http", {"traceparent": TRACEPARENT}) as span:
        span.set_decision(None)  # no-op without a span
        assert span.traceparent == TRACEPARENT


def test_engine_spans_from_request_metrics():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter, batch=False)
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                             last_token_time=102.0, finished_time=102.5)
    completion = CompletionOutput(0, "x y", [4, 5], "", [], finish_reason="length")
    output = RequestOutput("req-1", "hi", [1, 2, 3], [completion], True, metrics, num_cached_tokens=2)
    tracer.record(TRACEPARENT, output)
    tracer.record(None, output)  # untraced requests make no spans
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"pagoda.engine.request", "engine.queued", "engine.prefill", "engine.first_token",
                          "engine.decode", "engine.finished"}
    root = spans["pagoda.engine.request"]
    assert format(root.parent.span_id, "016x") == PARENT_ID and format(root.context.trace_id, "032x") == TRACE_ID
    assert (root.start_time, root.end_time) == (100_000_000_000, 102_500_000_000)
    assert (spans["engine.queued"].start_time, spans["engine.queued"].end_time) == (100_000_000_000, 100_500_000_000)
    assert (spans["engine.prefill"].start_time, spans["engine.prefill"].end_time) == (100_500_000_000, 101_000_000_000)
    assert spans["engine.first_token"].start_time == spans["engine.first_token"].end_time == 101_000_000_000
    assert spans["engine.decode"].end_time == 102_500_000_000
    assert all(s.parent.span_id == root.context.span_id for n, s in spans.items() if n != "pagoda.engine.request")
    assert root.attributes["pagoda.num_prompt_tokens"] == 3 and root.attributes["pagoda.num_output_tokens"] == 2
    assert root.attributes["pagoda.num_cached_tokens"] == 2 and root.attributes["pagoda.finish_reason"] == "length"
    # OpenTelemetry's gen_ai attributes, under vLLM's names (no params known: no gen_ai.request.* values).
    gen_ai = {k: v for k, v in root.attributes.items() if k.startswith("gen_ai.")}
    assert gen_ai == {"gen_ai.request.id": "req-1", "gen_ai.usage.prompt_tokens": 3,
                      "gen_ai.usage.completion_tokens": 2, "gen_ai.usage.cached_tokens": 2,
                      "gen_ai.usage.num_sequences": 1, "gen_ai.response.finish_reasons": ("length",),
                      "gen_ai.latency.time_in_queue": 0.5, "gen_ai.latency.time_to_first_token": 1.0,
                      "gen_ai.latency.e2e": 2.5, "gen_ai.latency.time_in_model_prefill": 0.5,
                      "gen_ai.latency.time_in_model_decode": 1.5, "gen_ai.latency.time_in_model_inference": 2.0}
    tracer.shutdown()


def test_engine_span_gen_ai_request_values_and_model():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter, batch=False, model_name="smol")
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.25, first_token_time=None,
                             last_token_time=None, finished_time=10.5)  # aborted before its first token
    output = RequestOutput("req-2", None, [1], [CompletionOutput(0, "", [], "", [], finish_reason="abort")] * 2,
                           True, metrics)
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_tokens=33)
    tracer.record(TRACEPARENT, output, params)
    root = next(s for s in exporter.get_finished_spans() if s.name == "pagoda.engine.request")
    assert root.attributes["gen_ai.response.model"] == "smol" and root.attributes["gen_ai.usage.num_sequences"] == 2
    assert {k: root.attributes[k] for k in ("gen_ai.request.n", "gen_ai.request.temperature", "gen_ai.request.top_p",
                                            "gen_ai.request.top_k", "gen_ai.request.max_tokens")} == \
        {"gen_ai.request.n": 2, "gen_ai.request.temperature": 0.7, "gen_ai.request.top_p": 0.9,
         "gen_ai.request.top_k": 20, "gen_ai.request.max_tokens": 33}
    # No first token: no TTFT, prefill or decode latency (absent, not zero).
    assert "gen_ai.latency.time_to_first_token" not in root.attributes
    assert "gen_ai.latency.time_in_model_decode" not in root.attributes
    assert root.attributes["gen_ai.latency.e2e"] == 0.5 and root.attributes["gen_ai.latency.time_in_queue"] == 0.25
    tracer.shutdown()


def test_traceparent_parameter_and_configuration(monkeypatch):
    assert read_traceparent('{"traceparent": "%s", "x": 1}' % TRACEPARENT) == TRACEPARENT
    assert read_traceparent("{}") is None and read_traceparent("not json") is None and read_traceparent(None) is None
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("PAGODA_OTLP_ENDPOINT", raising=False)
    assert make_request_tracer() is None  # no endpoint: tracing off, no cost
    monkeypatch.setenv("PAGODA_OTLP_ENDPOINT", "127.0.0.1:4317")
    tracer = make_request_tracer()
    assert isinstance(tracer, RequestTracer)
    tracer.shutdown()


class _OneStepEngine:
    """The part of an ``EngineClient`` the loop drives here: finishes every request in the
    step after it was added."""

    def __init__(self):
        self.pending = {}

    def tokenize_prompt(self, text, params=None):
        return [1]

    def add(self, request):
        arrival = request.arrival_time
        self.pending[request.request_id] = RequestMetrics(arrival_time=arrival, first_scheduled_time=arrival,
                                                          first_token_time=arrival, finished_time=arrival)

    def abort_request(self, request_ids):
        pass

    def has_unfinished_requests(self):
        return bool(self.pending)

    def get_stats(self):
        return None  # the tracer observer reads no stats

    def take_block_events(self):
        return []

    def step(self):
        outputs = [RequestOutput(rid, "p", [1], [CompletionOutput(0, "t", [7], "t", [7], finish_reason="length")],
                                 True, metrics) for rid, metrics in self.pending.items()]
        self.pending.clear()
        return outputs


def test_engine_loop_traces_only_requests_with_a_traceparent(monkeypatch):
    import queue

    from pagoda.engine.sampling_params import SamplingParams
    from pagoda.serving.commands import ServingRequest
    from pagoda.serving.engine_loop import EngineLoop
    from pagoda.serving.observers import TracerObserver
    from pagoda.serving.response_sender import ResponseSender
    from pagoda.serving.wire import WireRequest

    monkeypatch.delenv("PAGODA_REDIS_URL", raising=False)  # no fleet publisher in this loop
    recorded, delivered = [], queue.Queue()

    class Tracer:
        def record(self, traceparent, output, params):  # the request's own SamplingParams (gen_ai.request.*)
            assert params.max_tokens == 1
            recorded.append((traceparent, output.request_id))
            if output.request_id == "boom":
                raise RuntimeError("exporter broke")

    sender = ResponseSender(lambda handle, response: delivered.put((handle, response)))
    loop = EngineLoop(_OneStepEngine(), sender, [TracerObserver(Tracer())])
    sender.start()
    loop.start()
    try:
        parsed = WireRequest(prompt="hi", params=SamplingParams(max_tokens=1))
        for request_id, traceparent in (("traced", TRACEPARENT), ("plain", None), ("boom", TRACEPARENT)):
            loop.submit(ServingRequest(request_id, parsed, request_id, traceparent=traceparent))
        finals = {delivered.get(timeout=10)[0] for _ in range(3)}
    finally:
        loop.stop()
        sender.stop()
    assert finals == {"traced", "plain", "boom"}  # a failing tracer fails no request
    assert sorted(recorded) == [(TRACEPARENT, "boom"), (TRACEPARENT, "traced")]
