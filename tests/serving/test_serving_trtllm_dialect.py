"""TensorRT-LLM's Triton clients, unchanged, against pagoda on a real tritonserver.

Written from TensorRT-LLM's ``ensemble`` / ``tensorrt_llm_bls`` interface and its client
scripts (``inflight_batcher_llm/client/end_to_end_grpc_client.py``): ``[B, 1]`` tensors,
unary ``infer()`` on the non-decoupled model over HTTP and gRPC, streaming on the decoupled
one with ``batch_index`` / ``sequence_index``, and every input the interface names either
applied or refused with an error naming it. The session's server (tests/serving/conftest.py)
serves ``ensemble`` non-decoupled and ``tensorrt_llm_bls`` decoupled, both in front of the
one ``pagoda`` model, whose greedy answer is the reference.
"""

from __future__ import annotations

import json
import queue
import re
from pathlib import Path

import numpy as np
import pytest

from tests.serving.test_serving_triton_server import http_post

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"
DTYPES = {np.int32: "INT32", np.uint64: "UINT64", np.float32: "FP32", bool: "BOOL", np.object_: "BYTES"}


def batch(values, dtype):
    """A TensorRT-LLM client's ``[B, 1]`` (or ``[B, W]`` for lists) tensor."""
    rows = [v if isinstance(v, list) else [v] for v in values]
    if dtype is np.object_:
        rows = [[x.encode() if isinstance(x, str) else x for x in row] for row in rows]
    return np.array(rows, dtype=dtype)


def trt_inputs(prompts, max_tokens=8, **extra):
    """Inputs as end_to_end_grpc_client.py prepares them (greedy: temperature 0)."""
    inputs = {"text_input": batch(prompts, np.object_), "max_tokens": batch([max_tokens] * len(prompts), np.int32),
              "temperature": batch([0.0] * len(prompts), np.float32)}
    for name, (value, dtype) in extra.items():
        inputs[name] = batch([value] * len(prompts), dtype)
    return inputs


def to_tensors(client_module, inputs):
    tensors = []
    for name, array in inputs.items():
        dtype = DTYPES[bool if array.dtype == bool else array.dtype.type]
        tensor = client_module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def grpc_infer(server, model, inputs, outputs=("text_output",)):
    """Unary ``client.infer()`` over gRPC; returns the result or raises InferenceServerException."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return client.infer(model, to_tensors(grpcclient, inputs), client_timeout=300,  # a hang fails, not the suite
                            outputs=[grpcclient.InferRequestedOutput(n) for n in outputs])
    finally:
        client.close()


def http_infer(server, model, inputs, outputs=("text_output",)):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.infer(model, to_tensors(httpclient, inputs),
                            outputs=[httpclient.InferRequestedOutput(n) for n in outputs])
    finally:
        client.close()


def grpc_stream(server, model, inputs, outputs=("text_output", "batch_index", "sequence_index")):
    """One request on a gRPC stream, as end_to_end_grpc_client.py sends it: (results, errors)."""
    import tritonclient.grpc as grpcclient

    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, to_tensors(grpcclient, inputs),
                                  outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
                                  enable_empty_final_response=True)
        out, errors = [], []
        while True:
            try:  # an error sent with the final flag is the request's last word
                result, error = results.get(timeout=3 if errors else 120)
            except queue.Empty:
                return out, errors
            if error is not None:
                errors.append(str(error))
                continue
            response = result.get_response()
            if response.outputs:
                out.append(result)
            if response.parameters["triton_final_response"].bool_param:
                return out, errors
    finally:
        client.stop_stream()
        client.close()


def pagoda_text(server, prompt, max_tokens=8, **sampling):
    """The reference: pagoda's own model, greedy, prompt excluded."""
    status, body = http_post(server, "/v2/models/pagoda/generate",
                             {"text_input": prompt, "exclude_input_in_output": True,
                              "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": max_tokens,
                                                                 **sampling})})
    assert status == 200, body
    return body["text_output"]


