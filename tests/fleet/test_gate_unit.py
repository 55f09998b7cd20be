"""The router's gate without replicas: input limits, Triton body validation, API keys ->
tenants -> salts, token-bucket rate limits on an injected clock, overload memory, and the
real aiohttp app refusing bad, oversized, unauthenticated and rate-limited requests
before any routing (keys never in logs or metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import time

import pytest
from tritonclient.grpc import service_pb2

from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.gate.auth import ApiKeys, AuthError, RateLimited, Tenant, TenantLimiter, load_api_keys, tenant_salt
from pagoda.fleet.gate.gate import Gate
from pagoda.fleet.triton_wire import read_string_input
from pagoda.fleet.gate.generate_body import sampling_of_generate, validate_generate_body
from pagoda.fleet.gate.limits import LimitError, RequestLimits, sampling_of_infer_request
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.routing.router import Router

SECRET = "sk-very-secret-0123456789"
SECRET_TPM = "sk-small-quota-42"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ limits and bodies
@pytest.mark.parametrize("body, message", [
    (b"{not json", "body: not valid JSON"),
    (b'[{"text_input": "hi"}]', "body: must be a JSON object of inputs, got a JSON array"),
    (b'{"text_input": 5}', "text_input: must be a string, got 5"),
    (b'{"text_input": [1, 2]}', "text_input: must be a string, got [1, 2]"),
    (b'{"text_input": "hi", "stream": "yes"}', 'stream: must be true or false, got "yes"'),
    (b'{"text_input": "hi", "frobnicate": 1}', "frobnicate: unknown input or request parameter"),
    (b'{"text_input": "hi", "temperature": "x"}', 'temperature: must be a number, got "x"'),
    (b'{"text_input": "hi", "max_tokens": 1.5}', "max_tokens: must be an integer"),
    (b'{"text_input": "hi", "seed": -1}', "seed: must be a non-negative integer"),
    (b'{"stream": true}', "text_input: required input is missing"),
    (b'{"text_input": "hi", "max_tokens": 100000}', "max_tokens: 100000 exceeds this server's limit of 32768"),
    (b'{"text_input": "hi", "sampling_parameters": "{\\"n\\": 64}"}', "n: 64 exceeds this server's limit of 16"),
    (b'{"text_input": "hi", "stop_words": ["a", "b", "c"]}', "stop: 3 stop strings exceed this server's limit of 2"),
    (b'{"text_input": "hi", "pad_id": 2}', "pad_id: unknown input or request parameter"),
    (b'{"text_input": "hi", "parameters": [1]}', "parameters: must be a JSON object, got a JSON array"),
    (b'{"text_input": "hi", "parameters": {"tempreature": 0}}', "parameters.tempreature: unknown request parameter"),
    (b'{"text_input": "hi", "id": 7}', "id: must be a string, got 7"),
    (b'{"text_input": "hi", "parameters": {"max_tokens": 100000}}', "max_tokens: 100000 exceeds"),
    # tritonserver makes a parameter named like an input that input: a string there would be its 500
    (b'{"text_input": "hi", "parameters": {"temperature": "0"}}', 'temperature: must be a number, got "0"'),
    (b'{"text_input": "hi", "n": "64"}', "n: 64 exceeds this server's limit of 16"),
    # Issue 25 defect 4: JSON that Python's parser takes and later code cannot.
    (b'{"text_input": "hi", "max_tokens": Infinity}', "body.max_tokens: Infinity is not a JSON number"),
    (b'{"text_input": "hi", "temperature": 1e999}', "body.temperature: the number 1e999 is out of range"),
    (b'{"text_input": "hi", "sampling_parameters": "{\\"max_tokens\\": NaN}"}',
     "sampling_parameters.max_tokens: NaN is not a JSON number"),
    (b'{"text_input": "hi", "sampling_parameters": {"max_tokens": -Infinity}}',
     "body.sampling_parameters.max_tokens: -Infinity is not a JSON"),
    (b'{"text_input": "\\ud800 hi"}', "body.text_input: a lone surrogate (\\ud800)"),
    (b'{"text_input": "hi", "parameters": {"x": ' + b"[" * 100 + b"]" * 100 + b"}}", "nested too deeply"),
    (b"[" * 200000 + b"]" * 200000, "body: JSON nested too deeply"),
    (b'{"text_input": "\xff"}', "body: not UTF-8"),
    (b'{"input_ids": [1, "2"]}', "input_ids: must be a list of integers"),
    (b'{"input_ids": 5}', "input_ids: must be a list of integers"),
])
def test_generate_bodies_are_refused_naming_the_problem(body, message):
    with pytest.raises(LimitError) as info:
        validate_generate_body(body, RequestLimits(max_stop_strings=2))
    assert message in str(info.value) and info.value.status == 400


def test_generate_inputs_are_the_model_configs_inputs():
    import re
    from pathlib import Path

    from pagoda.fleet.gate.generate_body import GENERATE_INPUTS

    config = (Path(__file__).parents[2] / "model_repository" / "pagoda" / "config.pbtxt").read_text()
    inputs_block = config.split("input [", 1)[1].split("]\n", 1)[0]
    assert set(re.findall(r'name: "(\w+)"', inputs_block)) == set(GENERATE_INPUTS)


def test_valid_generate_body_keeps_its_inputs_and_serializes_a_json_object():
    document = validate_generate_body(json.dumps({
        "text_input": ["hi"], "stream": True, "max_tokens": 4, "temperature": 0, "traceparent": "00-x",
        "sampling_parameters": {"top_k": 5}}).encode(), RequestLimits())
    assert document["text_input"] == "hi" and json.loads(document["sampling_parameters"]) == {"top_k": 5}
    tokens = validate_generate_body(json.dumps({"input_ids": [1, 2, 3], "prompt_logprobs": 1}).encode(),
                                    RequestLimits())
    assert tokens["input_ids"] == [1, 2, 3] and sampling_of_generate(tokens)["prompt_logprobs"] == 1


def test_generate_body_speaks_the_replicas_request_parameter_vocabulary():
    """What the replica accepts (serving.dialects.vllm), the router's HTTP door accepts: the
    extension's ``id`` and ``parameters`` (the vLLM backend README's first curl) and sampling
    keys as top-level request parameters."""
    body = {"text_input": "hi", "id": "req-1", "parameters": {"stream": False, "temperature": 0, "max_tokens": 3},
            "ignore_eos": "true", "logit_bias": {"5": 1.0}, "structured_outputs": {"choice": ["a", "b"]}}
    document = validate_generate_body(json.dumps(body).encode(), RequestLimits())
    assert document["id"] == "req-1" and document["parameters"]["max_tokens"] == 3
    assert sampling_of_generate(document)["ignore_eos"] == "true"


def test_sampling_limits_name_the_limit():
    limits = RequestLimits(max_logprobs=5, max_stop_string_chars=3, max_stop_token_ids=2, max_messages=2,
                           max_prompt_chars=10)
    for sampling, message in [({"logprobs": 6}, "logprobs: 6 exceeds"), ({"stop": "abcd"}, "stop string of 4"),
                              ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids: 3 ids"),
                              ({"max_tokens": "40000"}, "--max-tokens-limit")]:
        with pytest.raises(LimitError, match=message):
            limits.check_sampling(sampling)
    with pytest.raises(LimitError, match="messages: 3 messages exceed"):
        limits.check_messages([{}] * 3)
    with pytest.raises(LimitError, match="prompt: 11 characters exceed"):
        limits.check_prompt("x" * 11)
    with pytest.raises(LimitError, match="--max-body-bytes") as info:
        limits.check_body_size(10 * 2**20)
    assert info.value.status == 413


def _infer_request(sampling_json=None, raw=True):
    request = service_pb2.ModelInferRequest(model_name="pagoda")
    items = [("text_input", "BYTES", b"hello")]
    if sampling_json is not None:
        items.append(("sampling_parameters", "BYTES", sampling_json.encode()))
    for name, datatype, value in items:
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.append(1)
        if raw:
            request.raw_input_contents.append(struct.pack("<I", len(value)) + value)
        else:
            tensor.contents.bytes_contents.append(value)
    return request


@pytest.mark.parametrize("raw", [True, False])
def test_a_grpc_request_is_read_into_its_wire_and_salted_there(raw):
    """The gRPC door reads pagoda's model's request once (raw or typed contents), and the tenant's
    salt is an option of its wire, sent in the canonical ``sampling_parameters``."""
    from pagoda.fleet.api.routed_request import RoutedRequest

    request = _infer_request('{"max_tokens": 3, "cache_salt": "mine"}', raw)
    routed = RoutedRequest.of_infer_request(request)
    assert routed.wire.params.max_tokens == 3 and routed.wire.options.cache_salt == "mine"
    routed.wire = routed.wire.with_options(cache_salt="tenant:a:mine")
    sent = routed.infer_request("00-trace")
    assert json.loads(read_string_input(sent, "sampling_parameters")) == {"max_tokens": 3,
                                                                          "cache_salt": "tenant:a:mine"}
    assert sent.parameters["traceparent"].string_param == "00-trace" and sent.id == request.id
    assert sampling_of_infer_request(sent) == {"max_tokens": 3, "cache_salt": "tenant:a:mine"}


# ------------------------------------------------------------------ keys, tenants, salts
def test_api_keys_map_to_tenants_and_errors_never_show_the_key():
    keys = ApiKeys.parse(f"# comment\n{SECRET} acme rpm=60 concurrency=2\nsk-other globex\n", "keys.txt",
                         Tenant("", tokens_per_minute=1000))
    assert keys.tenant_of(f"Bearer {SECRET}") == Tenant("acme", 60.0, 1000, 2)
    assert keys.tenant_of("bearer sk-other").tenant_id == "globex"
    for header in (None, "", f"Basic {SECRET}", f"Bearer {SECRET}x"):
        with pytest.raises(AuthError) as info:
            keys.tenant_of(header)
        assert SECRET not in str(info.value)
    for text, message in [(f"{SECRET}\n", "line 1: expected"), (f"{SECRET} a colour=red", "unknown option"),
                          (f"{SECRET} a\n{SECRET} b", "listed twice"), ("# none", "no keys")]:
        with pytest.raises(ValueError, match=message) as info:
            ApiKeys.parse(text, "keys.txt")
        assert SECRET not in str(info.value)
    assert load_api_keys(None, environ={}) is None
    assert load_api_keys(None, environ={"PAGODA_API_KEYS": "k1 t1;k2 t2"}).tenant_ids() == ["t1", "t2"]


def test_tenant_salt_isolates_unless_shared():
    acme = Tenant("acme")
    assert tenant_salt(acme, None, secret=b"s") != tenant_salt(Tenant("globex"), None, secret=b"s")
    assert tenant_salt(acme, "conv-7", secret=b"s") != tenant_salt(acme, None, secret=b"s")
    assert tenant_salt(acme, "conv-7", share_cache=True, secret=b"s") == "conv-7"
    assert tenant_salt(None, "conv-7", secret=b"s") == "conv-7"


def test_tenant_salt_is_injective_and_unguessable_without_the_router_secret():
    """Issue 25 defect 9: the salt is HMAC-SHA256(router secret, tenant id) with the
    client's salt length-prefixed, so tenant 'acme' with client salt 'x' no longer shares
    tenant 'acme:x''s cache, and whoever reaches a replica directly cannot compute a
    tenant's salt (it names no tenant); routers sharing the secret agree."""
    import hashlib
    import hmac

    secret = b"router-secret-0123456789abcdef"
    acme, acme_x = Tenant("acme"), Tenant("acme:x")
    assert tenant_salt(acme, "x", secret=secret) != tenant_salt(acme_x, None, secret=secret)
    assert tenant_salt(Tenant("a"), "b:c", secret=secret) != tenant_salt(Tenant("a:b"), "c", secret=secret)
    salt = tenant_salt(acme, None, secret=secret)
    assert "acme" not in salt and hmac.new(secret, b"acme", hashlib.sha256).hexdigest() in salt
    assert tenant_salt(acme, "x", secret=secret) == salt + ":1:x"
    assert tenant_salt(acme, None, secret=b"another secret") != salt
    assert Gate(keys=ApiKeys.parse("k acme", "keys"), salt_secret=secret).salt(acme, "x") == salt + ":1:x"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Gate(salt_secret=b"short")


