"""pagoda's model inputs -> ``WireRequest`` (``serving.dialects.pagoda`` + ``serving.wire``), and
engine outputs -> response tensors (``serving.responses``); no server."""

import json
import re

import numpy as np
import pytest

from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from pagoda.serving.commands import ServingRequest
from pagoda.serving.dialects.pagoda import LoRAControl, read_lora_control
from pagoda.serving.dialects.vllm import request_parameter_vocabulary
from pagoda.serving.responses import make_control_response, make_error_response, make_response
from pagoda.serving.wire import MAX_PROMPT_CHARS, WireRequest


def parse_request(get_input, parameters=None, output_dialect="pagoda", encode=None):
    """The replica's reading of one request, as ``model.py`` makes it."""
    wire = WireRequest.from_triton_inputs(get_input, parameters, encode)
    return ServingRequest("r", wire, None, output_dialect=wire.output.dialect_or(output_dialect))


def text(value):
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def inputs(**tensors):
    """A get_input over numpy arrays; plain python values become Triton-like arrays."""
    arrays = {}
    for name, value in tensors.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, bool):
            arrays[name] = np.array([value], dtype=bool)
        elif isinstance(value, (str, bytes)):
            arrays[name] = text(value)
        elif isinstance(value, dict):
            arrays[name] = text(json.dumps(value))
        else:
            raise TypeError(name)
    return arrays.get


def test_defaults_when_only_text_input():
    parsed = parse_request(inputs(text_input="Hello"))
    assert parsed.wire.prompt == "Hello"
    assert parsed.wire.output.stream is False and parsed.wire.output.exclude_input_in_output is False
    assert parsed.wire.engine_params().max_tokens == 16 and parsed.wire.engine_params().temperature == 1.0
    assert parsed.wire.options.priority == 0 and parsed.wire.options.cache_salt is None


def test_vllm_style_json_and_flags():
    parsed = parse_request(inputs(
        text_input="Hi", stream=True, exclude_input_in_output=True, return_finish_reason=True,
        return_num_output_tokens=True,
        sampling_parameters={"temperature": 0, "max_tokens": 8, "stop": ["\n"], "seed": 3, "top_k": -1,
                             "priority": 2, "cache_salt": "tenant-a"}))
    output = parsed.wire.output
    assert output.stream and output.exclude_input_in_output and output.return_finish_reason
    assert parsed.wire.output.return_num_output_tokens and not parsed.wire.output.return_logprobs
    p = parsed.wire.engine_params()
    assert (p.temperature, p.max_tokens, p.stop, p.seed, p.top_k) == (0, 8, ["\n"], 3, 0)
    assert parsed.wire.options.priority == 2 and parsed.wire.options.cache_salt == "tenant-a"


def test_vllm_backend_string_values_are_accepted():
    parsed = parse_request(inputs(text_input="Hi", sampling_parameters={
        "temperature": "0.5", "max_tokens": "12", "ignore_eos": "true", "top_p": "0.9"}))
    p = parsed.wire.engine_params()
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.top_p) == (0.5, 12, True, 0.9)


def test_trtllm_scalars_win_over_json():
    parsed = parse_request(inputs(
        text_input="Hi", sampling_parameters={"max_tokens": 100, "temperature": 0.9, "stop": ["x"]},
        max_tokens=np.array([7], dtype=np.int32), temperature=np.array([0.0], dtype=np.float32),
        top_k=np.array([5], dtype=np.int32), top_p=np.array([0.5], dtype=np.float32),
        seed=np.array([42], dtype=np.uint64), repetition_penalty=np.array([1.1], dtype=np.float32),
        stop_words=np.array([b"END", b""], dtype=np.object_), end_id=np.array([2], dtype=np.int32),
        bad_words=np.array([b""], dtype=np.object_), beam_width=np.array([1], dtype=np.int32)))
    p = parsed.wire.engine_params()
    assert (p.max_tokens, p.temperature, p.top_k, p.seed) == (7, 0.0, 5, 42)
    assert p.top_p == pytest.approx(0.5) and p.repetition_penalty == pytest.approx(1.1)
    assert p.stop == ["END"] and p.stop_token_ids == [2]