def test_unary_infer_with_batch_dimension_on_grpc_and_http(triton_server):
    """The issue's items 1-2: ``[1, 1]`` tensors and unary ``infer()`` on ``ensemble`` (TensorRT-LLM's
    decoupled_mode false) over both protocols; the prompt is in front, as TensorRT-LLM sends it
    unless exclude_input_in_output."""
    expected = pagoda_text(triton_server, PROMPT)
    for infer in (grpc_infer, http_infer):
        result = infer(triton_server, "ensemble", trt_inputs([PROMPT]))
        assert result.as_numpy("text_output").shape == (1,)  # flat, as TensorRT-LLM's postprocessing sends it
        assert result.as_numpy("text_output")[0].decode() == PROMPT + expected
    result = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], exclude_input_in_output=(True, bool)))
    assert result.as_numpy("text_output")[0].decode() == expected


def test_batch_of_two_is_two_requests_in_batch_order(triton_server):
    """B > 1 is served as B requests of the one engine: row b is prompt b's own answer."""
    prompts = [PROMPT, "Q: What is 2 + 2?\nA:"]
    expected = [pagoda_text(triton_server, p) for p in prompts]
    inputs = trt_inputs(prompts, exclude_input_in_output=(True, bool))
    result = grpc_infer(triton_server, "ensemble", inputs,
                        outputs=("text_output", "batch_index"))
    assert [text.decode() for text in result.as_numpy("text_output")] == expected
    assert result.as_numpy("batch_index").tolist() == [[0], [1]]
    # The decoupled model answers each item separately, labelled with its batch_index.
    results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", inputs)
    assert not errors
    by_item = {int(r.as_numpy("batch_index")[0][0]): r.as_numpy("text_output")[0].decode() for r in results}
    assert by_item == {0: expected[0], 1: expected[1]}


def test_decoupled_streaming_deltas_and_sequences(triton_server):
    """``tensorrt_llm_bls`` (decoupled): streamed deltas join into the unary answer;
    ``num_return_sequences`` 2 streams both sequences, each response naming its ``sequence_index``."""
    expected = pagoda_text(triton_server, PROMPT)
    inputs = trt_inputs([PROMPT], stream=(True, bool), exclude_input_in_output=(True, bool))
    results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", inputs)
    assert not errors and len(results) > 1
    assert "".join(r.as_numpy("text_output")[0].decode() for r in results) == expected
    inputs = trt_inputs([PROMPT], stream=(True, bool), num_return_sequences=(2, np.int32))
    inputs["temperature"] = batch([1.0], np.float32)
    results, errors = grpc_stream(triton_server, "tensorrt_llm_bls", inputs)
    assert not errors
    texts = {0: "", 1: ""}
    for r in results:
        texts[int(r.as_numpy("sequence_index")[0][0])] += r.as_numpy("text_output")[0].decode()
    assert texts[0] and texts[1]


def test_unary_requests_do_not_wait_for_each_other(triton_server):
    """The non-decoupled front answers from each request's own thread, so a short request
    sent while a long one runs comes back first (no head-of-line blocking in ``execute``)."""
    import threading
    import time

    finished = {}

    def run(name, tokens):
        grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=tokens, min_length=(tokens, np.int32)))
        finished[name] = time.monotonic()

    long = threading.Thread(target=run, args=("long", 96))
    long.start()
    time.sleep(0.3)
    run("short", 1)
    long.join()
    assert finished["short"] < finished["long"]


def test_streaming_needs_the_decoupled_model(triton_server):
    """As TensorRT-LLM with decoupled_mode false: ``stream`` true on ``ensemble`` is a 400 naming it."""
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="stream: streaming needs the decoupled model"):
        grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], stream=(True, bool)))


def test_min_length_and_min_tokens_hold_generation_past_end_id(triton_server):
    """genai-perf's ``--output-tokens-mean-deterministic`` case: ``min_length`` (bls) / ``min_tokens``
    (ensemble) keep generating through ``end_id`` until that many tokens, then ``end_id`` stops it."""
    from transformers import AutoTokenizer

    first = pagoda_text(triton_server, PROMPT, max_tokens=1)
    outputs = ("text_output", "num_output_tokens")
    end_id = AutoTokenizer.from_pretrained(triton_server.options.model).encode(first)[0]
    stopped = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], end_id=(end_id, np.int32),
                                                               return_num_output_tokens=(True, bool)), outputs)
    assert stopped.as_numpy("num_output_tokens")[0][0] <= 1
    for name in ("min_tokens", "min_length"):
        held = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], max_tokens=6, **{name: (6, np.int32)},
                                                                end_id=(end_id, np.int32),
                                                                return_num_output_tokens=(True, bool)), outputs)
        assert held.as_numpy("num_output_tokens")[0][0] == 6, name


