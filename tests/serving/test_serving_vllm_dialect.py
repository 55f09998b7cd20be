"""Triton's vLLM backend's clients, unchanged, against pagoda on a real tritonserver.

Written from the backend's documented behaviour and its client tests
(ci/L0_additional_outputs_vllm, ci/L0_backend_vllm, ci/L0_check_health_vllm): sampling
parameters as request parameters (gRPC ``parameters=``, HTTP ``"parameters"``, string
values), ``structured_outputs`` as a JSON string, the ``logprobs`` JSON shape (``null``
when not asked), ``"None"`` as the finish reason of unfinished streaming responses, the
``vllm:`` request histograms, and read-only repository calls. pagoda's own rule on top:
a request parameter it does not understand is a 400 naming it, on both protocols.

The session's server (tests/serving/conftest.py) runs with ``output_dialect=vllm``.
"""

from __future__ import annotations

import base64
import io
import json
import queue

import numpy as np
import pytest

from tests.engine.vision_reference import random_image
from tests.serving.test_serving_triton_server import http_post

pytestmark = pytest.mark.server

PROMPT = "In this example,"


def grpc_stream(server, prompt, *, sampling=None, parameters=None, priority=0, timeout=None, images=(), **flags):
    """One request on a tritonclient gRPC stream, as the backend's tests send it (``images``:
    the ``image`` input's elements, base64 text, as the backend's clients send them).

    Returns:
        (list of result objects, error text or None).
    """
    import tritonclient.grpc as grpcclient

    def tensor(name, value, datatype):
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else bool))
        return t

    inputs = [tensor("text_input", prompt.encode(), "BYTES")]
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", json.dumps(sampling).encode(), "BYTES"))
    inputs += [tensor(name, value, "BOOL") for name, value in flags.items()]
    if images:
        image = grpcclient.InferInput("image", [len(images)], "BYTES")
        image.set_data_from_numpy(np.array(list(images), dtype=np.object_))
        inputs.append(image)
    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("pagoda", inputs, parameters=parameters, enable_empty_final_response=True,
                                  priority=priority, timeout=timeout)
        out = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                return out, str(error)
            response = result.get_response()
            if response.outputs:
                out.append(result)
            if response.parameters["triton_final_response"].bool_param:
                return out, None
    finally:
        client.stop_stream()
        client.close()


def texts(results, name="text_output"):
    return [r.as_numpy(name)[0].decode() for r in results]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_request_parameters_are_sampling_parameters_on_grpc_and_http(triton_server):
    """The issue's case: {"temperature": "0", "max_tokens": "3"} as gRPC parameters gives the
    greedy 3-token answer, the same as the sampling_parameters tensor; over HTTP, the body's
    "parameters" object is read the same way."""
    as_parameters, error = grpc_stream(triton_server, PROMPT, parameters={"temperature": "0", "max_tokens": "3"},
                                       stream=False, exclude_input_in_output=True, return_num_output_tokens=True)
    assert error is None
    as_tensor, error = grpc_stream(triton_server, PROMPT, sampling={"temperature": 0, "max_tokens": 3},
                                   stream=False, exclude_input_in_output=True)
    assert error is None
    assert texts(as_parameters) == texts(as_tensor)
    assert as_parameters[-1].as_numpy("num_output_tokens").tolist() == [3]
    # Both ways at once with the same values (how the backend's create_vllm_request sends).
    both, error = grpc_stream(triton_server, PROMPT, sampling={"temperature": "0", "max_tokens": "3"},
                              parameters={"temperature": "0", "max_tokens": "3"}, stream=False,
                              exclude_input_in_output=True)
    assert error is None and texts(both) == texts(as_tensor)
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": PROMPT, "exclude_input_in_output": True, "return_num_output_tokens": True,
        "parameters": {"n": "2", "ignore_eos": "true", "max_tokens": 4, "seed": 3, "min_p": "0"}})
    assert status == 200, body
    assert body["num_output_tokens"] == [4, 4]
    # The vLLM backend README's first curl, as it is.
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": "What is Triton Inference Server?", "parameters": {"stream": False, "temperature": 0}})
    assert status == 200 and body["text_output"].startswith("What is Triton Inference Server?"), body


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unknown_request_parameter_is_a_400_naming_it(triton_server, protocol):
    """No silent drops: a key pagoda does not understand is refused, naming the key."""
    if protocol == "grpc":
        # tritonserver's own request fields (priority, timeout, the empty-final-response flag)
        # travel as gRPC parameters too: only the user's unknown key is named.
        _, error = grpc_stream(triton_server, PROMPT, parameters={"temprature": "0", "max_tokens": "3"},
                               priority=1, timeout=60_000_000)
        assert error is not None and "unknown request parameter(s): temprature;" in error, error
        _, error = grpc_stream(triton_server, PROMPT, sampling={"max_tokens": 3}, parameters={"max_tokens": "4"})
        assert error is not None and "max_tokens: given as a request parameter" in error, error
        return
    for body in ({"text_input": PROMPT, "parameters": {"num_return_sequences": 2}},  # an HTTP body's parameters
                 {"text_input": PROMPT, "return_log_probs": True}):  # a top-level key that is no input
        status, answer = http_post(triton_server, "/v2/models/pagoda/generate", body)
        key = "num_return_sequences" if "parameters" in body else "return_log_probs"
        assert status == 400 and f"unknown request parameter(s): {key};" in answer["error"], answer
    # The generate extension's "id" is tolerated (tritonserver hands it on as a parameter).
    status, answer = http_post(triton_server, "/v2/models/pagoda/generate",
                               {"text_input": PROMPT, "id": "req-1", "parameters": {"max_tokens": 2}})
    assert status == 200, answer


