"""Disaggregated prefill/decode through the router with real processes (issue 30, items 2 and 4).

Two real tritonserver replicas (``test_router_e2e``'s module fixture, started again for
this module: r0 the prefill replica, r1 the decode replica, both with a TCP KV connector)
and the router in this process; every door a client has: the tritonclient gRPC stream,
the ``openai`` SDK, Triton's HTTP ``generate``/``generate_stream``. The references are one
replica's own answers to the same requests.

The early first token (item 2): a streaming client has its first chunk while its request is
held at the router between the two stages (so the chunk came from the prefill replica),
and the whole stream equals one replica's, greedy and seeded, on every door; unseeded
sampled streams never end in a first-token mismatch (the router seeds both stages).

Faults (item 4), last because they kill r0:
- r0 killed with SIGKILL after its prefill stages answered and before the decode side
  pulled (the kill point is made deterministic by holding the three doors' requests at the
  router between their two stages until all three have finished their first): every door's
  client gets the full answer, with no error; r1 computed the prompts itself (0 cached).
- r0 back without a KV connector: its prefill stages answer an error (400 naming
  ``--kv-transfer-listen``); the router falls back to whole requests on r1, every door.
- after each, every replica alive reports all its KV blocks free and nothing running, and
  the router holds no in-flight request on any replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import os
import signal
import threading
import urllib.request

import pytest

from tests.fleet.test_router_e2e import (MODEL_NAME, _make_router, _replicas_spec, _start_replica, _wait,  # noqa: F401
                                         grpc_generate, otlp_receiver, read_metric, replicas, start_in_background)
from tests.serving.test_serving_triton_server import http_post

pytestmark = [pytest.mark.server, pytest.mark.redis]

ROLES = {"r0": "prefill", "r1": "decode"}
DOORS = ("grpc", "openai", "http")


def _disaggregated_spec(servers) -> str:
    return ";".join(f"{entry},role={ROLES[rid]}" for rid, entry in zip(servers, _replicas_spec(servers).split(";")))


def _prompt(door: str, what: str) -> str:
    return f"{what}: the {door} door's request is computed on one replica and decoded on another. " * 5


def _ask(router, door: str, prompt: str, max_tokens: int = 8) -> tuple[str, int]:
    """One greedy request on ``door``; (its text, the prompt tokens the answering replica had
    cached). Raises on any client-visible error."""
    if door == "grpc":
        texts, errors = grpc_generate(router.grpc_url, [prompt], max_tokens=max_tokens)
        assert not errors, errors
        return texts["0"], -1  # tritonclient's stream: the text only
    if door == "openai":
        import openai

        client = openai.OpenAI(base_url=f"http://{router.http_url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return completion.choices[0].text, completion.usage.prompt_tokens_details.cached_tokens
    status, answer = http_post(router, "/v2/models/pagoda/generate", {
        "text_input": prompt, "max_tokens": max_tokens, "exclude_input_in_output": True,
        "return_num_cached_tokens": True, "sampling_parameters": json.dumps({"temperature": 0})})
    assert status == 200, answer
    return answer["text_output"], answer["num_cached_tokens"]


def _ask_every_door(router, prompts: dict[str, str]) -> dict[str, tuple[str, int]]:
    """The three doors' requests at once (each from its own client thread)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = {door: pool.submit(_ask, router, door, prompt) for door, prompt in prompts.items()}
        return {door: future.result(timeout=300) for door, future in futures.items()}


def _references(server, prompts: dict[str, str]) -> dict[str, str]:
    texts, errors = grpc_generate(server.grpc_url, list(prompts.values()), max_tokens=8)
    assert not errors, errors
    return {door: texts[str(i)] for i, door in enumerate(prompts)}


def _assert_nothing_held(router, servers) -> None:
    """Every live replica: all KV blocks free (cached blocks count as free), nothing running
    or waiting; the router: no request in flight anywhere."""
    def settled(server) -> bool:
        num_free_blocks = read_metric(server, "pagoda:kv_cache_num_free_blocks")
        return (num_free_blocks == read_metric(server, "pagoda:kv_cache_num_blocks")
                and read_metric(server, "vllm:num_requests_running") == 0
                and read_metric(server, "vllm:num_requests_waiting") == 0)

    for rid, server in servers.items():
        _wait(lambda: settled(server), f"{rid} reports every KV block free and no request", 30)
        assert read_metric(server, "pagoda:kv_cache_num_blocks") > 0
    in_flight = router.run(lambda: {r.replica_id: r.in_flight for r in router.service.router.replicas.all()})
    assert set(in_flight.values()) == {0}, in_flight