def test_bad_words_and_embedding_bias_as_tensorrt_llm_sends_them():
    """``bad_words`` become vLLM's ``bad_words``; each embedding-bias word's tokens get its
    weight as a ``logit_bias`` (summed with one given in the JSON), read with ``encode``."""
    tokens = {"cat": [5, 6], "dog": [6]}
    parsed = parse_request(inputs(text_input="Hi", sampling_parameters={"logit_bias": {"6": 1.0}},
                                  bad_words=np.array([b"darn", b""], dtype=np.object_),
                                  embedding_bias_words=np.array([b"cat", b"dog"], dtype=np.object_),
                                  embedding_bias_weights=np.array([-2.0, 0.5], dtype=np.float32)),
                           encode=tokens.__getitem__)
    assert parsed.wire.engine_params().bad_words == ["darn"]
    assert parsed.wire.engine_params().logit_bias == {5: -2.0, 6: pytest.approx(-0.5)}


def test_empty_stop_words_mean_none():
    parsed = parse_request(inputs(text_input="Hi", stop_words=np.array([b""], dtype=np.object_)))
    assert parsed.wire.engine_params().stop == []


def test_logprob_flags_turn_on_engine_logprobs():
    parsed = parse_request(inputs(text_input="Hi", return_cumulative_logprob=True))
    assert parsed.wire.engine_params().logprobs == 0
    parsed = parse_request(inputs(text_input="Hi", return_logprobs=True, sampling_parameters={"logprobs": 3}))
    assert parsed.wire.engine_params().logprobs == 3