def test_structured_outputs_as_the_backend_and_vllm_send_it(triton_server):
    choices = ["Positive", "Negative"]
    sampling = {"temperature": "0", "max_tokens": "8", "structured_outputs": json.dumps({"choice": choices})}
    results, error = grpc_stream(triton_server, "The movie was great. Sentiment:", sampling=sampling,
                                 parameters=sampling, stream=False, exclude_input_in_output=True)
    assert error is None and texts(results)[0] in choices
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": "A number in JSON:", "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 20,
                                           "structured_outputs": {"json": schema, "disable_fallback": True}})})
    assert status == 200 and set(json.loads(body["text_output"])) == {"n"}, body
    for spec, message in [({"structural_tag": "{}"}, "structured_outputs.structural_tag: not supported"),
                          ({"regex": "a", "choice": ["a"]}, "structured_outputs: give exactly one of"),
                          ({"grammer": "root ::= 'a'"}, "structured_outputs.grammer: unknown key")]:
        status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
            "text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": 2, "structured_outputs": spec})})
        assert status == 400 and message in body["error"], body


def test_vllm_sampling_keys_are_applied_or_refused_naming_them(triton_server, tokenizer):
    (blue,) = tokenizer.encode(" blue")
    for extra in ({"allowed_token_ids": [blue]}, {"logit_bias": {str(blue): 100}}):
        status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
            "text_input": PROMPT, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"temperature": 0.7, "seed": 1, "max_tokens": 3, "ignore_eos": True,
                                               **extra})})
        assert status == 200 and body["text_output"] == " blue" * 3, (extra, body)
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": "one two three four five six", "return_num_input_tokens": True,
        "parameters": {"truncate_prompt_tokens": "2", "max_tokens": 1, "spaces_between_special_tokens": "true"}})
    assert status == 200 and body["num_input_tokens"] == 2, body
    for sampling, message in [({"prompt_logprobs": 21}, "prompt_logprobs: must be <= 20"),
                              ({"allowed_token_ids": [10**7]}, "allowed_token_ids: token id 10000000 is not in"),
                              ({"logit_bias": {"5": 101}}, "logit_bias: must be <= 100"),
                              ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must be >= 1"),
                              ({"skip_special_tokens": False, "spaces_between_special_tokens": True},
                               "spaces_between_special_tokens: pagoda joins special tokens")]:
        status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                                 {"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": 2, **sampling})})
        assert status == 400 and message in body["error"], body


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("logprobs", [None, 0, 2])
def test_logprobs_and_finish_reason_as_the_vllm_backend_sends_them(triton_server, stream, logprobs):
    """The checks of the backend's additional-outputs test, on pagoda."""
    sampling = {"temperature": "0", "top_p": "1", "max_tokens": 6, "ignore_eos": True}
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    results, error = grpc_stream(triton_server, PROMPT, sampling=sampling, stream=stream, return_finish_reason=True,
                                 return_logprobs=True, return_num_output_tokens=True)
    assert error is None and results
    reasons = texts(results, "finish_reason")
    assert reasons[:-1] == ["None"] * (len(results) - 1) and reasons[-1] == "length"
    for result in results:
        step = json.loads(result.as_numpy("logprobs")[0])
        if logprobs is None:
            assert step is None
            continue
        assert len(step) == result.as_numpy("num_output_tokens")[0]
        decoded = ""
        for token in step:
            assert 1 <= len(token) <= logprobs + 1
            assert all(set(entry) == {"logprob", "rank", "decoded_token"} and isinstance(entry["rank"], int)
                       for entry in token.values())
            (best,) = [entry for entry in token.values() if entry["rank"] == 1]
            decoded += best["decoded_token"]
        text = result.as_numpy("text_output")[0].decode()
        assert (decoded if stream else PROMPT + decoded) == text


