"""Admission control, deadlines and tenants end to end: one real tritonserver replica
(default SmolLM2 on CPU, ``max_num_seqs=2``, ``max_waiting_requests=2``) behind
``pagoda router`` with API keys for two tenants.

Covers: a burst refused at once with the overload error (replica HTTP: 400 with it; router
OpenAI: 429 + Retry-After; router Triton HTTP: 503 + Retry-After; router gRPC: the
error message), the admitted requests completing and the KV cache back to empty; a
``timeout`` ending a request with its own error (OpenAI 408); tenant B getting no prefix
hit on tenant A's prompt while A hits its own; keys required on every door.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

from pagoda.serving.launch.launcher import TritonServer, find_free_port

from pagoda.serving.launch.serve_options import ServeOptions

from tests.fleet.test_router_e2e import grpc_generate, read_metric

pytestmark = [pytest.mark.server]

KEY_A, KEY_B, KEY_C = "sk-tenant-a-5f1e", "sk-tenant-b-93c2", "sk-tenant-c-quota-77"
PROMPT = ("Pagoda tea house rules: " + " ".join(f"rule {i} says brew the tea for {i} minutes." for i in range(30)))


@pytest.fixture(scope="module")
def replica(tmp_path_factory, smollm2_path):
    options = ServeOptions(model=smollm2_path, http_port=find_free_port(), grpc_port=find_free_port(),
                           metrics_port=find_free_port(), max_model_len=512, max_num_seqs=2, startup_timeout_s=600,
                           engine_args={"max_waiting_requests": "2"})
    server = TritonServer(options, log_path=str(tmp_path_factory.mktemp("replica") / "replica.log"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def router(replica, tmp_path_factory, smollm2_path):
    from pagoda.fleet.service import BackgroundRouter, RouterOptions

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n{KEY_C} tenant-c tpm=600\n")
    spec = f"id=r0,grpc={replica.grpc_url},http={replica.http_url}"
    options = RouterOptions(model_dir=smollm2_path, model_name="smol", replicas=spec, host="127.0.0.1",
                            http_port=0, grpc_port=0, health_interval_s=0.5, api_keys_file=str(keys))
    with BackgroundRouter(options) as background:
        yield background


def post(url, path, body, key=None, timeout=120):
    """(status, headers, parsed JSON body) of a POST."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


def burst(fn, n):
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: fn(i), range(n)))


def _idle(replica):
    deadline = time.monotonic() + 60
    while read_metric(replica, "vllm:num_requests_running") + read_metric(replica, "vllm:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the replica did not become idle"
        time.sleep(0.1)
    assert read_metric(replica, "vllm:kv_cache_usage_perc") == 0.0


def test_burst_is_refused_at_once_with_the_overload_error(replica, router):
    body = {"text_input": "Tell me a story about tea.", "max_tokens": 24, "temperature": 0}
    direct = burst(lambda i: post(replica.http_url, "/v2/models/pagoda/generate", body), 10)
    refused = [r for r in direct if r[0] != 200]
    assert refused and len(refused) < 10, [r[0] for r in direct]
    for status, _, answer in refused:
        # tritonserver's generate endpoint answers every backend error with 400 (whatever
        # its code); the message tells the overload apart. The router answers 503/429.
        assert status == 400 and answer["error"].startswith("overloaded:") and "Retry after" in answer["error"]

    chat = {"messages": [{"role": "user", "content": "Tell me a story about tea."}], "max_tokens": 24,
            "temperature": 0}
    answers = burst(lambda i: post(router.http_url, "/v1/chat/completions", chat, KEY_A), 10)
    statuses = sorted(r[0] for r in answers)
    assert set(statuses) == {200, 429}, statuses
    for status, headers, answer in answers:
        if status == 429:
            assert headers["Retry-After"] == "1" and answer["error"]["type"] == "rate_limit_error"
        else:
            assert answer["choices"][0]["finish_reason"] == "length"

    triton = burst(lambda i: post(router.http_url, "/v2/models/pagoda/generate", body, KEY_A), 10)
    assert {r[0] for r in triton} == {200, 503}, [r[0] for r in triton]
    assert all(r[1].get("Retry-After") == "1" for r in triton if r[0] == 503)

    texts, errors = grpc_generate(router.grpc_url, ["Tell me a story about tea."] * 8, max_tokens=24,
                                  metadata={"authorization": f"Bearer {KEY_A}"})
    assert errors and all("overloaded:" in str(e) for e in errors) and texts
    _idle(replica)


def test_timeout_ends_the_request_with_its_own_error(replica, router):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "timeout": 1e-6}
    status, _, answer = post(router.http_url, "/v1/completions", body, KEY_A)
    assert status == 408 and answer["error"]["message"].startswith("deadline exceeded:")
    status, _, answer = post(router.http_url, "/v1/completions", {**body, "timeout": 60}, KEY_A)
    assert status == 200
    _idle(replica)