def test_router_secret_comes_from_a_file_or_the_environment(tmp_path, caplog):
    from pagoda.fleet.gate.auth import load_router_secret

    path = tmp_path / "secret"
    path.write_text("file-secret-0123456789\n")
    assert load_router_secret(str(path), environ={}) == b"file-secret-0123456789"
    assert load_router_secret(None, environ={"PAGODA_ROUTER_SECRET": "env-secret-0123456789"}) == \
        b"env-secret-0123456789"
    # Neither: derived from the keys, so routers sharing a keys file agree across restarts,
    # and nobody without every key can compute it.
    keys, same, other = (ApiKeys.parse(text, "keys") for text in ("k1 a\nk2 b", "k2 b rpm=5\nk1 a", "k1 a\nk3 b"))
    derived = load_router_secret(None, environ={}, keys=keys)
    assert derived == load_router_secret(None, environ={}, keys=same) != load_router_secret(None, {}, keys=other)
    assert b"k1" not in derived and len(derived) == 32
    caplog.set_level(logging.WARNING)
    first, second = load_router_secret(None, environ={}), load_router_secret(None, environ={})
    assert first != second and len(first) >= 32  # no keys either: random per process, with a warning
    assert "PAGODA_ROUTER_SECRET" in caplog.text


def test_token_buckets_and_concurrency_on_an_injected_clock():
    clock = FakeClock()
    limiter = TenantLimiter(clock)
    tenant = Tenant("acme", requests_per_minute=2, tokens_per_minute=600, max_concurrent=2)
    first = limiter.admit(tenant, 100)
    limiter.admit(tenant, 100).release()
    with pytest.raises(RateLimited, match="2 requests per minute") as info:
        limiter.admit(tenant, 100)
    assert info.value.retry_after_s == 30  # one request refills in 60 / 2 s
    clock.now += 30
    second = limiter.admit(tenant, 350)  # 1 request, 400 + 50 refilled tokens left
    with pytest.raises(RateLimited, match="2 requests in flight"):
        limiter.admit(tenant, 1)
    first.release()
    first.release()  # idempotent
    clock.now += 60
    with pytest.raises(RateLimited, match="exceed tenant 'acme'.s 600 tokens per minute"):
        limiter.admit(tenant, 601)
    second.release()
    limiter.admit(tenant, 600).release()
    with pytest.raises(RateLimited, match="600 tokens per minute; retry after 10 s"):
        limiter.admit(tenant, 100)
    assert limiter.num_limited == {"requests_per_minute": 1, "concurrency": 1, "tokens_per_minute": 1}
    assert limiter.admit(None, 10**9).state is None  # open mode: no limits