def test_output_dialect_per_request_gives_pagodas_shape(triton_server):
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": PROMPT, "return_logprobs": True, "stream": False,
        "sampling_parameters": json.dumps({"max_tokens": 2, "logprobs": 1, "output_dialect": "pagoda"})})
    assert status == 200 and set(json.loads(body["logprobs"])[0]) == {"token_id", "logprob", "rank", "top_logprobs"}
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": PROMPT, "sampling_parameters": json.dumps({"output_dialect": "openai"})})
    assert status == 400 and "output_dialect: must be one of vllm, pagoda" in body["error"]


def test_vllm_request_histograms_under_both_latency_names(triton_server, read_metrics):
    before = read_metrics()
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": PROMPT, "return_num_input_tokens": True, "sampling_parameters": json.dumps(
            {"n": 2, "max_tokens": 3, "ignore_eos": True, "seed": 0})})
    assert status == 200, body
    after = read_metrics()

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:request_prompt_tokens_count") == 1
    assert delta("vllm:request_prompt_tokens_sum") == body["num_input_tokens"]
    assert delta("vllm:request_generation_tokens_sum") == 6
    assert delta("vllm:request_params_n_sum") == 2 and delta("vllm:request_params_n_count") == 1
    # The old name holds the same observations as the new one (the request's gaps between tokens).
    assert delta("vllm:time_per_output_token_seconds_count") == delta("vllm:inter_token_latency_seconds_count") >= 4
    assert delta("vllm:time_per_output_token_seconds_sum") == pytest.approx(
        delta("vllm:inter_token_latency_seconds_sum"))


def test_an_image_for_the_text_only_model_is_a_400_and_the_server_keeps_serving(triton_server):
    """The session's model (SmolLM2) takes text only: an ``image`` input is refused naming it;
    so is an element that is not base64; the next request is served."""
    png = io.BytesIO()
    random_image(0).save(png, format="PNG")
    _, error = grpc_stream(triton_server, PROMPT, sampling={"max_tokens": 2}, images=[base64.b64encode(png.getvalue())])
    assert error is not None and "multi_modal_data: this model takes text only" in error
    _, error = grpc_stream(triton_server, PROMPT, sampling={"max_tokens": 2}, images=[b"not base64!"])
    assert error is not None and "image[0]: not valid base64" in error
    results, error = grpc_stream(triton_server, PROMPT, sampling={"max_tokens": 2, "temperature": 0})
    assert error is None and texts(results)


def test_read_only_repository_calls(triton_server):
    """Any client may read: the repository index (the vLLM backend's health check), readiness,
    metadata and config, on HTTP and gRPC. No client may load or unload: tritonserver runs
    without model control and refuses both itself (docs/serving.md says why)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from pagoda.serving.trtllm_front import FRONT_MODELS

    refusal = "explicit model load / unload is not allowed if polling is enabled"  # tritonserver 2.51's words
    for client in (httpclient.InferenceServerClient(triton_server.http_url),
                   grpcclient.InferenceServerClient(triton_server.grpc_url)):
        if isinstance(client, httpclient.InferenceServerClient):
            models = client.get_model_repository_index()
        else:
            models = client.get_model_repository_index(as_json=True)["models"]
        assert {m["name"]: m["state"] for m in models} == dict.fromkeys(["pagoda", *FRONT_MODELS], "READY")
        assert client.is_server_ready() and client.is_model_ready("pagoda")
        metadata = client.get_model_metadata("pagoda")
        assert (metadata["name"] if isinstance(metadata, dict) else metadata.name) == "pagoda"
        config = client.get_model_config("pagoda")
        assert (config["name"] if isinstance(config, dict) else config.config.name) == "pagoda"
        for call in (lambda: client.load_model("pagoda"), lambda: client.unload_model("pagoda"),
                     lambda: client.unload_model("ensemble")):
            with pytest.raises(InferenceServerException, match=refusal):
                call()
        client.close()
    assert httpclient.InferenceServerClient(triton_server.http_url).is_model_ready("pagoda")
    assert httpclient.InferenceServerClient(triton_server.http_url).is_model_ready("ensemble")
