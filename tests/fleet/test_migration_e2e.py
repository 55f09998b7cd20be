"""Request migration in a live fleet: ``pagoda router`` + two real tritonserver replicas + Redis.

Every request is routed to r0 first (a test policy: the first healthy replica). The same set of
requests runs twice: once uninterrupted (the reference), then again with r0 SIGKILLed (its
whole process tree) once every stream has some tokens. Through every door at once: gRPC
streams, HTTP ``generate_stream`` and ``generate``, OpenAI completions streaming and chat not
streaming (the OpenAI door streams from the replica either way), greedy and seeded
(temperature 1) requests. Every request completes on r1 with exactly the reference's text and
token count (``ignore_eos``: ``max_tokens`` tokens, none repeated or lost); the streams were
resumed and the non-streaming Triton request restarted, as the router's ``/metrics`` and its
spans' ``pagoda.migration`` events say; a stream that asked ``allow_migration: false`` gets
the failure instead. Small: the default model, 32 tokens a request.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import signal
import threading
import urllib.request

import pytest

from pagoda.serving.launch.client import make_inputs
from pagoda.serving.launch.launcher import TritonServer, find_free_port
from pagoda.serving.launch.serve_options import ServeOptions

from tests.fleet.test_router_e2e import _wait, otlp_receiver, read_metric  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.server]

MAX_TOKENS = 32
TIMEOUT_S = 180
PROMPTS = ["The history of tea in China begins", "A short guide to growing tomatoes:",
           "Write a poem about the sea.", "Explain how a bicycle works.", "The three primary colors are",
           "Once upon a time in a quiet village,", "Rules for a good cup of coffee:"]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "seed": 4242}


@pytest.fixture(scope="module")
def fleet(redis_server, tmp_path_factory, smollm2_path, otlp_receiver):
    """r0 and r1 (started together, their engine spans to ``otlp_receiver``), and a router that
    sends each request to r0 while it is healthy."""
    from pagoda.fleet.routing import policy as policies
    from pagoda.fleet.service import BackgroundRouter, RouterOptions

    class FirstHealthy(policies.Policy):
        name = "first_healthy"

        def choose(self, replicas, request):
            return policies.eligible(replicas)[0]

    logs = tmp_path_factory.mktemp("migration")
    servers = {rid: TritonServer(ServeOptions(model=smollm2_path, http_port=find_free_port(),
                                              grpc_port=find_free_port(), metrics_port=find_free_port(),
                                              max_model_len=512, max_num_seqs=24, startup_timeout_s=600,
                                              redis_url=redis_server.url, replica_id=rid, fleet_model="migration"),
                                 log_path=str(logs / f"{rid}.log")) for rid in ("r0", "r1")}
    pool = concurrent.futures.ThreadPoolExecutor(2)
    saved = policies.POLICIES.get(FirstHealthy.name)
    policies.POLICIES[FirstHealthy.name] = FirstHealthy
    saved_env = dict(os.environ)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        try:  # the launcher copies the environment into each replica's
            for start in [pool.submit(server.start) for server in servers.values()]:
                start.result()
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
        from tests.fleet.test_router_e2e import _memory_tracer, _replicas_spec

        tracer, exporter = _memory_tracer()
        options = RouterOptions(model_dir=smollm2_path, model_name="migration", replicas=_replicas_spec(servers),
                                redis_url=redis_server.url, policy=FirstHealthy.name, host="127.0.0.1",
                                http_port=0, grpc_port=0, health_interval_s=0.5)
        with BackgroundRouter(options, tracer=tracer) as router:
            router.exporter = exporter
            yield router, servers
    finally:
        policies.POLICIES.pop(FirstHealthy.name, None) if saved is None else None
        for server in servers.values():
            server.stop(grace_s=0)
        pool.shutdown()


# ------------------------------------------------------------------ one client per door
class Progress:
    """Tokens each streaming request has received; ``ready`` is set, by the client thread that
    sees it, once every one of ``keys`` has ``min_tokens`` (the kill waits on it: decoding is
    fast, so a polling test would see the streams nearly done)."""

    def __init__(self, keys=(), min_tokens: int = 2) -> None:
        self.tokens: dict[str, int] = {}
        self.lock = threading.Lock()
        self.keys, self.min_tokens = set(keys), min_tokens
        self.ready = threading.Event()
        self.at_ready: dict[str, int] = {}

    def add(self, key: str, count: int) -> None:
        with self.lock:
            self.tokens[key] = self.tokens.get(key, 0) + count
            if self.keys and not self.ready.is_set() and all(self.tokens.get(k, 0) >= self.min_tokens
                                                             for k in self.keys):
                self.at_ready = dict(self.tokens)
                self.ready.set()


def grpc_streams(url, requests, progress):
    """Requests (key -> (prompt, sampling)) on one tritonclient stream: key -> (text, tokens) or the error."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for key, (prompt, sampling) in requests.items():
        client.async_stream_infer("pagoda", make_inputs(prompt, {"max_tokens": MAX_TOKENS, "ignore_eos": True,
                                                                 **sampling}, return_num_output_tokens=True),
                                  request_id=key)
    answers: dict[str, list] = {key: ["", 0] for key in requests}
    done: set[str] = set()
    while len(done) < len(requests):
        result, error = results.get(timeout=TIMEOUT_S)
        if error is not None:  # an error names no request id: the opted-out one is the only one that may fail
            failed = next(k for k in requests if k not in done and "optout" in k)
            answers[failed], done = str(error), done | {failed}
            continue
        response = result.get_response()
        assert "output_token_ids" not in {o.name for o in response.outputs}, "the router's journal leaked"
        answers[response.id][0] += result.as_numpy("text_output")[0].decode()
        answers[response.id][1] += int(result.as_numpy("num_output_tokens")[0])
        progress.add(response.id, int(result.as_numpy("num_output_tokens")[0]))
        if response.parameters["triton_final_response"].bool_param:
            done.add(response.id)
    client.stop_stream()
    client.close()
    return {key: tuple(value) if isinstance(value, list) else value for key, value in answers.items()}