@pytest.mark.parametrize("tensors, message", [
    ({}, "text_input: required input is missing"),
    ({"text_input": ""}, "text_input: must not be empty"),
    ({"text_input": "x" * (MAX_PROMPT_CHARS + 1)}, "text_input: prompt is too long"),
    ({"text_input": b"\xff\xfe"}, "text_input: is not valid UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input: expected exactly one string"),
    ({"text_input": "Hi", "sampling_parameters": "{not json"}, "sampling_parameters: not valid JSON"),
    ({"text_input": "Hi", "sampling_parameters": "[1, 2]"}, "sampling_parameters: must be a JSON object"),
    # strict JSON on the replica too (contracts.json_input), as on the router's doors (issue 25)
    ({"text_input": "Hi", "sampling_parameters": '{"temperature": NaN}'},
     "sampling_parameters.temperature: NaN is not"),
    ({"text_input": "Hi", "sampling_parameters": '{"top_p": 1e999}'}, "sampling_parameters.top_p: the number 1e999"),
    ({"text_input": "Hi", "sampling_parameters": '{"stop": ["\\ud800"]}'}, "sampling_parameters"),
    ({"text_input": "Hi", "sampling_parameters": '{"a": ' * 100 + '1' + '}' * 100},
     "sampling_parameters: JSON nested too deeply"),
    ({"text_input": "Hi", "sampling_parameters": {"temprature": 0.5}}, "unknown sampling parameter(s): temprature"),
    ({"text_input": "Hi", "sampling_parameters": {"max_tokens": "lots"}}, "max_tokens: must be an integer"),
    ({"text_input": "Hi", "sampling_parameters": {"max_tokens": 1.5}}, "max_tokens: must be an integer"),
    ({"text_input": "Hi", "sampling_parameters": {"temperature": [1]}}, "temperature: must be a number"),
    ({"text_input": "Hi", "sampling_parameters": {"temperature": -1}}, "temperature: must be >= 0.0"),
    ({"text_input": "Hi", "sampling_parameters": {"top_p": 1.5}}, "top_p: must be <= 1.0"),
    ({"text_input": "Hi", "sampling_parameters": {"max_tokens": 0}}, "max_tokens: must be >= 1"),
    ({"text_input": "Hi", "sampling_parameters": {"stop": [""]}}, "stop: every stop string must be a non-empty"),
    ({"text_input": "Hi", "sampling_parameters": {"ignore_eos": "maybe"}}, "ignore_eos: must be a boolean"),
    ({"text_input": "Hi", "sampling_parameters": {"stop": 5}}, "stop: must be a JSON list"),
    ({"text_input": "Hi", "sampling_parameters": {"stop_token_ids": 5}}, "stop_token_ids: must be a JSON list"),
    ({"text_input": "Hi", "sampling_parameters": {"priority": "high"}}, "priority: must be an integer"),
    ({"text_input": "Hi", "sampling_parameters": {"cache_salt": 5}}, "cache_salt: must be a non-empty string"),
    ({"text_input": "Hi", "stream": np.array([1], dtype=np.int32)}, "stream: must be a boolean"),
    # as Triton's vLLM backend: a streamed response carries only the new text
    ({"text_input": "Hi", "stream": True, "exclude_input_in_output": False},
     "exclude_input_in_output: When streaming, `exclude_input_in_output` = False is not allowed"),
    ({"text_input": "Hi", "sampling_parameters": {"timeout": 0}}, "timeout: must be a number of seconds > 0"),
    ({"text_input": "Hi", "sampling_parameters": {"timeout": "soon"}}, "timeout: must be a number"),
    ({"text_input": "Hi", "max_tokens": np.array([0], dtype=np.int32)}, "max_tokens: must be >= 1"),
    ({"text_input": "Hi", "max_tokens": np.array([1, 2], dtype=np.int32)}, "max_tokens: expected one value"),
    ({"text_input": "Hi", "top_k": np.array([1.5], dtype=np.float32)}, "top_k: must be an integer"),
    ({"text_input": "Hi", "temperature": np.array([b"hot"], dtype=np.object_)}, "temperature: must be a number"),
    ({"text_input": "Hi", "bad_words": np.array([b" "], dtype=np.object_)}, "bad_words: every bad word must be"),
    ({"text_input": "Hi", "embedding_bias_words": np.array([b"a"], dtype=np.object_),
      "embedding_bias_weights": np.array([1.0], dtype=np.float32)},
     "embedding_bias_words: this model has no tokenizer"),
    ({"text_input": "Hi", "beam_width": np.array([11], dtype=np.int32)}, "beam_width: must be <= 10"),
    ({"text_input": "Hi", "beam_width": np.array([4], dtype=np.int32), "temperature": np.array([0.7], np.float32)},
     "temperature: must be 0.0 with use_beam_search"),
    ({"text_input": "Hi", "sampling_parameters": {"use_beam_search": True, "best_of": 2, "temperature": 0,
                                                  "prompt_logprobs": 1}},
     "prompt_logprobs: must be None with use_beam_search"),
])
def test_bad_inputs_name_the_problem(tensors, message):
    with pytest.raises(ValueError) as info:
        parse_request(inputs(**tensors))
    assert message in str(info.value)


def _output(finished, texts, deltas, token_ids, delta_ids, reasons=None, logprobs=None):
    completions = [
        CompletionOutput(index=i, text=t, token_ids=ids, delta_text=d, delta_token_ids=dids,
                         finish_reason=(reasons or [None] * len(texts))[i],
                         cumulative_logprob=-1.5 if logprobs else None,
                         logprobs=logprobs, delta_logprobs=logprobs)
        for i, (t, d, ids, dids) in enumerate(zip(texts, deltas, token_ids, delta_ids))]
    return RequestOutput(request_id="r", prompt="Say:", prompt_token_ids=[1, 2, 3], outputs=completions,
                         finished=finished, metrics=RequestMetrics(arrival_time=0.0))