def test_token_quota_charges_n_times_the_effective_max_tokens_and_refunds_the_unused():
    """Issue 25 defect 5: a request costs prompt + n x max_tokens, and without max_tokens
    the replicas' default_max_tokens (router --default-max-tokens, 1024 like the model
    repository's); when it ends, the charge is reconciled with what it really used."""
    clock = FakeClock()
    keys = ApiKeys.parse(f"{SECRET} acme tpm=10000", "keys")
    gate = Gate(RequestLimits(), keys, clock=clock)
    acme = gate.authenticate(f"Bearer {SECRET}")
    assert RequestLimits().default_max_tokens == 1024
    assert gate.num_tokens(10, {}) == 10 + 1024
    assert gate.num_tokens(10, {"n": 4}) == 10 + 4 * 1024
    assert gate.num_tokens(10, {"n": "2", "max_tokens": "50"}) == 10 + 2 * 50  # vLLM-backend strings
    assert gate.num_tokens(10, {"max_tokens": None}) == 10 + 1024  # a Triton body's "max_tokens": null
    assert gate.num_tokens(3, SamplingParams(n=16, max_tokens=8)) == 3 + 16 * 8  # an OpenAI completion, n=16
    assert Gate(RequestLimits(default_max_tokens=64)).num_tokens(0, {"n": 3}) == 192
    ticket = gate.charge(acme, 10, {"n": 4})  # 4106 of 10000
    second = gate.charge(acme, 10, {"n": 4})  # 8212
    with pytest.raises(RateLimited, match="10000 tokens per minute"):
        gate.charge(acme, 10, {"n": 4})
    ticket.settle(10 + 4 * 3)  # it stopped after 3 tokens per completion: 4084 tokens back
    ticket.settle(10**6)  # settles once
    third = gate.charge(acme, 10, {"n": 4})
    second.settle(0)  # failed before any replica ran it: all back
    third.release()
    gate.charge(acme, 10, {"n": 4}).release()
    with pytest.raises(RateLimited, match=r"this request's 20490 tokens \(prompt \+ n x max_tokens\) exceed"):
        gate.charge(acme, 10, {"n": 20})
    assert gate.charge(None, 10**6, {"n": 16}).state is None  # open mode


