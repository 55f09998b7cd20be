"""pagoda on a real tritonserver (CPU, default SmolLM2): gRPC streaming, HTTP generate and
generate_stream in vLLM and TensorRT-LLM dialects, cancellation, errors, metrics.

Continuous batching is observed through the server's own step statistics:
``pagoda:batched_decode_steps_total`` grows only when one engine step advanced the decodes
of two or more requests together, and ``pagoda:max_num_running_seen`` is the largest
batch a step ran.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.launch.client import stream_generate

MAX_MODEL_LEN = 1024  # the server fixture's max_model_len (asserted below)

pytestmark = pytest.mark.server

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The meaning of life is",
    "Translate to French: good morning",
    "Q: What is 2 + 2?\nA:",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline_texts():
    """Greedy completions from the offline API (in this process), the reference."""
    llm = LLM(max_model_len=MAX_MODEL_LEN)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outputs]


def http_post(server, path, body):
    """POST JSON; returns (status, parsed JSON body)."""
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def http_stream(server, body):
    """POST to generate_stream; returns the list of SSE ``data:`` events as dicts."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/pagoda/generate_stream",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    return events


def is_ready(server):
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/pagoda/ready", timeout=5) as response:
            return response.status == 200
    except urllib.error.URLError:
        return False


def test_grpc_streaming_8_concurrent_equal_offline_and_batched(triton_server, offline_texts, read_metrics):
    from tritonclient.grpc import aio

    before = read_metrics()

    async def one(client, prompt):
        chunks = []
        async for out in stream_generate(client, prompt, {"temperature": 0, "max_tokens": MAX_TOKENS},
                                         return_finish_reason=True, return_num_output_tokens=True):
            chunks.append((time.monotonic(), out))
        return chunks

    async def run():
        client = aio.InferenceServerClient(triton_server.grpc_url)
        try:
            return await asyncio.gather(*[one(client, p) for p in PROMPTS])
        finally:
            await client.close()

    results = asyncio.run(run())
    after = read_metrics()
    for prompt, chunks, expected in zip(PROMPTS, results, offline_texts):
        assert len(chunks) > 1, f"{prompt!r}: expected several streamed responses"
        text = "".join(out["text_output"] for _, out in chunks)
        assert text == expected, prompt
        assert chunks[-1][1]["finish_reason"] in ("length", "stop")
        assert all(out["finish_reason"] == "None" for _, out in chunks[:-1])  # the vLLM backend's str(None)
        assert sum(out["num_output_tokens"] for _, out in chunks) <= MAX_TOKENS
    # The streams were live at the same time: every request's first token arrived before
    # any request's last one ...
    assert max(chunks[0][0] for chunks in results) < min(chunks[-1][0] for chunks in results)
    # ... and the engine decoded them in shared steps (continuous batching).
    assert after["pagoda:batched_decode_steps_total"] - before["pagoda:batched_decode_steps_total"] >= MAX_TOKENS // 2
    assert after["pagoda:max_num_running_seen"] >= 4


@pytest.mark.parametrize("dialect", ["vllm", "trtllm"])
def test_http_generate_and_generate_stream(triton_server, offline_texts, dialect):
    prompt, expected = PROMPTS[0], offline_texts[0]
    if dialect == "vllm":
        body = {"text_input": prompt, "exclude_input_in_output": True, "return_finish_reason": True,
                "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})}
        whole = expected
    else:  # TensorRT-LLM ensemble style: scalar inputs, the prompt echoed in non-streaming output
        body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "bad_words": "",
                "stop_words": "", "return_finish_reason": True}
        whole = prompt + expected
    status, result = http_post(triton_server, "/v2/models/pagoda/generate", body)
    assert status == 200, result
    assert result["text_output"] == whole
    assert result["finish_reason"] in ("length", "stop")

    events = http_stream(triton_server, {**body, "stream": True})
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected
    assert events[-1]["finish_reason"] in ("length", "stop")


def _cancel_grpc_after_3(server, read_metrics, prompt, params):
    from tritonclient.grpc import aio

    async def run():
        client = aio.InferenceServerClient(server.grpc_url)
        try:
            stream = stream_generate(client, prompt, params)
            num_chunks = 0
            async for _ in stream:
                num_chunks += 1
                if num_chunks == 3:
                    during = read_metrics()
                    break
            await stream.aclose()  # cancels the gRPC call
            return during
        finally:
            await client.close()

    return asyncio.run(run())


