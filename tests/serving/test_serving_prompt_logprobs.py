"""Prompt log-probabilities and token-id prompts through a real tritonserver (the session's
default-model server, ``output_dialect=vllm``).

``prompt_logprobs`` in ``sampling_parameters`` (vLLM's ``SamplingParams`` key) is applied:
the ``prompt_logprobs`` output holds vLLM's ``PromptLogprobs`` as JSON (``null`` first, then
``{"<token id>": {"logprob", "rank", "decoded_token"}}``), once per request, streaming or
not. ``input_ids`` (INT32, TensorRT-LLM's name) is the prompt as token ids. Values are
checked against a float64 forward of the default model within the derived bound
(``tests/engine/test_prompt_logprobs.py``).
"""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest

from tests.engine.test_prompt_logprobs import Float64Reference
from tests.serving.test_serving_triton_server import http_post

pytestmark = pytest.mark.server

PROMPT = "Question: What is the capital of France?\nAnswer: Paris"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return Float64Reference(smollm2_path)


def _grpc_token_prompt(server, token_ids, sampling):
    """One streamed gRPC request with ``input_ids``; its responses' outputs as dicts."""
    import tritonclient.grpc as grpcclient

    ids = grpcclient.InferInput("input_ids", [len(token_ids)], "INT32")
    ids.set_data_from_numpy(np.array(token_ids, dtype=np.int32))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    out = []
    try:
        client.async_stream_infer("pagoda", [ids, params], enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                out.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


def _check(entries, token_ids, reference, num_top):
    logprobs, scale = reference.logprobs(token_ids, 49152)
    bound = reference.bound(len(token_ids), scale, 49152)
    assert len(entries) == len(token_ids) and entries[0] is None
    for q, entry in enumerate(entries[1:], start=1):
        own = entry[str(token_ids[q])]
        assert abs(own["logprob"] - logprobs[q - 1][token_ids[q]].item()) <= bound
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert len(entry) in (num_top, num_top + 1)  # the token may be among the top alternatives
        top = sorted((v["rank"], k) for k, v in entry.items() if v["rank"] <= num_top)[:num_top]
        assert [rank for rank, _ in top] == list(range(1, num_top + 1))


def test_prompt_logprobs_through_http_and_token_ids_through_grpc(triton_server, tokenizer, reference):
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": PROMPT, "return_num_input_tokens": True,
        "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 2, "prompt_logprobs": 2})})
    assert status == 200, body
    token_ids = tokenizer.encode(PROMPT)
    assert body["num_input_tokens"] == len(token_ids)
    by_text = json.loads(body["prompt_logprobs"])
    _check(by_text, token_ids, reference, 2)

    responses = _grpc_token_prompt(triton_server, token_ids, {"temperature": 0, "max_tokens": 2,
                                                              "prompt_logprobs": 2})
    sent = [json.loads(r["prompt_logprobs"][0]) for r in responses if "prompt_logprobs" in r]
    assert len(sent) == 1  # once, with the first tokens
    _check(sent[0], token_ids, reference, 2)
    text = "".join(r["text_output"][0].decode() for r in responses if "text_output" in r)
    assert body["text_output"] == PROMPT + text  # the same greedy continuation for either prompt form


def test_no_prompt_logprobs_output_unless_asked(triton_server):
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 1})})
    assert status == 200 and "prompt_logprobs" not in body


def test_bad_token_prompts_are_refused_naming_the_input(triton_server):
    status, body = http_post(triton_server, "/v2/models/pagoda/generate", {
        "text_input": PROMPT, "input_ids": [1, 2], "sampling_parameters": json.dumps({"max_tokens": 1})})
    assert status == 400 and "input_ids: give the prompt as text_input or as input_ids" in body["error"], body