def test_overload_memory_prefers_replicas_with_room():
    clock = FakeClock()
    gate = Gate(clock=clock)
    replicas = ReplicaSet("static")
    replicas.set_members([("a", {"grpc": "h:1", "http": "h:2"}), ("b", {"grpc": "h:3", "http": "h:4"})])
    router = Router(replicas, tokenizer=None, hash_model_id="m", policy_name="round_robin")

    async def choose(tried):
        decision = await gate.choose(router, None, tried, 1)
        router.release(decision)
        return decision.replica.replica_id

    gate.mark_full("a", 1.0)
    assert {asyncio.run(choose([])) for _ in range(4)} == {"b"}
    assert asyncio.run(choose(["b"])) == "a"  # every replica with room tried: a full one is still better than none
    clock.now += 1.0
    assert {asyncio.run(choose([])) for _ in range(4)} == {"a", "b"}


# ------------------------------------------------------------------ the HTTP doors, for real
@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from pagoda.models.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(smollm2_path)


def _app(tokenizer, gate, allow_runtime_lora=False):
    from pagoda.fleet.api.http_api import make_app
    from pagoda.fleet.api.lora_admin import LoRAAdmin
    from pagoda.fleet.api.openai_api import OpenAIApi
    from pagoda.fleet.api.tracing import RouterTracer
    from pagoda.fleet.api.upstream import GrpcUpstream

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    router = Router(ReplicaSet("static"), tokenizer, "m", "least_loaded")  # no replicas: nothing gets routed
    exporter = InMemorySpanExporter()
    tracer = RouterTracer(exporter, batch=False)
    admin = LoRAAdmin(base_model_names=("smol", "pagoda"), allow_runtime=allow_runtime_lora)
    openai = OpenAIApi(router, tracer, gate, admin, GrpcUpstream(router, gate), "smol")
    return make_app(router, tracer, gate, admin, openai), exporter