def test_log_probs_sequences_and_perf_metrics(triton_server):
    """``return_log_probs`` -> ``cum_log_probs`` (the sum of ``output_log_probs``); unary
    ``num_return_sequences`` 2 -> 2 texts; ``return_perf_metrics`` -> KV-cache blocks,
    with the repeated prompt's blocks reused from the prefix cache."""
    names = ("text_output", "cum_log_probs", "output_log_probs")
    result = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], return_log_probs=(True, bool)), names)
    per_token = result.as_numpy("output_log_probs")
    assert per_token.shape == (1, 1, 8) and (per_token <= 0).all()
    assert result.as_numpy("cum_log_probs")[0][0] == pytest.approx(per_token.sum(), abs=1e-3)
    # asked for as outputs without return_log_probs: present (zeros: none were computed), as clients read them
    result = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT]), names)
    assert result.as_numpy("output_log_probs").shape == (1, 1, 8) and not result.as_numpy("output_log_probs").any()
    assert result.as_numpy("cum_log_probs").tolist() == [[0.0]]
    result = grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], num_return_sequences=(2, np.int32)),
                        ("text_output", "sequence_index"))
    assert result.as_numpy("text_output").shape == (2,) and result.as_numpy("sequence_index").tolist() == [[0, 1]]
    long_prompt = "Tell me a story about a lighthouse keeper. " * 6
    perf = ("kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "kv_cache_alloc_new_blocks", "kv_cache_hit_rate",
            "arrival_time_ns", "last_token_time_ns")
    for _ in range(2):
        result = grpc_infer(triton_server, "ensemble", trt_inputs([long_prompt], return_perf_metrics=(True, bool)),
                            perf)
    reused = result.as_numpy("kv_cache_reused_blocks")[0][0]
    total = result.as_numpy("kv_cache_alloc_total_blocks")[0][0]
    assert 0 < reused < total and result.as_numpy("kv_cache_alloc_new_blocks")[0][0] == total - reused
    assert 0 < result.as_numpy("kv_cache_hit_rate")[0][0] <= 1
    assert result.as_numpy("last_token_time_ns")[0][0] >= result.as_numpy("arrival_time_ns")[0][0]


def test_guided_decoding_and_pad_id(triton_server):
    """``guided_decoding_guide_type`` / ``guided_decoding_guide`` go through pagoda's grammar
    engine (TensorRT-LLM's guide types); ``pad_id`` is accepted."""
    inputs = trt_inputs([PROMPT], max_tokens=12, guided_decoding_guide_type=("regex", np.object_),
                        guided_decoding_guide=("[0-9]{3}-[a-z]{2}", np.object_), pad_id=(0, np.int32),
                        exclude_input_in_output=(True, bool))
    text = grpc_infer(triton_server, "ensemble", inputs).as_numpy("text_output")[0].decode()
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                         "additionalProperties": False})
    inputs = trt_inputs([PROMPT], max_tokens=40, guided_decoding_guide_type=("json_schema", np.object_),
                        guided_decoding_guide=(schema, np.object_), exclude_input_in_output=(True, bool))
    text = grpc_infer(triton_server, "ensemble", inputs).as_numpy("text_output")[0].decode()
    assert isinstance(json.loads(text)["a"], bool)