def _post(url, path, body):
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)


def _sse(url, path, body):
    """The ``data:`` payloads of an SSE answer, each as it arrives (urllib's reader buffers them)."""
    import requests

    with requests.post(f"http://{url}{path}", json=body, stream=True, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.text
        pending = b""
        for chunk in response.iter_content(chunk_size=None):
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data:") and event.strip() != b"data: [DONE]":
                    yield json.loads(event[5:])


def http_stream(url, key, prompt, sampling, progress):
    body = {"text_input": prompt, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_num_output_tokens": True, **sampling}
    text, tokens = "", 0
    for event in _sse(url, "/v2/models/pagoda/generate_stream", body):
        assert "error" not in event and "output_token_ids" not in event, event
        text += event["text_output"]
        tokens += event["num_output_tokens"]
        progress.add(key, event["num_output_tokens"])
    return text, tokens


def http_generate(url, prompt, sampling):
    body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "exclude_input_in_output": True,
            "return_num_output_tokens": True, **sampling}
    with _post(url, "/v2/models/pagoda/generate", body) as response:
        answer = json.loads(response.read())
    assert "output_token_ids" not in answer
    return answer["text_output"], answer["num_output_tokens"]


def openai_stream(url, key, prompt, sampling, progress):
    """(text, completion tokens, the tokens' log-probabilities when asked), or the error event's message."""
    body = {"model": "migration", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    text, usage, logprobs = "", None, []
    for chunk in _sse(url, "/v1/completions", body):
        if "error" in chunk:
            return chunk["error"]["message"]
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            text += choice["text"]
            logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
            progress.add(key, 1 if choice["text"] else 0)
    return text, usage["completion_tokens"], logprobs


def ensemble_generate(url, prompt):
    """TensorRT-LLM's ``ensemble`` front, not streaming: forwarded as it came (restarted, not resumed)."""
    body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "min_length": MAX_TOKENS, "temperature": 0.0,
            "exclude_input_in_output": True}
    with _post(url, "/v2/models/ensemble/generate", body) as response:
        return json.loads(response.read())["text_output"], None


def openai_chat(url, prompt, sampling):
    body = {"model": "migration", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, **sampling}
    with _post(url, "/v1/chat/completions", body) as response:
        answer = json.loads(response.read())
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]


STREAMING = ["grpc-greedy-0", "grpc-seeded-1", "grpc-greedy-2", "grpc-seeded-3", "grpc-optout",
             "http-stream-greedy", "http-stream-seeded", "openai-stream-greedy", "openai-stream-seeded",
             "openai-stream-logprobs", "openai-stream-guided", "openai-stream-n2"]
GUIDED = {**GREEDY, "guided_regex": "([a-z]+ ){4,64}"}


def run_all(router, progress, killed=False):
    """Every door's requests at once: (pool, futures) whose results ``collect`` reads. ``killed``:
    with the two that are not migrated (one opted out, one with two completions)."""
    grpc_requests = {f"grpc-{kind}-{i}": (PROMPTS[i], sampling) for i, (kind, sampling) in
                     enumerate([("greedy", GREEDY), ("seeded", SEEDED), ("greedy", GREEDY), ("seeded", SEEDED)])}
    http, grpc_url = router.http_url, router.grpc_url
    jobs = {"grpc": lambda: grpc_streams(grpc_url, grpc_requests, progress),
            "http-stream-greedy": lambda: http_stream(http, "http-stream-greedy", PROMPTS[4], GREEDY, progress),
            "http-stream-seeded": lambda: http_stream(http, "http-stream-seeded", PROMPTS[5], SEEDED, progress),
            "http-generate-greedy": lambda: http_generate(http, PROMPTS[0], GREEDY),
            "http-generate-seeded": lambda: http_generate(http, PROMPTS[1], SEEDED),
            "ensemble-generate": lambda: ensemble_generate(http, PROMPTS[3]),
            "openai-stream-greedy": lambda: openai_stream(http, "openai-stream-greedy", PROMPTS[2], GREEDY, progress),
            "openai-stream-seeded": lambda: openai_stream(http, "openai-stream-seeded", PROMPTS[3], SEEDED, progress),
            "openai-stream-logprobs": lambda: openai_stream(http, "openai-stream-logprobs", PROMPTS[6],
                                                            {**SEEDED, "logprobs": 1}, progress),
            "openai-stream-guided": lambda: openai_stream(http, "openai-stream-guided", PROMPTS[0], GUIDED, progress),
            "openai-chat-greedy": lambda: openai_chat(http, PROMPTS[4], GREEDY),
            "openai-chat-seeded": lambda: openai_chat(http, PROMPTS[5], SEEDED)}
    if killed:
        grpc_requests["grpc-optout"] = (PROMPTS[6], {**GREEDY, "allow_migration": False})
        jobs["openai-stream-n2"] = lambda: openai_stream(http, "openai-stream-n2", PROMPTS[1], {**SEEDED, "n": 2},
                                                         progress)
    pool = concurrent.futures.ThreadPoolExecutor(len(jobs))
    return pool, {name: pool.submit(job) for name, job in jobs.items()}