def test_http_doors_refuse_before_routing(tokenizer, caplog):
    clock = FakeClock()
    keys = ApiKeys.parse(f"{SECRET} acme rpm=1\n{SECRET_TPM} small tpm=2000", "keys")
    gate = Gate(RequestLimits(max_body_bytes=2**20), keys, clock=clock)
    caplog.set_level(logging.DEBUG)
    app, exporter = _app(tokenizer, gate)
    asyncio.run(_http_scenario(app, clock))
    assert SECRET not in caplog.text
    spans = exporter.get_finished_spans()
    assert spans and all(SECRET not in span.to_json() for span in spans)


async def _http_scenario(app, clock):
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:
        async def call(method, path, body=None, headers=None):
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            async with client.request(method, path, data=data, headers=headers or {}) as response:
                return response.status, dict(response.headers), await response.read()

        auth = {"Authorization": f"Bearer {SECRET}",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, _, body = await call("POST", "/v1/chat/completions", chat)
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        status, _, body = await call("POST", "/v2/models/pagoda/generate", {"text_input": "hi"})
        assert status == 401 and "missing API key" in json.loads(body)["error"]
        # A keyed router shows engine settings, statistics and logging only to key holders;
        # liveness, readiness and metadata stay open (probes and discovery carry no keys).
        for path in ("/v2/models/pagoda/config", "/v2/models/pagoda/stats", "/v2/logging", "/v2/trace/setting",
                     "/v2/models/pagoda/versions/1/config"):
            status, _, body = await call("GET", path)
            assert status == 401 and "missing API key" in json.loads(body)["error"], path
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/pagoda/ready", "/v2"):
            status, _, _ = await call("GET", path)
            assert status != 401, path

        start = time.perf_counter()
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (10 * 2**20)}]}).encode()
        status, _, body = await call("POST", "/v1/chat/completions", big, auth)
        assert status == 413 and "body" in json.loads(body)["error"]["message"]
        assert time.perf_counter() - start < 30  # refused from Content-Length, not after parsing

        status, _, body = await call("POST", "/v1/completions", {"prompt": "hi", "n": 20}, auth)
        assert status == 400 and json.loads(body)["error"]["message"].startswith("n: 20 exceeds this server's limit")
        status, _, body = await call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                      "logprobs": True, "top_logprobs": 20,
                                                                      "stop": ["s"] * 17}, auth)
        assert status == 400 and "stop: 17 stop strings exceed" in json.loads(body)["error"]["message"]

        wizard = {"messages": [{"role": "wizard", "content": "hi"}]}
        status, _, body = await call("POST", "/v1/chat/completions", wizard, auth)
        assert status == 400 and "messages[0].role" in json.loads(body)["error"]["message"]
        status, _, body = await call("POST", "/v2/models/pagoda/generate", {"text_input": "hi", "frobnicate": 1}, auth)
        assert status == 400 and "frobnicate: unknown input" in json.loads(body)["error"]

        # The first valid request is admitted (503: no replica); the second is over rpm=1.
        status, _, _ = await call("POST", "/v1/chat/completions", chat, auth)
        assert status == 503
        status, headers, body = await call("POST", "/v1/chat/completions", chat, auth)
        assert status == 429 and headers["Retry-After"] == "60"
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
        clock.now += 60
        status, _, _ = await call("POST", "/v2/models/pagoda/generate", {"text_input": "hi"}, auth)
        assert status == 503

        # Quotas count n x the replicas' default max_tokens (1024) where a request runs to it: chat
        # without max_tokens, a generate body with max_tokens null (absent, the vLLM backend's
        # SamplingParams default, 16, applies, and /v1/completions has OpenAI's own, 16, too).
        for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
                           ("/v2/models/pagoda/generate", {"text_input": "hi",
                                                           "sampling_parameters": {"n": 2, "max_tokens": None}})]:
            clock.now += 60
            status, _, body = await call("POST", path, body, {"Authorization": f"Bearer {SECRET_TPM}"})
            assert status == 429 and "(prompt + n x max_tokens) exceed tenant 'small'" in body.decode(), (path, body)

        status, _, metrics = await call("GET", "/metrics")
        assert b'pagoda_router_refused_total{reason="unauthenticated"} 7' in metrics
        from pagoda.fleet.gate.gate import REFUSAL_REASONS  # every reason has its row, from 0

        assert all(f'pagoda_router_refused_total{{reason="{r}"}} '.encode() in metrics for r in REFUSAL_REASONS)
        assert SECRET.encode() not in metrics


# ------------------------------------------------------------------ the gRPC door, for real
def test_grpc_door_refuses_a_message_over_the_body_limit_and_keeps_serving(tokenizer):
    """Issue 25 defect 8: the router's gRPC receive limit is its HTTP body limit
    (``--max-body-bytes``): a larger message gets RESOURCE_EXHAUSTED naming both sizes,
    on the unary and the streaming door, and the next calls are served."""
    asyncio.run(_grpc_limit_scenario(tokenizer))