def test_bad_words_and_embedding_bias(triton_server):
    """``bad_words`` never appear (a banned-sequence logits processor); ``embedding_bias_words`` /
    ``embedding_bias_weights`` are the ``logit_bias`` of each word's tokens, as TensorRT-LLM's
    preprocessing builds its embedding bias."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(triton_server.options.model)
    expected = pagoda_text(triton_server, PROMPT)
    word = expected.split()[0].strip(".,")
    inputs = trt_inputs([PROMPT], bad_words=([word, ""], np.object_), exclude_input_in_output=(True, bool))
    banned = grpc_infer(triton_server, "ensemble", inputs).as_numpy("text_output")[0].decode()
    assert word in expected and word not in banned, (expected, banned)
    bias_tokens = tokenizer.encode("banana", add_special_tokens=False)
    inputs = trt_inputs([PROMPT], embedding_bias_words=(["banana"], np.object_),
                        embedding_bias_weights=([30.0], np.float32), exclude_input_in_output=(True, bool))
    biased = grpc_infer(triton_server, "ensemble", inputs).as_numpy("text_output")[0].decode()
    assert biased == pagoda_text(triton_server, PROMPT, logit_bias={str(t): 30.0 for t in bias_tokens})
    assert biased != expected


def test_lora_task_id_picks_the_adapter_loaded_under_that_number(triton_server, smollm2_lora):
    """TensorRT-LLM's ``lora_task_id`` names a cached adapter; pagoda's adapters have names, so task
    7 is the adapter loaded as "7" (here at run time, the session adapter ``sql``'s folder)."""
    from pagoda.serving.launch.lora_cli import lora_control

    url = f"http://{triton_server.http_url}"
    lora_control(url, "load", "7", smollm2_lora)
    try:
        inputs = trt_inputs([PROMPT], lora_task_id=(7, np.uint64), exclude_input_in_output=(True, bool))
        text = grpc_infer(triton_server, "ensemble", inputs).as_numpy("text_output")[0].decode()
        status, body = http_post(triton_server, "/v2/models/pagoda/generate",
                                 {"text_input": PROMPT, "exclude_input_in_output": True, "sampling_parameters":
                                  json.dumps({"temperature": 0, "max_tokens": 8, "lora_name": "sql"})})
        assert status == 200 and text == body["text_output"] != pagoda_text(triton_server, PROMPT)
    finally:
        lora_control(url, "unload", "7")


@pytest.mark.parametrize("name, value, dtype, message", [
    ("beam_width", 0, np.int32, "beam_width: must be an integer >= 1"),
    ("decoder_text_input", "x", np.object_, "decoder_text_input: not supported"),
    ("num_draft_tokens", 2, np.int32, "num_draft_tokens: not supported"),
    ("guided_decoding_guide_type", "structural_tag", np.object_, "guided_decoding_guide_type: must be one of"),
    ("lora_task_id", 987654, np.uint64, "987654"),
])
def test_inputs_pagoda_cannot_honour_are_refused_by_name(triton_server, name, value, dtype, message):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=re.escape(message)):
        grpc_infer(triton_server, "ensemble", trt_inputs([PROMPT], **{name: (value, dtype)}))


def test_http_generate_unknown_key_is_a_400_and_known_inputs_apply(triton_server):
    """Over HTTP an unknown ``generate`` key arrives as a request parameter: a 400 naming it,
    never ignored; a key that is an input of the interface (``num_return_sequences``) applies."""
    status, body = http_post(triton_server, "/v2/models/ensemble/generate",
                             {"text_input": PROMPT, "max_tokens": 4, "beam_search_fancy": 1})
    assert status == 400 and "beam_search_fancy" in body["error"]
    status, body = http_post(triton_server, "/v2/models/ensemble/generate",
                             {"text_input": PROMPT, "max_tokens": 4, "temperature": 0.0, "num_return_sequences": 2})
    assert status == 200, body
    assert len(body["text_output"]) == 2


@pytest.mark.parametrize("name", ["genai_perf_tensorrtllm_inputs.json", "genai_perf_tensorrtllm_streaming_inputs.json"])
def test_genai_perf_output_tokens_mean_deterministic(triton_server, read_metrics, name):
    """genai-perf 0.0.16 ``profile --endpoint-type kserve --backend tensorrtllm
    --output-tokens-mean 12 --output-tokens-mean-deterministic`` (``--streaming`` for the second
    file) sends perf_analyzer these inputs, committed as it wrote them; each entry, sent as
    perf_analyzer sends it (``[1, ...]`` tensors to the entry's model), answers exactly 12
    tokens, counted by the engine (``vllm:generation_tokens_total``; genai-perf re-tokenizes the
    text, which matches that count only when the sampled text round-trips through the
    tokenizer). ``min_length`` is what holds generation to the length (docs/benchmarks.md
    shows the run)."""
    entries = json.loads((Path(__file__).parent.parent / "data" / name).read_text())["data"]
    before = read_metrics()["vllm:generation_tokens_total"]
    assert all(entry["min_length"] == entry["max_tokens"] == [12] for entry in entries)
    for entry in entries:
        model = entry.pop("model")
        inputs = {key: np.array([value], dtype=np.object_ if isinstance(value[0], str) else
                                bool if isinstance(value[0], bool) else np.int32) for key, value in entry.items()}
        if model == "ensemble":
            text = grpc_infer(triton_server, model, inputs).as_numpy("text_output")[0].decode()
        else:
            results, errors = grpc_stream(triton_server, model, inputs)
            assert not errors and len(results) > 1
            text = "".join(r.as_numpy("text_output")[0].decode() for r in results)
        assert text
    assert read_metrics()["vllm:generation_tokens_total"] - before == 12 * len(entries)