def test_streaming_response_carries_deltas():
    parsed = parse_request(inputs(text_input="Say:", stream=True, return_finish_reason=True,
                                  return_num_input_tokens=True, return_num_output_tokens=True))
    response = make_response(parsed, _output(False, [" a b"], [" b"], [[5, 6]], [[6]]))
    assert not response.is_final and response.error is None
    assert response.tensors["text_output"].tolist() == [b" b"]
    assert response.tensors["finish_reason"].tolist() == [b""]
    assert response.tensors["num_input_tokens"].tolist() == [3]
    assert response.tensors["num_output_tokens"].dtype == np.uint32
    assert response.tensors["num_output_tokens"].tolist() == [1]
    final = make_response(parsed, _output(True, [" a b."], ["."], [[5, 6, 7]], [[7]], ["length"]))
    assert final.is_final and final.tensors["finish_reason"].tolist() == [b"length"]


def test_streaming_step_without_news_sends_nothing():
    parsed = parse_request(inputs(text_input="Say:", stream=True))
    assert make_response(parsed, _output(False, [""], [""], [[]], [[]])) is None


def test_non_streaming_waits_for_the_end_and_prepends_prompt_unless_excluded():
    parsed = parse_request(inputs(text_input="Say:"))
    assert make_response(parsed, _output(False, [" a"], [" a"], [[5]], [[5]])) is None
    final = make_response(parsed, _output(True, [" a b"], [" b"], [[5, 6]], [[6]], ["stop"]))
    assert final.is_final and final.tensors["text_output"].tolist() == [b"Say: a b"]
    parsed = parse_request(inputs(text_input="Say:", exclude_input_in_output=True, return_num_output_tokens=True))
    final = make_response(parsed, _output(True, [" a b"], [" b"], [[5, 6]], [[6]], ["stop"]))
    assert final.tensors["text_output"].tolist() == [b" a b"]
    assert final.tensors["num_output_tokens"].tolist() == [2]


def test_n_completions_become_one_element_each():
    parsed = parse_request(inputs(text_input="Say:", stream=True, return_finish_reason=True))
    response = make_response(parsed, _output(True, ["x", "y"], ["x", ""], [[1], [2]], [[1], []], ["length", "stop"]))
    assert response.tensors["text_output"].tolist() == [b"x", b""]
    assert response.tensors["finish_reason"].tolist() == [b"length", b"stop"]


def test_stop_reason_is_the_stop_string_or_token_id_as_text():
    """``return_stop_reason`` (TensorRT-LLM's LLM API): ``str()`` of what ended each completion."""
    parsed = parse_request(inputs(text_input="Say:", return_stop_reason=True))
    output = _output(True, ["x", "y"], ["x", "y"], [[1], [2]], [[1], [2]], ["stop", "length"])
    output.outputs[0].stop_reason = "\n"
    assert make_response(parsed, output).tensors["stop_reason"].tolist() == [b"\n", b"None"]


def test_logprob_outputs():
    parsed = parse_request(inputs(text_input="Say:", stream=True, return_logprobs=True,
                                  return_cumulative_logprob=True))
    lps = [TokenLogprob(token_id=5, logprob=-1.5, rank=1, top=[])]
    response = make_response(parsed, _output(False, ["a"], ["a"], [[5]], [[5]], logprobs=lps))
    assert json.loads(response.tensors["logprobs"][0]) == [
        {"token_id": 5, "logprob": -1.5, "rank": 1, "top_logprobs": []}]
    assert response.tensors["cumulative_logprob"].dtype == np.float32
    assert response.tensors["cumulative_logprob"].tolist() == [-1.5]


def test_error_response_is_final():
    response = make_error_response("text_input: must not be empty")
    assert response.is_final and response.error_code == "INVALID_ARG" and not response.tensors