@contextlib.asynccontextmanager
async def _grpc_door(tokenizer, gate):
    """The router's gRPC door over ``gate`` and no replicas, on a free port; yields a stub."""
    import grpc
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from tritonclient.grpc import service_pb2_grpc

    from pagoda.fleet.api.grpc_proxy import GrpcProxy, make_grpc_server
    from pagoda.fleet.api.tracing import RouterTracer
    from pagoda.fleet.api.upstream import GrpcUpstream

    router = Router(ReplicaSet("static"), tokenizer, "m", "least_loaded")  # no replicas
    proxy = GrpcProxy(router, RouterTracer(InMemorySpanExporter(), batch=False), gate, GrpcUpstream(router, gate))
    server, port = make_grpc_server(proxy, "127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await server.stop(0)


async def _grpc_limit_scenario(tokenizer):
    import grpc

    async with _grpc_door(tokenizer, Gate(RequestLimits(max_body_bytes=2**20))) as stub:
        big = _infer_request()
        big.raw_input_contents[0] = struct.pack("<I", 3 * 2**20) + b"x" * (3 * 2**20)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(2**20) in info.value.details(), info.value.details()

        async def one(request):
            return [response async for response in stub.ModelStreamInfer(iter([request]))]

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await one(big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.ServerLive(service_pb2.ServerLiveRequest())).live
        [answer] = await one(_infer_request('{"max_tokens": 2}'))  # a normal request is routed (no replica)
        assert "no replica" in answer.error_message


def test_hostile_json_is_a_400_naming_it_on_every_door_and_the_doors_keep_serving(tokenizer):
    """Issue 25 defect 4: Infinity/NaN, 1e999, lone surrogates and deep nesting were 500s on
    the router's HTTP doors and lost requests on its gRPC door."""
    asyncio.run(_hostile_json_scenario(tokenizer))


async def _hostile_json_scenario(tokenizer):
    from aiohttp.test_utils import TestClient, TestServer

    app, _ = _app(tokenizer, Gate(RequestLimits()), allow_runtime_lora=True)
    hostile = [b'{"prompt": "hi", "max_tokens": Infinity}', b'{"prompt": "hi", "temperature": 1e999}',
               b'{"prompt": "\\ud83d hi"}', b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
               b'{"messages": [{"role": "user", "content": "\\udfff"}]}', b"[" * 200000 + b"]" * 200000]
    async with TestClient(TestServer(app)) as client:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter",
                     "/v2/models/pagoda/generate", "/v2/models/pagoda/generate_stream"):
            for body in hostile:
                async with client.post(path, data=body) as response:
                    text = await response.text()
                    assert response.status == 400, (path, body[:40], response.status, text)
                    assert "Traceback" not in text and ("body" in text), (path, text)
        async with client.post("/v1/completions", data=b'{"prompt": "hi", "max_tokens": 2}') as response:
            assert response.status == 503  # valid and admitted: no replica to route to
        for path in ("/v2/models/pagoda/infer", "/v2/models/pagoda/versions/1/infer"):
            async with client.post(path, data=b'{"inputs": [{"name": "text_input", "datatype": "BYTES", '
                                              b'"shape": [1], "data": ["\\ud800"]}]}') as response:
                text = await response.text()
                assert response.status == 400 and "lone surrogate" in text, (path, text)
            async with client.post(path, json=INFER_OK) as response:
                assert response.status == 503, await response.text()  # valid: forwarded (no replica)
    async with _grpc_door(tokenizer, Gate(RequestLimits())) as stub:
        import grpc

        for sampling in ('{"max_tokens": Infinity}', '{"temperature": 1e999}', '{"n": NaN}',
                         '{"stop": ' + "[" * 5000 + "]" * 5000 + "}"):
            answers = [r async for r in stub.ModelStreamInfer(iter([_infer_request(sampling)]))]
            assert len(answers) == 1 and "sampling_parameters" in answers[0].error_message, (sampling, answers)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(_infer_request(sampling))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling_parameters" in info.value.details()
        [answer] = [r async for r in stub.ModelStreamInfer(iter([_infer_request('{"max_tokens": 2}')]))]
        assert "no replica" in answer.error_message