def _after_first_stage(stage, hook):
    """``stage`` (the router's own first-stage function: ``GrpcUpstream._prefill``, an async
    generator, for the gRPC and OpenAI doors; ``http_stages.prefill`` for the HTTP door) with
    ``await hook()`` run when it has finished and before the second stage is sent. It changes
    no result, only when the second stage starts."""
    if inspect.isasyncgenfunction(stage):
        async def held_generator(*args, **kwargs):
            async for item in stage(*args, **kwargs):
                yield item
            await hook()
        return held_generator

    async def held(*args, **kwargs):
        result = await stage(*args, **kwargs)
        await hook()
        return result
    return held


def _install(monkeypatch, router, hook) -> None:
    from pagoda.fleet.api import http_stages

    upstream = router.service.upstream
    monkeypatch.setattr(upstream, "_prefill", _after_first_stage(upstream._prefill, hook))
    monkeypatch.setattr(http_stages, "prefill", _after_first_stage(http_stages.prefill, hook))


class _HoldBetweenStages:
    """Holds each request at the router between its two stages until ``count`` requests are
    there, then runs ``action`` once (in a thread) and lets them all go on."""

    def __init__(self, count: int, action) -> None:
        self.count, self.action = count, action
        self.num_held = 0
        self.released: asyncio.Event | None = None

    async def __call__(self) -> None:
        if self.released is None:
            self.released = asyncio.Event()
        self.num_held += 1
        if self.num_held == self.count:
            await asyncio.to_thread(self.action)
            self.released.set()
        await asyncio.wait_for(self.released.wait(), 120)


class _FirstChunkProbe:
    """Run between a request's two stages: waits (up to 30 s) for the client to have its first
    chunk and records whether it did; the decode stage has not been sent yet, so a first
    chunk seen here came from the prefill stage."""

    def __init__(self) -> None:
        self.saw_first = threading.Event()
        self.seen: list[bool] = []

    def reset(self) -> None:
        self.saw_first.clear()

    async def __call__(self) -> None:
        self.seen.append(await asyncio.to_thread(self.saw_first.wait, 30))


def _grpc_stream(url: str, prompt: str, sampling: dict, on_first=None) -> list[dict]:
    """One streamed request on a tritonclient gRPC stream; each response's outputs, in order."""
    import queue

    import tritonclient.grpc as grpcclient
    from pagoda.serving.launch.client import decode_result, make_inputs

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("pagoda", make_inputs(prompt, sampling, exclude_input_in_output=True,
                                                    return_finish_reason=True, return_num_output_tokens=True,
                                                    return_logprobs=True), request_id="s")
    responses = []
    try:
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            if on_first is not None and not responses:
                on_first()
            responses.append(decode_result(result))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def _http_stream(url: str, body: dict, on_first=None) -> list[dict]:
    request = urllib.request.Request(f"http://{url}/v2/models/pagoda/generate_stream", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:"):
                if on_first is not None and not events:
                    on_first()
                events.append(json.loads(line[len("data:"):]))
    assert not any("error" in event for event in events), events
    return events


def _openai_stream(url: str, prompt: str, on_first=None, **kwargs) -> dict:
    """One streamed completion: its text, finish reason, usage and logprobs tokens."""
    import openai

    client = openai.OpenAI(base_url=f"http://{url}/v1", api_key="unused", max_retries=0)
    out = {"text": "", "tokens": [], "token_logprobs": []}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        if on_first is not None and not out["text"] and chunk.choices:
            on_first()
        for choice in chunk.choices:
            out["text"] += choice.text
            out["finish_reason"] = choice.finish_reason or out.get("finish_reason")
            if choice.logprobs is not None:
                out["tokens"] += choice.logprobs.tokens
                out["token_logprobs"] += choice.logprobs.token_logprobs
        if chunk.usage is not None:
            out["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return out


def _summary(responses: list[dict]) -> tuple:
    """A stream's concatenated text, summed output tokens, last finish reason and logprobs'
    token ids (pagoda dialect entries)."""
    entries = [e for r in responses for e in json.loads(r.get("logprobs") or "[]") or []]
    reasons = [r["finish_reason"] for r in responses if r.get("finish_reason") not in (None, "", "None")]
    return ("".join(r.get("text_output", "") for r in responses), sum(r.get("num_output_tokens", 0) for r in responses),
            reasons, [e["token_id"] for e in entries])


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-3 for x, y in zip(a, b))


SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 1234}}