def test_lora_name_from_input_or_json_and_refused_when_not_a_string():
    text = np.array([b"hi"], dtype=object)
    parsed = parse_request(lambda n: {"text_input": text, "lora_name": np.array([b"sql"], dtype=object)}.get(n))
    assert parsed.wire.options.lora_name == "sql"
    js = np.array([json.dumps({"lora_name": "chat", "max_tokens": 3}).encode()], dtype=object)
    parsed = parse_request(lambda n: {"text_input": text, "sampling_parameters": js}.get(n))
    assert parsed.wire.options.lora_name == "chat" and parsed.wire.engine_params().max_tokens == 3
    assert parse_request(lambda n: {"text_input": text}.get(n)).wire.options.lora_name is None
    bad = np.array([json.dumps({"lora_name": 7}).encode()], dtype=object)
    with pytest.raises(ValueError, match="lora_name: must be a non-empty string"):
        parse_request(lambda n: {"text_input": text, "sampling_parameters": bad}.get(n))
def test_guided_decoding_in_sampling_parameters():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    parsed = parse_request(inputs(text_input="Hi", sampling_parameters={
        "max_tokens": "8", "guided_decoding": {"json": schema, "regex": None}}))
    guided = parsed.wire.engine_params().guided_decoding
    assert guided.kind == "json" and json.loads(guided.json) == schema
    for spec, message in [({"regex": "a", "choice": ["a"]}, "give exactly one of"),
                          ("a+", "guided_decoding: must be a JSON object"),
                          ({"json": "{"}, "guided_decoding.json: not valid JSON")]:
        with pytest.raises(ValueError, match="guided_decoding") as info:
            parse_request(inputs(text_input="Hi", sampling_parameters={"guided_decoding": spec}))
        assert message in str(info.value)


def test_engine_error_output_becomes_the_one_error_response():
    parsed = parse_request(inputs(text_input="Hi", stream=True))
    output = RequestOutput("r", "Hi", [1], [CompletionOutput(0, "", [], "", [], finish_reason="abort")], True,
                           RequestMetrics(arrival_time=0.0), error="guided_decoding.regex: cannot be compiled: bad")
    response = make_response(parsed, output)
    assert response.is_final and response.error_code == "INVALID_ARG" and "cannot be compiled" in response.error


def test_timeout_is_a_request_option():
    assert parse_request(inputs(text_input="Hi", sampling_parameters={"timeout": 2.5})).wire.options.timeout == 2.5
    assert parse_request(inputs(text_input="Hi", sampling_parameters={"timeout": "3"})).wire.options.timeout == 3.0
    assert parse_request(inputs(text_input="Hi")).wire.options.timeout is None


def test_admission_error_output_becomes_an_unavailable_error():
    output = _output(True, ["x"], ["x"], [[5]], [[5]], reasons=["abort"])
    output.error = "deadline exceeded: the request's timeout of 1 s passed while waiting in the queue"
    for stream in (True, False):
        response = make_response(parse_request(inputs(text_input="Say:", stream=stream)), output)
        assert response.is_final and response.error == output.error and response.error_code == "UNAVAILABLE"