def test_tenants_never_share_cached_blocks(replica, router):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert post(router.http_url, "/v1/completions", body, KEY_A)[0] == 200
    hits = read_metric(replica, "vllm:prefix_cache_hits_total")
    assert post(router.http_url, "/v1/completions", body, KEY_B)[0] == 200  # tenant B's timing probe
    assert read_metric(replica, "vllm:prefix_cache_hits_total") == hits
    assert post(router.http_url, "/v1/completions", body, KEY_A)[0] == 200  # tenant A hits its own blocks
    assert read_metric(replica, "vllm:prefix_cache_hits_total") >= hits + 16 * 10


def test_limits_and_deadlines_over_grpc(replica, router):
    auth = {"authorization": f"Bearer {KEY_A}"}
    texts, errors = grpc_generate(router.grpc_url, ["hi"], max_tokens=10**6, metadata=auth)
    assert len(errors) == 1 and "max_tokens: 1000000 exceeds this server's limit of 32768" in str(errors[0])
    texts, errors = grpc_generate(router.grpc_url, ["hi"], max_tokens=4, timeout=1e-6, metadata=auth)
    assert len(errors) == 1 and "deadline exceeded:" in str(errors[0])
    status, _, answer = post(router.http_url, "/v2/models/pagoda/generate",
                             {"text_input": "hi", "sampling_parameters": {"timeout": 1e-6}}, KEY_A)
    assert status == 400 and answer["error"].startswith("deadline exceeded:")  # the replica's own answer
    status, _, answer = post(router.http_url, "/v2/models/pagoda/generate",
                             {"text_input": "hi", "stop_words": ["x"] * 20}, KEY_A)
    assert status == 400 and "stop: 20 stop strings exceed this server's limit of 16" in answer["error"]
    # over the router's limit, not refused first as invalid by SamplingParams' own bound (64)
    status, _, answer = post(router.http_url, "/v1/completions", {"prompt": "hi", "n": 100}, KEY_A)
    assert status == 400 and answer["error"]["message"].startswith("n: 100 exceeds this server's limit of 16")
    status, _, answer = post(router.http_url, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, KEY_A)
    assert status == 400 and "max_tokens: 1000000 exceeds this server's limit" in answer["error"]["message"]
    _idle(replica)


def test_token_quota_is_settled_with_the_usage_when_the_request_ends(replica, router):
    """Issue 25 defect 5: a request is charged its worst case (prompt + n x max_tokens: 430+
    of tenant-c's 600 tokens/min), then settled with what it used (it stops at the first
    space), so a second such request right after is admitted instead of a 429."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 400,
            "temperature": 0, "stop": [" ", "\n"]}
    for _ in range(2):
        status, _, answer = post(router.http_url, "/v1/chat/completions", body, KEY_C)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] < 50
    status, _, answer = post(router.http_url, "/v1/chat/completions", {**body, "n": 2}, KEY_C)
    assert status == 429 and "(prompt + n x max_tokens) exceed tenant 'tenant-c'" in answer["error"]["message"]


def test_every_door_needs_a_key(router):
    status, headers, _ = post(router.http_url, "/v1/completions", {"prompt": "hi"})
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert post(router.http_url, "/v2/models/pagoda/generate", {"text_input": "hi"}, "sk-wrong")[0] == 401
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(router.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ModelStreamInfer(iter([service_pb2.ModelInferRequest(model_name="pagoda")]),
                                       metadata=[("authorization", "Bearer sk-wrong")], timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid API key" in info.value.details()
    # tritonclient's own stream: its request goes out (the stream is not broken under it) and its
    # callback hears UNAUTHENTICATED naming the key (masked), even when it sends a moment after opening
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    heard: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(router.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: heard.put(error),
                            headers={"authorization": "Bearer sk-wrong-key-0042"})
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
        time.sleep(0.3)
        client.async_stream_infer("pagoda", [text])
        error = heard.get(timeout=30)
        assert error.status() == "StatusCode.UNAUTHENTICATED" and error.message() == "invalid API key sk-wro...042"
    finally:
        client.stop_stream()
        client.close()
    status, _, answer = post(router.http_url, "/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, KEY_A)
    assert status == 400 and "stop_token_ids" in answer["error"]["message"]


def test_client_disconnect_is_an_info_line(replica, router, caplog):
    import logging

    caplog.set_level(logging.INFO)
    body = {"messages": [{"role": "user", "content": "Tell me a long story about tea."}], "max_tokens": 200,
            "stream": True}
    request = urllib.request.Request(f"http://{router.http_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.readline()  # the first event, then hang up mid-stream
    _idle(replica)  # the replica aborted it: the cancel reached it
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("client disconnected" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