INFER_OK = {"id": "r1", "inputs": [
    {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hello"]},
    {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": ['{"max_tokens": 4}']},
    {"name": "stream", "datatype": "BOOL", "shape": [1], "data": [False]}], "outputs": [{"name": "text_output"}]}


@pytest.mark.parametrize("change, message", [
    ({"inputs": []}, "inputs: required, a non-empty list"),
    ({"frobnicate": 1}, "frobnicate: unknown key of an inference request"),
    ({"id": 5}, "id: must be a string"),
    ({"inputs": [{"name": "text_input", "datatype": "STRING", "shape": [1], "data": ["x"]}]},
     "inputs[0].datatype (text_input): must be one of"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [-1], "data": ["x"]}]},
     "inputs[0].shape (text_input): must be a list of non-negative integers"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}]}, "inputs[0].data (text_input): required"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x" * 2000]}]},
     "text_input: 2000 characters exceed"),
    ({"inputs": [{"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": ['{"n": 99}']}]},
     "n: 99 exceeds this server's limit"),
    ({"inputs": [{"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": ['{"n": Infinity}']}]},
     "sampling_parameters.n: Infinity is not a JSON number"),
    ({"outputs": [{"nom": "text_output"}]}, "outputs: must be a list of {name, parameters?} objects"),
])
def test_infer_bodies_are_checked_before_they_are_forwarded(change, message):
    from pagoda.fleet.gate.infer_body import validate_infer_body

    limits = RequestLimits(max_prompt_chars=1000)
    validate_infer_body(json.dumps(INFER_OK).encode(), None, limits)  # the valid one passes
    with pytest.raises(LimitError) as info:
        validate_infer_body(json.dumps({**INFER_OK, **change}).encode(), None, limits)
    assert message in str(info.value) and info.value.status == 400


def test_infer_with_the_binary_extension_checks_the_json_header_only():
    from pagoda.fleet.gate.infer_body import validate_infer_body

    header = json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": 9}}]}).encode()
    body = header + struct.pack("<I", 5) + b"hello"
    validate_infer_body(body, str(len(header)), RequestLimits())
    for bad in ("x", str(len(body) + 1)):
        with pytest.raises(LimitError, match="Inference-Header-Content-Length"):
            validate_infer_body(body, bad, RequestLimits())


# ------------------------------------------------------------------ tokenization off the loop
def test_tokenizing_a_huge_prompt_does_not_stall_the_event_loop(tokenizer):
    """Issue 25 defect 6: the router tokenizes (and hashes) prompts on a thread pool, so a
    huge prompt does not freeze the event loop that relays every other stream. Two
    measures while a request is handled: the CPU time the loop's thread spent (robust on a
    busy machine: 25-45 ms here, mostly the probe and the client; tokenizing on the loop
    costs ~1 s of it) and the worst lateness of a
    probe task that asks to wake every 5 ms (what a concurrent stream's inter-token gap
    would get; the bound is the issue's 50 ms). A 3 MB prompt is refused by the character
    cap before anything is tokenized (400 naming it); one at the cap (here 250,000
    characters, ~214k tokens, ~0.6 CPU-s of tokenizing: 12x the bound were it on the loop; the
    default cap is 1,000,000) is tokenized off the loop."""
    gate = Gate(RequestLimits(max_body_bytes=8 * 2**20, max_prompt_chars=250_000))
    app, _ = _app(tokenizer, gate)
    words = " ".join(f"w{i % 9973}x" for i in range(500_000))
    [(status, answer, _, cpu), *at_cap] = asyncio.run(_probe_while_posting(
        app, "/v1/completions", [{"prompt": words[: 3 * 2**20], "max_tokens": 1}]
        + [{"prompt": words[:250_000], "max_tokens": 1}] * 3))
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert "limit of 250000 (router --max-prompt-chars)" in answer["error"]["message"]
    assert cpu < 0.25, f"the event loop's thread spent {cpu * 1e3:.0f} ms refusing a 3 MB prompt"
    assert all(status == 503 for status, _, _, _ in at_cap), at_cap  # tokenized, then no replica
    print(f"probe lateness {[round(late * 1e3, 1) for _, _, late, _ in at_cap]} ms, "
          f"loop CPU {[round(cpu * 1e3, 1) for _, _, _, cpu in at_cap]} ms")
    cpu = min(cpu for _, _, _, cpu in at_cap)
    assert cpu < 0.25, f"the event loop's thread spent {cpu * 1e3:.0f} ms while a prompt at the cap was tokenized"
    # A probe is sometimes late for reasons of its own on a shared machine; a stall from
    # tokenizing is late every time: the best of three attempts must be within bound.
    lateness = min(late for _, _, late, _ in at_cap)
    assert lateness < 0.05, f"the event loop stalled {lateness * 1e3:.0f} ms while a prompt at the cap was tokenized"


async def _probe_while_posting(app, path, bodies) -> list[tuple[int, dict, float, float]]:
    """(status, JSON answer, the probe's worst lateness in s, CPU s of the loop's thread)
    of posting each body to ``path``."""
    from aiohttp.test_utils import TestClient, TestServer

    results = []
    async with TestClient(TestServer(app)) as client:
        for body in bodies:
            data = json.dumps(body).encode()
            worst, running = 0.0, True

            async def probe():
                nonlocal worst
                while running:
                    start = time.perf_counter()
                    await asyncio.sleep(0.005)
                    worst = max(worst, time.perf_counter() - start - 0.005)

            task = asyncio.create_task(probe())
            cpu = time.thread_time()
            async with client.post(path, data=data, headers={"Content-Type": "application/json"}) as response:
                status, answer = response.status, await response.json()
            cpu = time.thread_time() - cpu
            running = False
            await task
            results.append((status, answer, worst, cpu))
    return results