def test_lora_control_requests_are_parsed_and_bad_ones_named():
    assert read_lora_control(inputs(text_input="Hi", lora_name="sql")) is None  # a generation
    assert read_lora_control(inputs(lora_action="load", lora_name="sql", lora_path="/a/sql")) == \
        LoRAControl("load", "sql", "/a/sql")
    assert read_lora_control(inputs(lora_action="unload", lora_name="sql")) == LoRAControl("unload", "sql")
    assert read_lora_control(inputs(lora_action="list")) == LoRAControl("list")
    assert not LoRAControl("list").changes_adapters and LoRAControl("unload", "x").changes_adapters
    for tensors, message in [
        (dict(lora_action="reload", lora_name="sql"), "lora_action: must be one of load, unload, list, got 'reload'"),
        (dict(lora_action="load", lora_name="sql"), "lora_path: required by lora_action 'load'"),
        (dict(lora_action="load", lora_path="/a"), "lora_name: required by lora_action 'load'"),
        (dict(lora_action="unload"), "lora_name: required by lora_action 'unload'"),
        (dict(lora_action="unload", lora_name="sql", lora_path="/a"), "lora_path: only lora_action 'load'"),
        (dict(lora_action="list", lora_name="sql"), "lora_name: lora_action 'list' takes no lora_name"),
        # the router's rule for names, on the replica's own door too (a 100,000-character name was accepted)
        (dict(lora_action="load", lora_name="x" * 100_000, lora_path="/a"),
         "lora_name: must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, got 'xxxx"),
        (dict(lora_action="unload", lora_name="../sql"), "lora_name: must be 1-128 letters"),
        (dict(lora_action="", lora_name="sql"), "lora_action: must be a non-empty string"),
        (dict(lora_action="list", text_input="Hi", stream=True),
         "cannot be combined with generation inputs (text_input, stream)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            read_lora_control(inputs(**tensors))
    with pytest.raises(ValueError, match="lora_path: only a LoRA control request"):
        parse_request(inputs(text_input="Hi", lora_path="/a"))
    response = make_control_response({"action": "list", "loaded": ["sql"]})
    assert response.is_final and response.error is None
    assert json.loads(response.tensors["text_output"][0]) == {"action": "list", "loaded": ["sql"]}


# ------------------------------------------------------------ the vLLM backend's dialect
def test_request_parameters_are_read_as_sampling_parameters_and_merged_with_the_tensor():
    parsed = parse_request(inputs(text_input="Hi"), json.dumps({"temperature": "0", "max_tokens": "3",
                                                                "stop_token_ids": "[7, 8]", "traceparent": "00-x"}))
    params = parsed.wire.engine_params()
    assert (params.temperature, params.max_tokens, params.stop_token_ids) == (0.0, 3, [7, 8])
    both = parse_request(inputs(text_input="Hi", sampling_parameters={"temperature": 0, "n": 2}),
                         json.dumps({"temperature": "0", "lora_name": "sql", "seed": 4}))
    assert (both.wire.engine_params().n, both.wire.engine_params().seed, both.wire.options.lora_name) == (2, 4, "sql")
    conflict = r"^max_tokens: given as a request parameter \(4\) and in sampling_parameters \(3\)"
    with pytest.raises(ValueError, match=conflict):
        parse_request(inputs(text_input="Hi", sampling_parameters={"max_tokens": 3}), json.dumps({"max_tokens": "4"}))
    with pytest.raises(ValueError, match=r"^unknown request parameter\(s\): num_return_sequences, temprature;"):
        parse_request(inputs(text_input="Hi"), json.dumps({"temprature": "0", "num_return_sequences": 2}))
    with pytest.raises(ValueError, match=r"^max_tokens: must be an integer, got 'many'"):
        parse_request(inputs(text_input="Hi"), json.dumps({"max_tokens": "many"}))
    guided = parse_request(inputs(text_input="Hi"), json.dumps({"guided_decoding": '{"regex": "[ab]"}'}))
    assert guided.wire.engine_params().guided_decoding.regex == "[ab]"
    assert {"temperature", "structured_outputs", "lora_name", "traceparent"} <= request_parameter_vocabulary()


def test_structured_outputs_become_guided_decoding():
    as_text = parse_request(inputs(text_input="Hi"), json.dumps({"structured_outputs": json.dumps({"choice": ["a"]})}))
    as_object = parse_request(inputs(text_input="Hi", sampling_parameters={
        "structured_outputs": {"regex": "[0-9]+", "json": None, "disable_fallback": True}}))
    assert as_text.wire.engine_params().guided_decoding.choice == ["a"]
    assert as_object.wire.engine_params().guided_decoding.regex == "[0-9]+"
    for sampling, message in [({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}},
                               "structured_outputs: give either"),
                              ({"structured_outputs": "{oops"}, "structured_outputs: not valid JSON"),
                              ({"structured_outputs": {"whitespace_pattern": " "}},
                               "structured_outputs.whitespace_pattern: not supported")]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            parse_request(inputs(text_input="Hi", sampling_parameters=sampling))
    parsed = parse_request(inputs(text_input="Hi"), json.dumps({"prompt_logprobs": "2"}))
    assert parsed.wire.engine_params().prompt_logprobs == 2
    with pytest.raises(ValueError, match="^prompt_logprobs: must be >= 0"):
        parse_request(inputs(text_input="Hi", sampling_parameters={"prompt_logprobs": -1}))


def test_input_ids_are_a_token_prompt():
    parsed = parse_request(inputs(input_ids=np.array([5, 6, 7], dtype=np.int32)))
    assert parsed.wire.prompt_token_ids == (5, 6, 7) and parsed.wire.prompt is None
    for tensors, message in [(dict(input_ids=np.array([5], dtype=np.int32), text_input="Hi"), "input_ids: give the "),
                             (dict(input_ids=np.array([], dtype=np.int32)), "input_ids: must be a non-empty list"),
                             (dict(input_ids=np.array([3, -1], dtype=np.int32)), "input_ids: must be a non-empty"),
                             (dict(input_ids=np.array([1.5], dtype=np.float32)), "input_ids: must be a non-empty"),
                             (dict(), "text_input: required input is missing (or give input_ids)")]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            parse_request(inputs(**tensors))


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_output_once_in_either_dialect(stream):
    entries = [None, TokenLogprob(7, -1.5, 3, [(4, -0.5), (9, -1.0)])]
    for dialect, expected in [("vllm", [None, {"4": {"logprob": -0.5, "rank": 1, "decoded_token": "<4>"},
                                               "9": {"logprob": -1.0, "rank": 2, "decoded_token": "<9>"},
                                               "7": {"logprob": -1.5, "rank": 3, "decoded_token": "<7>"}}]),
                              ("pagoda", [None, entries[1].to_dict()])]:
        parsed = parse_request(inputs(text_input="Hi", stream=stream, sampling_parameters={
            "prompt_logprobs": 2, "output_dialect": dialect}))
        responses = []
        for finished in (False, True):
            completion = CompletionOutput(0, "a", [1], "a", [1], finish_reason="length" if finished else None)
            output = RequestOutput("r", "Hi", [3, 7], [completion], finished, RequestMetrics(0.0),
                                   prompt_logprobs=entries)
            responses.append(make_response(parsed, output, lambda t: f"<{t}>"))
        sent = [json.loads(r.tensors["prompt_logprobs"][0]) for r in responses if r and "prompt_logprobs" in r.tensors]
        assert sent == [expected], dialect


def test_vllm_output_dialect_logprobs_and_finish_reason():
    lps = [TokenLogprob(token_id=5, logprob=-0.5, rank=2, top=[(9, -0.2), (5, -0.5)])]
    asked = parse_request(inputs(text_input="Say:", stream=True, return_logprobs=True, return_finish_reason=True,
                                 sampling_parameters={"logprobs": 2}), output_dialect="vllm")
    response = make_response(asked, _output(False, [" a"], [" a"], [[5]], [[5]], logprobs=lps),
                             decode_token=lambda t: {5: " a", 9: " b"}[t])
    assert json.loads(response.tensors["logprobs"][0]) == [{
        "9": {"logprob": -0.2, "rank": 1, "decoded_token": " b"},
        "5": {"logprob": -0.5, "rank": 2, "decoded_token": " a"}}]
    assert response.tensors["finish_reason"].tolist() == [b"None"]
    not_asked = parse_request(inputs(text_input="Say:", stream=True, return_logprobs=True), output_dialect="vllm")
    assert not_asked.wire.engine_params().logprobs == 0  # tracked for cumulative_logprob, not reported
    response = make_response(not_asked, _output(False, [" a"], [" a"], [[5]], [[5]], logprobs=lps))
    assert response.tensors["logprobs"].tolist() == [b"null"]
    # The request option wins over the model's default dialect.
    pagoda = parse_request(inputs(text_input="Say:", sampling_parameters={"output_dialect": "pagoda"}),
                           output_dialect="vllm")
    assert pagoda.output_dialect == "pagoda"


def test_beam_search_from_either_dialect_with_cumulative_logprobs():
    """vLLM's ``use_beam_search``/``best_of`` JSON and TensorRT-LLM's ``beam_width`` input both
    make a beam-search request; asking for cumulative log-probabilities needs no per-token ones."""
    vllm = parse_request(inputs(text_input="Hi", return_cumulative_logprob=True, sampling_parameters={
        "use_beam_search": True, "best_of": 4, "n": 2, "temperature": 0, "length_penalty": 0.5,
        "early_stopping": "never"}))
    params = vllm.wire.engine_params()
    assert params.num_beams == 4 and params.n == 2 and params.logprobs is None
    assert params.length_penalty == 0.5 and params.early_stopping == "never"
    per_token = parse_request(inputs(text_input="Hi", return_logprobs=True, sampling_parameters={
        "use_beam_search": True, "best_of": 2, "temperature": 0, "logprobs": 3}))
    # Each beam's per-token values.
    assert per_token.wire.engine_params().logprobs == 3 and per_token.wire.logprobs_asked
    trt = parse_request(inputs(text_input="Hi", beam_width=np.array([3], dtype=np.int32)))
    params = trt.wire.engine_params()
    assert params.num_beams == 3 and params.temperature == 0.0 and params.n == 1
    width_1 = parse_request(inputs(text_input="Hi", beam_width=np.array([1], dtype=np.int32)))
    assert width_1.wire.engine_params().num_beams == 0


def test_streamed_raw_logits_go_with_their_tokens():
    """Streaming: ``context_logits`` once, with the first tokens; each response's
    ``generation_logits`` ``[n, tokens, vocab]`` holds its own tokens' rows (a completion with fewer
    padded with 0.0; none: absent). Not streaming: both on the final response, all rows."""
    context, rows = np.ones((3, 4), np.float32), np.arange(12, dtype=np.float32).reshape(3, 4)

    def output(finished, deltas, whole=None):
        out = _output(finished, ["x"] * len(deltas), ["x"] * len(deltas), [[5]] * len(deltas),
                      [[5] * (0 if d is None else len(d)) for d in deltas])
        for completion, delta in zip(out.outputs, deltas):
            completion.delta_generation_logits, completion.generation_logits = delta, whole
        out.context_logits = context
        return out

    flags = dict(text_input="Say:", return_context_logits=True, return_generation_logits=True)
    parsed = parse_request(inputs(stream=True, **flags))
    first = make_response(parsed, output(False, [rows[:1], rows[:2]])).tensors
    assert np.array_equal(first["context_logits"], context)
    assert first["generation_logits"].shape == (2, 2, 4) and not first["generation_logits"][0, 1].any()
    assert np.array_equal(first["generation_logits"][1], rows[:2])
    later = make_response(parsed, output(True, [rows[2:], None])).tensors
    assert "context_logits" not in later and np.array_equal(later["generation_logits"], [rows[2:], np.zeros((1, 4))])
    assert "generation_logits" not in make_response(parsed, output(True, [None, None])).tensors
    unary = parse_request(inputs(**flags))
    assert make_response(unary, output(False, [rows[:1]], rows[:1])) is None
    final = make_response(unary, output(True, [rows[2:]], rows)).tensors
    assert np.array_equal(final["context_logits"], context) and np.array_equal(final["generation_logits"], [rows])