# ------------------------------------------------------------------ the LLM-API dialect
def llmapi_inputs(prompt, **extra):
    """What a client of TensorRT-LLM's LLM-API ``tensorrt_llm`` model sends (no batch dimension)."""
    inputs = {"text_input": np.array([prompt.encode()], dtype=np.object_),
              "sampling_param_temperature": np.array([0.0], dtype=np.float32),
              "sampling_param_max_tokens": np.array([8], dtype=np.int32)}
    for name, (value, dtype) in extra.items():
        inputs[name] = np.array(value if isinstance(value, list) else [value], dtype=dtype)
    return inputs


def test_llmapi_streaming_text_is_cumulative_and_reasons_are_strings(triton_server):
    """``tensorrt_llm`` (decoupled here): ``streaming`` responses carry the text so far (the LLM
    API's ``CompletionOutput.text``), the last equal to the one-response answer; ``finish_reason``
    and ``stop_reason`` are ``str()`` of its values; the prompt is in front unless
    ``sampling_param_exclude_input_from_output``."""
    expected = pagoda_text(triton_server, PROMPT)
    outputs = ("text_output", "finish_reason", "stop_reason", "cumulative_logprob")
    flags = dict(return_finish_reason=(True, bool), return_stop_reason=(True, bool),
                 return_cumulative_logprob=(True, bool))
    results, errors = grpc_stream(triton_server, "tensorrt_llm", llmapi_inputs(PROMPT, streaming=(True, bool),
                                  sampling_param_exclude_input_from_output=(True, bool), **flags), outputs)
    assert not errors and len(results) > 1
    texts = [r.as_numpy("text_output")[0].decode() for r in results]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])) and texts[-1] == expected
    assert [r.as_numpy("finish_reason")[0].decode() for r in results][:-1] == ["None"] * (len(results) - 1)
    assert results[-1].as_numpy("finish_reason")[0].decode() in ("stop", "length")
    results, errors = grpc_stream(triton_server, "tensorrt_llm", llmapi_inputs(
        PROMPT, sampling_param_stop=([expected.split()[1]], np.object_), **flags), outputs)
    assert not errors and len(results) == 1
    assert results[0].as_numpy("text_output")[0].decode().startswith(PROMPT)
    assert results[0].as_numpy("finish_reason")[0].decode() == "stop"
    assert results[0].as_numpy("stop_reason")[0].decode() == expected.split()[1]


def test_llmapi_stop_request_cancels_by_request_id_and_refusals_name_the_input(triton_server):
    """A request with ``stop`` true cancels the requests carrying its request id (each ends with
    "Request cancelled by client", as TensorRT-LLM answers); inputs pagoda cannot honour are
    refused by name."""
    import tritonclient.grpc as grpcclient

    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        long = llmapi_inputs(PROMPT, streaming=(True, bool))
        long["sampling_param_max_tokens"] = np.array([400], dtype=np.int32)
        client.async_stream_infer("tensorrt_llm", to_tensors(grpcclient, long), request_id="job-1")
        first, error = results.get(timeout=120)
        assert error is None
        stop = to_tensors(grpcclient, {"text_input": np.array([b""], dtype=np.object_),
                                       "stop": np.array([True])})
        client.async_stream_infer("tensorrt_llm", stop, request_id="job-1")
        errors = []
        while len(errors) < 2:
            result, error = results.get(timeout=120)
            if error is not None:
                errors.append(str(error))
        assert all("Request cancelled by client" in e for e in errors), errors
    finally:
        client.stop_stream()
        client.close()
    for name, value, dtype, message in [("sampling_param_best_of", 2, np.int32, "sampling_param_best_of: only 1"),
                                        ("lora_path", "/x", np.object_, "lora_path: not supported"),
                                        ("image_url", "http://x", np.object_,
                                         "image_url[0]: http(s) image URLs are not fetched"),
                                        ("image_url", "data:image/png;base64,iVBORw0KGgo=", np.object_,
                                         "this model takes text only")]:
        results, errors = grpc_stream(triton_server, "tensorrt_llm", llmapi_inputs(PROMPT, **{name: (value, dtype)}),
                                      ("text_output",))
        assert len(errors) == 1 and message in errors[0], (name, errors)