def _disconnect_http_after_3(server, read_metrics, prompt, params):
    body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(params)}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/pagoda/generate_stream",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=120)
    num_events = 0
    for line in response:
        num_events += line.startswith(b"data:")
        if num_events == 3:
            break
    during = read_metrics()
    response.close()  # the client goes away mid-stream
    return during


@pytest.mark.parametrize("how", [_cancel_grpc_after_3, _disconnect_http_after_3],
                         ids=["grpc-cancel", "http-disconnect"])
def test_cancelled_stream_frees_its_kv_blocks(triton_server, read_metrics, how):
    baseline = read_metrics()
    assert baseline["vllm:num_requests_running"] == 0
    max_tokens = 400
    during = how(triton_server, read_metrics, "Tell me a very long story about a dragon.",
                 {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    assert during["vllm:num_requests_running"] == 1
    assert during["vllm:kv_cache_usage_perc"] > baseline["vllm:kv_cache_usage_perc"]
    deadline = time.monotonic() + 30
    while True:
        after = read_metrics()
        if after["vllm:num_requests_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == baseline["vllm:kv_cache_usage_perc"]
    assert after["pagoda:kv_cache_num_free_blocks"] == baseline["pagoda:kv_cache_num_free_blocks"]
    generated = after["vllm:generation_tokens_total"] - baseline["vllm:generation_tokens_total"]
    assert 3 <= generated < max_tokens, "the request was aborted, not run to max_tokens"


GOOD = {"text_input": "Hello", "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 2})}
BAD_BODIES = [
    ({"sampling_parameters": "{}"}, "text_input: required input is missing"),
    ({"text_input": ""}, "text_input: must not be empty"),
    ({"text_input": "Hi", "sampling_parameters": "{max_tokens: 3"}, "sampling_parameters: not valid JSON"),
    ({"text_input": "Hi", "sampling_parameters": "[]"}, "sampling_parameters: must be a JSON object"),
    ({"text_input": "Hi", "sampling_parameters": '{"temprature": 0}'}, "unknown sampling parameter(s): temprature"),
    ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": "many"}'}, "max_tokens: must be an integer"),
    ({"text_input": "Hi", "sampling_parameters": '{"top_p": 2}'}, "top_p: must be <= 1.0"),
    ({"text_input": "Hi", "sampling_parameters": '{"temperature": -0.5}'}, "temperature: must be >= 0.0"),
    ({"text_input": "Hi", "max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"text_input": "Hi", "bad_words": ["  "]}, "bad_words: every bad word must be a non-empty string"),
    ({"text_input": "Hi", "embedding_bias_words": ["a"], "embedding_bias_weights": [1.0, 2.0]},
     "embedding_bias_weights: 2 weights for 1 embedding_bias_words"),
    ({"text_input": "word " * (2 * MAX_MODEL_LEN)}, "exceeds max_model_len 1024"),
]


def test_every_bad_input_gets_a_clear_error_and_the_next_request_succeeds(triton_server):
    assert triton_server.options.max_model_len == MAX_MODEL_LEN
    for body, message in BAD_BODIES:
        status, result = http_post(triton_server, "/v2/models/pagoda/generate", body)
        assert status == 400, (body, result)
        assert message in result["error"], (message, result)
        status, result = http_post(triton_server, "/v2/models/pagoda/generate", GOOD)
        assert status == 200 and result["text_output"].startswith("Hello"), result
        assert is_ready(triton_server)


def test_grpc_error_names_the_problem(triton_server):
    from tritonclient.grpc import aio
    from tritonclient.utils import InferenceServerException

    async def run():
        client = aio.InferenceServerClient(triton_server.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="unknown sampling parameter"):
                async for _ in stream_generate(client, "Hi", {"temprature": 0}):
                    pass
            return [out async for out in stream_generate(client, "Hi", {"temperature": 0, "max_tokens": 2})]
        finally:
            await client.close()

    assert len(asyncio.run(run())) >= 1


def test_metrics_are_consistent_with_the_traffic(triton_server, read_metrics):
    before = read_metrics()
    prompt = "A prefix long enough to fill two whole KV cache blocks of sixteen tokens each, " * 2
    results = []
    for max_tokens in (3, 5, 5):
        status, result = http_post(triton_server, "/v2/models/pagoda/generate", {
            "text_input": prompt, "exclude_input_in_output": True, "return_num_input_tokens": True,
            "return_num_output_tokens": True, "sampling_parameters": json.dumps(
                {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})})
        assert status == 200, result
        results.append(result)
    after = read_metrics()

    def delta(name):
        return after[name] - before[name]

    num_requests = len(results)
    num_output = sum(r["num_output_tokens"] for r in results)
    assert num_output == 3 + 5 + 5
    assert delta("vllm:prompt_tokens_total") == sum(r["num_input_tokens"] for r in results)
    assert delta("vllm:generation_tokens_total") == num_output
    assert delta("vllm:request_success_total") == num_requests
    assert delta("vllm:time_to_first_token_seconds_count") == num_requests
    assert delta("vllm:e2e_request_latency_seconds_count") == num_requests
    assert delta("vllm:inter_token_latency_seconds_count") == num_output - num_requests
    assert 0 < delta("vllm:e2e_request_latency_seconds_sum")
    assert delta("vllm:time_to_first_token_seconds_sum") < delta("vllm:e2e_request_latency_seconds_sum")
    # The 2nd and 3rd requests reuse the 1st one's full prompt blocks.
    assert delta("vllm:prefix_cache_hits_total") >= 2 * 16
    assert delta("vllm:prefix_cache_hits_total") <= delta("vllm:prefix_cache_queries_total")
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["pagoda:engine_steps_total"] > before["pagoda:engine_steps_total"]
    assert after["vllm:num_preemptions_total"] == 0


def test_n_completions_and_logprobs_over_http(triton_server):
    status, result = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": "Pick a number:", "exclude_input_in_output": True, "return_logprobs": True,
        "return_cumulative_logprob": True, "return_num_output_tokens": True, "return_finish_reason": True,
        "sampling_parameters": json.dumps({"n": 2, "temperature": 0.8, "seed": 1, "max_tokens": 3,
                                           "ignore_eos": True, "logprobs": 1})})
    assert status == 200, result
    assert len(result["text_output"]) == 2 and result["num_output_tokens"] == [3, 3]
    assert result["finish_reason"] == ["length", "length"]
    for logprobs_json, text, cumulative in zip(result["logprobs"], result["text_output"], result["cumulative_logprob"]):
        logprobs = json.loads(logprobs_json)  # the vLLM backend's shape: {"<id>": {logprob, rank, decoded_token}}
        assert len(logprobs) == 3 and all(1 <= len(step) <= 2 for step in logprobs)
        # The sampled token is the entry whose text continues the output.
        sampled, rest = [], text
        for step in logprobs:
            entry = next(e for e in sorted(step.values(), key=lambda e: -len(e["decoded_token"]))
                         if rest.startswith(e["decoded_token"]))
            sampled.append(entry["logprob"])
            rest = rest[len(entry["decoded_token"]):]
        assert rest == ""
        assert sum(sampled) == pytest.approx(cumulative, abs=1e-4)


@pytest.fixture(scope="module")
def lora_texts(smollm2_lora):
    """(prompt, greedy text with the ``smollm2_lora`` adapter, base text) from the offline engine."""
    prompt, params = "The capital of France is", SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = LLM(max_model_len=MAX_MODEL_LEN, enable_lora=True, lora_modules={"sql": smollm2_lora})
    offline_lora, offline_base = (o.outputs[0].text for o in
                                  llm.generate([prompt, prompt], params, lora_name=["sql", None]))
    assert offline_lora != offline_base
    return prompt, offline_lora, offline_base


def test_lora_adapter_by_name_matches_offline_and_unknown_is_400(triton_server, lora_texts):
    """``lora_name`` (the vLLM backend's input, here inside sampling_parameters and as the
    input tensor's JSON field) selects the served adapter; the text equals the offline
    engine's with the same adapter and differs from the base model's; an unknown adapter is
    a 400 naming the loaded ones, and the server keeps serving."""
    prompt, offline_lora, _ = lora_texts
    sampling = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": prompt, "sampling_parameters": sampling, "lora_name": "sql"})
    assert status == 200, body
    assert body["text_output"].endswith(offline_lora)
    in_json = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS, "lora_name": "sql"})
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": prompt, "sampling_parameters": in_json})
    assert status == 200 and body["text_output"].endswith(offline_lora)
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": prompt, "sampling_parameters": sampling, "lora_name": "nope"})
    assert status == 400 and "unknown adapter 'nope'" in body["error"] and "sql" in body["error"], body


def grpc_control(server, action, name=None, path=None):
    """One LoRA control request on a tritonclient gRPC stream: (document, error text)."""
    import queue

    import tritonclient.grpc as grpcclient

    from pagoda.serving.launch.lora_cli import lora_control_inputs

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("pagoda", lora_control_inputs(action, name, path), request_id="control")
        result, error = results.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    if error is not None:
        return None, str(error)
    assert result.get_response().parameters["triton_final_response"].bool_param
    return json.loads(result.as_numpy("text_output")[0]), None


def test_lora_adapter_loaded_at_run_time_serves_then_unloads(triton_server, smollm2_lora, lora_texts, capsys):
    """A control request (HTTP generate, tritonclient gRPC, ``pagoda lora``) loads a PEFT
    folder under a new name while the server runs; generation with it equals the offline
    engine's with that adapter and shows in vllm:lora_requests_info; bad control requests
    are 400s naming the problem; after the unload the name is an unknown adapter, and the
    server stays ready throughout."""
    from pagoda.serving.launch.lora_cli import LoRAControlError, lora_control, main as lora_main

    prompt, offline_lora, _ = lora_texts
    url = f"http://{triton_server.http_url}"
    assert lora_control(url, "load", "rt", smollm2_lora) == {
        "action": "load", "lora_name": "rt", "lora_path": smollm2_lora, "loaded": ["rt", "sql"]}
    document, error = grpc_control(triton_server, "list")
    assert error is None and document == {"action": "list", "loaded": ["rt", "sql"], "allow_runtime_lora": True,
                                          "paths": {"rt": smollm2_lora, "sql": smollm2_lora}}
    sampling = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": prompt, "sampling_parameters": sampling, "lora_name": "rt"})
    assert status == 200 and body["text_output"].endswith(offline_lora), body
    metrics = urllib.request.urlopen(triton_server.metrics_url, timeout=5).read().decode()
    assert any(line.startswith("vllm:lora_requests_info") and 'running_lora_adapters="rt"' in line
               for line in metrics.splitlines()), "the runtime-loaded adapter is missing from the LoRA metric"
    for body, message in [
        ({"lora_action": "load", "lora_name": "rt", "lora_path": smollm2_lora},
         "an adapter named 'rt' is already loaded"),
        ({"lora_action": "load", "lora_name": "bad", "lora_path": "/nonexistent/adapter"}, "no PEFT adapter"),
        ({"lora_action": "load", "lora_name": "bad"}, "lora_path: required by lora_action 'load'"),
        ({"lora_action": "reload", "lora_name": "rt"}, "lora_action: must be one of load, unload, list"),
        ({"lora_action": "list", "text_input": "Hi"}, "cannot be combined with generation inputs (text_input)"),
        ({"lora_action": "unload", "lora_name": "nope"}, "unknown adapter 'nope'"),
        ({"stream": False}, "text_input: required input is missing"),
    ]:
        status, answer = http_post(triton_server, "/v2/models/pagoda/generate", body)
        assert status == 400 and message in answer["error"], (body, answer)
    document, error = grpc_control(triton_server, "unload", "rt")
    assert error is None and document == {"action": "unload", "lora_name": "rt", "lora_path": smollm2_lora,
                                          "loaded": ["sql"]}
    status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                             {"text_input": prompt, "sampling_parameters": sampling, "lora_name": "rt"})
    assert status == 400 and "unknown adapter 'rt'" in body["error"], body
    with pytest.raises(LoRAControlError, match="400.*unknown adapter 'rt'"):
        lora_control(url, "unload", "rt")
    assert lora_main(["list", "--url", url]) == 0
    assert capsys.readouterr().out == f"sql\t{smollm2_lora}\n"
    assert lora_main(["unload", "rt", "--url", url]) == 1
    assert "unknown adapter 'rt'" in capsys.readouterr().err
    assert is_ready(triton_server)


def test_structured_output_and_a_bad_grammar_gets_400(triton_server):
    import jsonschema

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["color", "n"], "additionalProperties": False}
    guided = {"text_input": "Reply in JSON: a color and a digit.", "exclude_input_in_output": True,
              "return_finish_reason": True,
              "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 40,
                                                 "guided_decoding": {"json": schema}})}
    status, result = http_post(triton_server, "/v2/models/pagoda/generate", guided)
    assert status == 200 and result["finish_reason"] == "stop", result
    jsonschema.validate(json.loads(result["text_output"]), schema)
    for spec, message in [({"regex": "a(b"}, "guided_decoding.regex: cannot be compiled"),  # fails on the pool
                          ({"regex": "a", "choice": ["a"]}, "give exactly one of"),  # fails at parsing
                          ({"regex": "(a{300}){300}"}, "over guided_max_length_bound=65536")]:  # never compiled
        status, result = http_post(triton_server, "/v2/models/pagoda/generate", {
            "text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": 4, "guided_decoding": spec})})
        assert status == 400 and message in result["error"], result
    status, result = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": "Pick one:", "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": 5, "guided_decoding": {"choice": ["left", "right"]}})})
    assert status == 200 and result["text_output"] in ("left", "right"), result
    assert is_ready(triton_server)