# ------------------------------------------------------------------ malformed Authorization
def test_a_malformed_authorization_header_is_never_echoed_nor_logged(tokenizer, caplog):
    """Issue 25 defect 9: a header aiohttp cannot parse (a control character), one that is
    not UTF-8, or one of another scheme is answered without its value (aiohttp's own 400
    echoed the header line, and logged it with a traceback; a non-UTF-8 key was a 500)."""
    from pagoda.fleet.api.http_runner import make_runner

    caplog.set_level(logging.DEBUG)
    gate = Gate(RequestLimits(), ApiKeys.parse(f"{SECRET} acme", "keys"))
    app, _ = _app(tokenizer, gate)
    answers = asyncio.run(_raw_requests(make_runner(app), [
        b"Bearer " + SECRET.encode() + b"\x01x", b"Bearer " + SECRET.encode() + b"\xff",
        b"Basic " + SECRET.encode(), b"Bearer " + SECRET.encode() + b"x y"]))
    for answer in answers:
        assert SECRET.encode() not in answer, answer
    statuses = [answer.split(b" ", 2)[1] for answer in answers]
    assert statuses == [b"400", b"401", b"401", b"401"], answers
    assert b"malformed HTTP request" in answers[0] and b"malformed Authorization" in answers[1]
    assert SECRET not in caplog.text and SECRET[:12] not in caplog.text


async def _raw_requests(runner, authorizations: list[bytes]) -> list[bytes]:
    from aiohttp import web

    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    answers = []
    try:
        for authorization in authorizations:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\nAuthorization: " + authorization + b"\r\n\r\n{}")
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(65536), 10))
            writer.close()
    finally:
        await runner.cleanup()
    return answers


def test_keyed_grpc_door_shows_the_model_config_only_to_key_holders(tokenizer):
    """Issue 25 defect 9: ModelConfig (the engine's settings) needs a key when the router has
    keys; liveness stays open."""
    asyncio.run(_grpc_config_scenario(tokenizer))


async def _grpc_config_scenario(tokenizer):
    import grpc

    async with _grpc_door(tokenizer, Gate(RequestLimits(), ApiKeys.parse(f"{SECRET} acme", "keys"))) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelConfig(service_pb2.ModelConfigRequest(name="pagoda"))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and SECRET not in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:  # with the key: past the gate, no replica here
            await stub.ModelConfig(service_pb2.ModelConfigRequest(name="pagoda"),
                                   metadata=(("authorization", f"Bearer {SECRET}"),))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (await stub.ServerLive(service_pb2.ServerLiveRequest())).live


ADMIN_SECRET = "sk-admin-0123456789abcdef"


def test_only_admin_keys_load_and_unload_adapters_and_names_are_checked(tokenizer):
    """Issue 25 defect 7: with keys, run-time LoRA control needs a key with the ``admin``
    option (403 otherwise, on the OpenAI and the Triton HTTP doors); an adapter name must be
    1-128 of [A-Za-z0-9._-] (a 100,000-character name is a 400 that does not echo it whole)."""
    keys = ApiKeys.parse(f"{SECRET} acme\n{ADMIN_SECRET} ops admin", "keys")
    app, _ = _app(tokenizer, Gate(RequestLimits(), keys), allow_runtime_lora=True)
    asyncio.run(_lora_admin_scenario(app))
    with pytest.raises(ValueError, match="known: rpm, tpm, concurrency, admin"):
        ApiKeys.parse(f"{SECRET} acme root", "keys")


async def _lora_admin_scenario(app):
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:
        async def call(path, body, secret):
            async with client.post(path, data=json.dumps(body).encode(),
                                   headers={"Authorization": f"Bearer {secret}"}) as response:
                return response.status, await response.text()

        load = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        status, text = await call("/v1/load_lora_adapter", load, SECRET)
        assert status == 403 and "admin key" in text
        status, text = await call("/v2/models/pagoda/generate", {"lora_action": "unload", "lora_name": "sql"}, SECRET)
        assert status == 403 and "admin key" in text
        for name in ("x" * 100_000, "../etc", "a b"):
            status, text = await call("/v1/load_lora_adapter", {**load, "lora_name": name}, ADMIN_SECRET)
            assert status == 400 and "lora_name: must be 1-128" in text and len(text) < 1000, name
        status, text = await call("/v1/load_lora_adapter", load, ADMIN_SECRET)  # allowed; no replica to load on
        assert status not in (400, 403), text