def test_streams_begin_with_the_prefill_replicas_first_token(replicas, redis_server, smollm2_path, monkeypatch):
    """Streaming on every door through 1 prefill + 1 decode replica: the client has its first
    chunk while the request is still between its stages (so it came from the prefill
    replica), and the whole stream (text, token counts, finish reason, logprobs, usage)
    equals one replica's, greedy and seeded."""
    probe = _FirstChunkProbe()
    single_spec = _replicas_spec({"r0": replicas["r0"]})
    with _make_router(replicas, redis_server, smollm2_path, replicas=single_spec) as single, \
            _make_router(replicas, redis_server, smollm2_path, replicas=_disaggregated_spec(replicas)) as router:
        _install(monkeypatch, router, probe)
        for name, sampling in SAMPLINGS.items():
            values = {**sampling, "max_tokens": 8, "logprobs": 1, "output_dialect": "pagoda"}
            prompt = _prompt("grpc", f"Early {name}")
            reference = _summary(_grpc_stream(replicas["r0"].grpc_url, prompt, values))
            probe.reset()
            assert _summary(_grpc_stream(router.grpc_url, prompt, values, probe.saw_first.set)) == reference, name
            assert reference[1] == 8 and probe.seen[-1], f"grpc {name}: the first chunk came from the prefill stage"

            prompt = _prompt("openai", f"Early {name}")
            options = dict(max_tokens=8, logprobs=1, **sampling)
            reference = _openai_stream(single.http_url, prompt, **options)
            probe.reset()
            streamed = _openai_stream(router.http_url, prompt, probe.saw_first.set, **options)
            assert probe.seen[-1], f"openai {name}: the first chunk came from the prefill stage"
            assert {k: v for k, v in streamed.items() if k != "token_logprobs"} == \
                {k: v for k, v in reference.items() if k != "token_logprobs"}, name
            assert _close(streamed["token_logprobs"], reference["token_logprobs"]) and reference["usage"][1] == 8

            prompt = _prompt("http", f"Early {name}")
            body = {"text_input": prompt, "stream": True, "exclude_input_in_output": True, "return_finish_reason": True,
                    "return_num_output_tokens": True, "return_logprobs": True,
                    "sampling_parameters": json.dumps(values)}
            reference = _summary(_http_stream(replicas["r0"].http_url, body))
            probe.reset()
            assert _summary(_http_stream(router.http_url, body, probe.saw_first.set)) == reference, name
            assert probe.seen[-1], f"http {name}: the first chunk came from the prefill stage"
        assert router.run(lambda: router.service.router.num_two_stage) == 3 * len(SAMPLINGS)


def test_unseeded_sampled_streams_get_one_seed_for_both_stages(replicas, redis_server, smollm2_path):
    """Sampled requests without a seed: the router gives both stages one seed, so the decode
    replica continues the token the prefill replica streamed (a mismatch would end the stream
    with an error); and a Triton HTTP body with its values in ``parameters`` (the vLLM
    backend's README) runs both stages too, with one replica's answer."""
    with _make_router(replicas, redis_server, smollm2_path, replicas=_disaggregated_spec(replicas)) as router:
        for i in range(3):
            streamed = _openai_stream(router.http_url, _prompt("openai", f"Unseeded {i}"), max_tokens=10,
                                      temperature=1.0, extra_body={"ignore_eos": True})
            assert streamed["usage"][1] == 10 and streamed["finish_reason"] == "length", streamed
        responses = _grpc_stream(router.grpc_url, _prompt("grpc", "Unseeded"),
                                 {"temperature": 1.0, "max_tokens": 10, "ignore_eos": True})
        assert _summary(responses)[1:3] == (10, ["length"])
        assert router.run(lambda: router.service.router.num_two_stage) == 4
        prompt = _prompt("http", "Parameters")
        body = {"text_input": prompt, "parameters": {"temperature": 0, "max_tokens": 6}}
        assert http_post(router, "/v2/models/pagoda/generate", body) == http_post(replicas["r0"], "/v2/models/pagoda"
                                                                                  "/generate", body)
        assert router.run(lambda: router.service.router.num_two_stage) == 5