def collect(pool, futures):
    answers = {}
    for name, future in futures.items():
        value = future.result(timeout=TIMEOUT_S)
        answers.update(value if name == "grpc" else {name: value})
    pool.shutdown()
    return answers


def test_replica_killed_under_eight_streams_every_door_completes_exactly(fleet, otlp_receiver):
    router, servers = fleet
    reference = collect(*run_all(router, Progress()))
    assert all(answer[1] in (MAX_TOKENS, None) for answer in reference.values()), reference
    assert reference["grpc-seeded-1"][0] != reference["grpc-greedy-0"][0]
    since = len(router.exporter.get_finished_spans())

    progress = Progress(STREAMING)
    pool, futures = run_all(router, progress, killed=True)
    assert progress.ready.wait(TIMEOUT_S), f"the streams did not all get tokens: {progress.tokens}"
    os.killpg(servers["r0"].process.pid, signal.SIGKILL)
    answers = collect(pool, futures)
    assert all(count < MAX_TOKENS for count in progress.at_ready.values()), progress.at_ready

    opted_out, several = answers.pop("grpc-optout"), answers.pop("openai-stream-n2")
    assert "replica r0" in opted_out and "Not migrated: the request asked not to be migrated" in opted_out
    assert "replica r0" in several and "cannot be resumed: several completions" in several
    # Every text and token count exactly the uninterrupted run's; the log-probabilities of the
    # tokens after the seam are r1's: equal up to rounding (the context computed in one prefill).
    logprobs, reference_logprobs = answers["openai-stream-logprobs"][2], reference["openai-stream-logprobs"][2]
    assert len(logprobs) == len(reference_logprobs) > 0
    assert all(abs(a - b) < 2e-3 for a, b in zip(logprobs, reference_logprobs)), (logprobs, reference_logprobs)
    assert {k: v[:2] for k, v in answers.items()} == {k: v[:2] for k, v in reference.items()}
    text = urllib.request.urlopen(f"http://{router.http_url}/metrics", timeout=10).read().decode()
    counts = {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pagoda_router_migrations_total{") and not line.endswith(" 0")}  # zeros: all rows
    assert counts == {'reason="connection_lost",outcome="resumed"': 4 + 2 + 4 + 2,  # gRPC, SSE, OpenAI streams, chats
                      'reason="connection_lost",outcome="restarted"': 3,  # generate x2, the ensemble's
                      'reason="connection_lost",outcome="opted_out"': 1,
                      'reason="connection_lost",outcome="not_resumable"': 1}, counts
    spans = [s for s in router.exporter.get_finished_spans()[since:] if s.name == "pagoda.router.request"]
    events = [dict(e.attributes) for s in spans for e in s.events if e.name == "pagoda.migration"]
    assert {e["pagoda.replica_id"] for e in events} == {"r0"} and len(events) == sum(counts.values())
    assert all(e["pagoda.migration.num_tokens"] >= 2 for e in events if e["pagoda.migration.outcome"] == "resumed")
    # One trace per migrated request: r1's engine span is a child of the router's span (r0's
    # died with it), and the router's span counts the tokens its journal read, all of them.
    resumed = [s for s in spans if any(e.name == "pagoda.migration" and e.attributes["pagoda.migration.outcome"]
                                       == "resumed" for e in s.events)]
    assert len(resumed) == 12 and all(s.attributes["gen_ai.request.max_tokens"] == MAX_TOKENS for s in resumed)
    assert {s.attributes.get("gen_ai.usage.completion_tokens") for s in resumed} == {MAX_TOKENS}

    def continued_on_r1(span):
        trace_id = span.context.trace_id.to_bytes(16, "big")
        return [s for _, s in otlp_receiver.spans_of_trace(trace_id) if s.name == "pagoda.engine.request"
                and s.parent_span_id == span.context.span_id.to_bytes(8, "big")
                and otlp_receiver.instances[s.span_id] == "r1"]

    _wait(lambda: all(continued_on_r1(s) for s in resumed), "r1's engine span in each migrated request's trace", 20)
    assert read_metric(servers["r1"], "vllm:num_requests_running") == 0