def test_a_two_stage_request_is_one_trace_across_the_router_and_both_replicas(replicas, redis_server, smollm2_path,
                                                                               otlp_receiver):
    """Issue 45: a P/D request's router span (the client's trace, ``gen_ai`` attributes set) is
    the parent of an engine span on the prefill replica (its short stage) and one on the
    decode replica (the answer), all three in one trace; the spans name their replica."""
    trace_id, parent_id = os.urandom(16), os.urandom(8)
    prompt = _prompt("grpc", "Traced")
    with _make_router(replicas, redis_server, smollm2_path, replicas=_disaggregated_spec(replicas)) as router:
        texts, errors = grpc_generate(router.grpc_url, [prompt], max_tokens=5, ignore_eos=True,
                                      metadata={"traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01"})
        assert not errors and router.run(lambda: router.service.router.num_two_stage) == 1, errors
        routed = lambda: [s for s in router.exporter.get_finished_spans() if s.name == "pagoda.router.request"]  # noqa
        _wait(lambda: routed(), "the router's span ended")
        [span] = routed()
    assert span.context.trace_id == int.from_bytes(trace_id, "big") and span.parent.span_id == int.from_bytes(
        parent_id, "big")
    router_span_id = span.context.span_id.to_bytes(8, "big")

    def engine_roots():
        return {otlp_receiver.instances[s.span_id]: s for _, s in otlp_receiver.spans_of_trace(trace_id)
                if s.name == "pagoda.engine.request"}

    _wait(lambda: set(engine_roots()) == {"r0", "r1"}, "both replicas' engine spans", 20)
    roots = engine_roots()
    assert {root.parent_span_id for root in roots.values()} == {router_span_id}
    usage = {rid: {kv.key: kv.value.int_value for kv in root.attributes if kv.key.startswith("gen_ai.")}
             for rid, root in roots.items()}
    # The prefill stage's own small max_tokens (first_token.prefill_stage: 2 when its first token is streamed early).
    assert 1 <= usage["r0"]["gen_ai.usage.completion_tokens"] <= usage["r0"]["gen_ai.request.max_tokens"] <= 2
    assert usage["r1"]["gen_ai.usage.completion_tokens"] == 5
    assert usage["r1"]["gen_ai.usage.cached_tokens"] > 0, "the decode replica pulled the prompt's blocks"
    attributes = span.attributes
    assert attributes["gen_ai.request.max_tokens"] == 5 and attributes["gen_ai.request.n"] == 1
    assert attributes["gen_ai.usage.prompt_tokens"] == usage["r1"]["gen_ai.usage.prompt_tokens"]


def test_prefill_replica_killed_before_the_pull_costs_the_client_nothing(replicas, redis_server, smollm2_path,
                                                                          monkeypatch):
    prompts = {door: _prompt(door, "Killed prefill") for door in DOORS}
    references = _references(replicas["r0"], prompts)  # r0's own answers; r1 never sees these prompts alone
    victim = replicas["r0"]

    def kill_r0() -> None:
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(30)

    with _make_router(replicas, redis_server, smollm2_path, replicas=_disaggregated_spec(replicas)) as router:
        hold = _HoldBetweenStages(len(DOORS), kill_r0)
        _install(monkeypatch, router, hold)
        answers = _ask_every_door(router, prompts)
        assert hold.num_held == len(DOORS), "every door's prefill stage ended before the kill"
        assert victim.process.poll() is not None
        for door in DOORS:
            text, cached = answers[door]
            assert text == references[door], door
            assert cached in (-1, 0), f"{door}: r1 could not pull from the dead r0, so it computed the prompt"
        assert router.run(lambda: router.service.router.num_two_stage) == len(DOORS)
        _assert_nothing_held(router, {"r1": replicas["r1"]})


def test_prefill_stage_answering_an_error_falls_back_to_the_decode_replica(replicas, redis_server, smollm2_path,
                                                                            otlp_receiver):
    """r0 restarted without a KV connector (a misconfigured prefill replica): every prefill
    stage it gets is refused (400 naming --kv-transfer-listen), and each door's request runs
    whole on r1 with the same answer."""
    victim = replicas["r0"]
    victim.stop()  # reaps the killed process (if the test above ran) or stops it
    _, env = _start_replica("r0", redis_server.url, otlp_receiver.endpoint, victim.log_path)
    victim.options.engine_args = {k: v for k, v in victim.options.engine_args.items() if k != "kv_transfer_listen"}
    start_in_background(victim, env).join(600)
    status, answer = http_post(victim, "/v2/models/pagoda/generate", {
        "text_input": "hello", "sampling_parameters": json.dumps({"kv_transfer_params": {"do_remote_decode": True}})})
    assert status == 400 and "--kv-transfer-listen" in answer["error"], answer

    prompts = {door: _prompt(door, "Refused prefill") for door in DOORS}
    references = _references(victim, prompts)
    with _make_router(replicas, redis_server, smollm2_path, replicas=_disaggregated_spec(replicas)) as router:
        core = router.service.router
        _wait(lambda: router.run(lambda: all(r.healthy for r in core.replicas.all())), "both replicas healthy")
        routed = router.run(lambda: core.replicas.get("r0").num_routed)
        for door in DOORS:
            text, _ = _ask(router, door, prompts[door])
            assert text == references[door], door
        assert router.run(lambda: core.replicas.get("r0").num_routed) == routed + len(DOORS), \
            "each door's prefill stage went to r0 (and was refused)"
        assert router.run(lambda: core.num_two_stage) == 0
        _assert_nothing_held(router, replicas)
