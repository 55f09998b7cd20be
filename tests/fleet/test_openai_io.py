"""OpenAI bodies -> wire requests (mapping, refusals) and outputs -> OpenAI pieces."""

from __future__ import annotations

import json
import struct

import pytest

from pagoda.engine.guided.params import GuidedDecodingParams
from pagoda.engine.sampling_params import SamplingParams
from pagoda.fleet.api.openai_io import (OpenAIError, build_chat_request, build_completion_request,
                                        build_completion_requests, chat_logprobs, completion_logprobs,
                                        echoed_prompt_logprobs, read_outputs)
from pagoda.fleet.api.routed_request import RoutedRequest
from pagoda.fleet.triton_wire import read_string_input


def sent(built):
    """The values a built request sends the replica in its ``sampling_parameters`` (those that
    differ from the defaults: sampling fields and request options), its output dialect aside."""
    return {k: v for k, v in built.wire.values().items() if k != "output_dialect"}


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True):
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("unknown role")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def test_completion_mapping():
    built = build_completion_request({"prompt": ["Hi"], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2,
                                      "stop": "\n", "seed": 3, "presence_penalty": 0.1, "top_k": 5,
                                      "cache_salt": "tenant", "logprobs": 2, "echo": True, "stream": True,
                                      "stream_options": {"include_usage": True}, "user": "ignored"})
    assert built.prompt == "Hi" and built.stream and built.n == 2 and built.include_usage
    assert built.echo_prefix == "Hi" and built.logprobs == 2
    assert sent(built) == {"temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "presence_penalty": 0.1,
                           "top_k": 5, "cache_salt": "tenant", "max_tokens": 7, "stop": ["\n"], "logprobs": 2,
                           "prompt_logprobs": 2}  # echo with logprobs: the prompt's too (vLLM's rule)
    assert built.wire.options.cache_salt == "tenant" and built.wire.params.n == 2
    default = build_completion_request({"prompt": "x"})
    assert default.wire.params.max_tokens == 16 and sent(default) == {"max_tokens": 16}  # OpenAI's default


def test_token_prompts_lists_of_prompts_and_echo_without_generation():
    """lm-eval's loglikelihood body: token-id prompts in a list, echo, max_tokens 0, logprobs."""
    built = build_completion_requests({"prompt": [[3, 4, 5], [6, 7]], "echo": True, "max_tokens": 0,
                                       "logprobs": 1, "temperature": 0}, FakeTokenizer())
    assert [b.prompt for b in built] == [[3, 4, 5], [6, 7]] and [b.echo_prefix for b in built] == ["cde", "fg"]
    assert all(b.echo_only and sent(b) == {"temperature": 0, "max_tokens": 1, "logprobs": 1, "prompt_logprobs": 1}
               for b in built)
    texts = build_completion_requests({"prompt": ["a", "b"], "prompt_logprobs": 3})
    assert [b.prompt for b in texts] == ["a", "b"] and texts[0].wire.params.prompt_logprobs == 3
    assert not texts[0].echo and texts[0].echo_prefix == ""
    assert build_completion_request({"prompt": [9, 8]}).prompt == [9, 8]


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),  # build_completion_request: one prompt
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [[1], "a", 3]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[1]] * 257}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_embeds": "abc"}, "prompt_embeds"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"a": 5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"prompt": "x", "mystery": 1}, "mystery"),  # unknown: refused naming it, as OpenAI
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
])
def test_completion_refusals(body, param):
    with pytest.raises(OpenAIError) as info:
        build_completion_request(body)
    assert info.value.param == param and param.split("_")[0] in str(info.value)


def test_chat_mapping_and_refusals():
    tokenizer = FakeTokenizer()
    built = build_chat_request({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3}, tokenizer)
    assert built.prompt == "<system>Be brief.<user>Hi<assistant>"
    assert sent(built) == {"max_tokens": 5, "logprobs": 3} and built.logprobs == 3
    minimal = build_chat_request({"messages": [{"role": "user", "content": "x"}]}, tokenizer)
    assert sent(minimal) == {"max_tokens": None}
    for body, param in [({"messages": []}, "messages"),
                        ({"messages": [{"content": "x"}]}, "messages"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
                        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
                         "response_format"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")]:
        with pytest.raises(OpenAIError) as info:
            build_chat_request(body, tokenizer)
        assert info.value.param == param


def test_infer_request_and_outputs_round_trip():
    from tritonclient.grpc import service_pb2

    built = build_completion_request({"prompt": "Hello", "max_tokens": 3, "logprobs": 1})
    request = RoutedRequest("cmpl-1", built.wire).infer_request()
    assert request.model_name == "pagoda" and request.id == "cmpl-1"
    assert read_string_input(request, "text_input") == "Hello"
    assert json.loads(read_string_input(request, "sampling_parameters")) == {"max_tokens": 3, "logprobs": 1,
                                                                             "output_dialect": "pagoda"}
    flags = {t.name: request.raw_input_contents[i] for i, t in enumerate(request.inputs) if t.datatype == "BOOL"}
    assert flags["stream"] == b"\x01" and flags["return_logprobs"] == b"\x01"

    response = service_pb2.ModelInferResponse()
    response.outputs.add(name="text_output", datatype="BYTES", shape=[2])
    response.outputs.add(name="num_output_tokens", datatype="UINT32", shape=[2])
    response.raw_output_contents.extend([struct.pack("<I", 2) + b"ab" + struct.pack("<I", 1) + b"c",
                                         struct.pack("<2I", 2, 1)])
    assert read_outputs(response) == {"text_output": ["ab", "c"], "num_output_tokens": [2, 1]}

    tokens = RoutedRequest("cmpl-2", build_completion_request({"prompt": [5, 70000]}).wire).infer_request()
    (ids,) = [i for i, t in enumerate(tokens.inputs) if t.name == "input_ids"]
    assert tokens.inputs[ids].datatype == "INT32" and list(tokens.inputs[ids].shape) == [2]
    assert struct.unpack("<2i", tokens.raw_input_contents[ids]) == (5, 70000)
    assert "text_input" not in {t.name for t in tokens.inputs}


def test_logprob_shapes():
    entries = [{"token_id": 1, "logprob": -0.5, "rank": 1, "top_logprobs": [{"token_id": 1, "logprob": -0.5},
                                                                          {"token_id": 2, "logprob": -1.5}]},
               {"token_id": 3, "logprob": -0.1, "rank": 1, "top_logprobs": []}]
    tokenizer = FakeTokenizer()
    chat = chat_logprobs(entries, tokenizer)
    assert chat["content"][0] == {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -1.5, "bytes": [98]}]}
    legacy = completion_logprobs(entries, tokenizer, offset=10)
    assert legacy == {"tokens": ["a", "c"], "token_logprobs": [-0.5, -0.1],
                      "top_logprobs": [{"a": -0.5, "b": -1.5}, {}], "text_offset": [10, 11]}
    echoed = completion_logprobs(echoed_prompt_logprobs([None, entries[1]], 4) + entries[:1], tokenizer)
    assert echoed == {"tokens": ["d", "c", "a"], "token_logprobs": [None, -0.1, -0.5],
                      "top_logprobs": [None, {}, {"a": -0.5, "b": -1.5}], "text_offset": [0, 1, 2]}


def test_structured_output_fields():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    messages = [{"role": "user", "content": "x"}]
    cases = [({"response_format": {"type": "json_object"}}, {"json_object": True}),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                          "strict": True}}}, {"json": schema}),
             ({"response_format": {"type": "text"}}, None),
             ({"guided_json": schema, "guided_decoding_backend": "xgrammar"}, {"json": schema, "backend": "xgrammar"}),
             ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
             ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
             ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'})]
    for extra, expected in cases:
        built = build_chat_request({"messages": messages, **extra}, FakeTokenizer())
        expected_sent = expected and GuidedDecodingParams.from_dict(expected).to_dict()
        assert sent(built).get("guided_decoding") == expected_sent, extra
    assert sent(build_completion_request({"prompt": "x", "guided_regex": "a"}))["guided_decoding"] == {"regex": "a"}
    for extra, param in [({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                         ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                         ({"response_format": {"type": "json_schema"}}, "response_format"),
                         ({"guided_choice": []}, "guided_choice"),
                         ({"guided_json": "{bad"}, "guided_json"),
                         ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                         ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend")]:
        with pytest.raises(OpenAIError) as info:
            build_completion_request({"prompt": "x", **extra})
        assert info.value.param == param, (extra, info.value)


def test_chat_roles_are_checked_and_timeout_passes_through():
    from pagoda.fleet.api.openai_io import OpenAIError, build_completion_request

    class Template:
        def apply_chat_template(self, messages, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    roles = "system, developer, user, assistant, tool"
    with pytest.raises(OpenAIError, match=f'messages\\[1\\].role: must be one of {roles}, got "wizard"'):
        build_chat_request({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
                           Template())
    built = build_chat_request({"messages": [{"role": "developer", "content": "be brief"}]}, Template())
    assert built.prompt == "system:be brief"
    assert build_completion_request({"prompt": "hi", "timeout": 2.5}).wire.options.timeout == 2.5


def test_typed_bodies_name_the_field_path_and_serve_what_the_engine_has():
    """The typed models (openai_protocol): nested paths in errors, the SDK's own message
    shape accepted back, logit_bias and chat_template_kwargs served, never a traceback."""
    seen = {}

    class Template:
        def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
            seen.update(kwargs)
            return "|".join(m["content"] for m in messages)

    # what the openai SDK's ChatCompletionMessage.model_dump() gives back in a conversation
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "audio": None, "function_call": None,
              "tool_calls": None, "annotations": None}
    built = build_chat_request({"messages": [{"role": "user", "content": "a"}, echoed,
                                             {"role": "user", "content": "b"}],
                                "chat_template_kwargs": {"enable_thinking": False},
                                "logit_bias": {"7": -100, "9": 2.5}}, Template())
    assert built.prompt == "a|hi|b" and seen == {"enable_thinking": False}
    assert built.wire.params.logit_bias == {7: -100, 9: 2.5}
    cases = [({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
              "messages[0].content", "messages"),
             ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages[0].refusal",
              "messages"),
             ({"messages": [{"role": "user", "content": "x", "colour": "red"}]},
              "messages[0].colour: unknown parameter", "messages"),
             ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                                  "json_schema": {"name": "s"}}},
              "response_format.json_schema.schema: required", "response_format"),
             ({"messages": [{"role": "user", "content": "x"}], "n": 2.0}, "n: input should be a valid integer",
              "n"),
             ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
              "messages:", "chat_template_kwargs")]
    for body, message, param in cases:
        with pytest.raises(OpenAIError) as info:
            build_chat_request(body, Template())
        assert str(info.value).startswith(message) and info.value.param == param, (body, str(info.value))
def test_beam_search_passes_as_vllms_extra_parameters():
    built = build_completion_request({"prompt": "x", "use_beam_search": True, "best_of": 4, "n": 2,
                                      "length_penalty": 0.5, "early_stopping": "never", "max_tokens": 8})
    params = built.wire.params
    assert params.use_beam_search is True and params.best_of == 4
    assert params.temperature == 0.0  # vLLM: beam search is greedy unless told otherwise
    assert params.length_penalty == 0.5 and params.early_stopping == "never"
    assert SamplingParams.from_dict(sent(built)).num_beams == 4  # what the replica will run
    for body, param in (({"prompt": "x", "best_of": 3}, "best_of"),
                        ({"prompt": "x", "use_beam_search": "yes"}, "use_beam_search"),
                        ({"prompt": "x", "use_beam_search": True, "best_of": 2.5}, "best_of"),
                        ({"prompt": "x", "use_beam_search": True, "early_stopping": 1}, "early_stopping")):
        with pytest.raises(OpenAIError) as info:
            build_completion_request(body)
        assert info.value.param == param


class VisionTokenizer(FakeTokenizer):
    """A template that writes ``<image>`` for each image part, as a vision model's does."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        def text(content):
            if isinstance(content, str):
                return content
            return "".join("<image>" if part["type"] == "image" else part["text"] for part in content)
        return "".join(f"<{m['role']}>{text(m['content'])}" for m in messages) + "<assistant>"


PNG_A, PNG_B = b"\x89PNG first image", b"\x89PNG second image"


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    import base64

    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def test_chat_image_url_data_parts_become_the_wires_images_in_order():
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [_image_part(_data_url(PNG_A)), {"type": "text", "text": "and"},
                                                      _image_part(_data_url(PNG_B, "image/jpeg"))]},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "again"}]}]}
    built = build_chat_request(body, VisionTokenizer())
    assert built.prompt == "<system>Be brief.<user><image>and<image><assistant>ok<user>again<assistant>"
    assert built.wire.images == (PNG_A, PNG_B)
    assert built.wire.to_engine_request("r", None).multi_modal_data == {"image": [PNG_A, PNG_B]}
    assert build_chat_request({"messages": [{"role": "user", "content": "x"}]}, VisionTokenizer()).wire.images == ()


@pytest.mark.parametrize("url, match", [
    ("https://example.com/cat.png", r"content\[0\]\.image_url\.url: http\(s\) image URLs are not fetched"),
    ("http://169.254.169.254/latest", "http\\(s\\) image URLs are not fetched"),
    ("file:///etc/passwd", "unsupported image URL scheme 'file'"),
    ("cat.png", "unsupported image URL scheme"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:text/plain;base64,aGk=", "media type must be image/"),
    ("data:image/png;base64,not base64!", "payload is not valid base64"),
    ("data:image/png;base64,", "holds no image"),
])
def test_chat_image_urls_other_than_base64_data_are_refused_naming_the_part(url, match):
    body = {"messages": [{"role": "user", "content": [_image_part(url), {"type": "text", "text": "what?"}]}]}
    with pytest.raises(OpenAIError, match=match) as info:
        build_chat_request(body, VisionTokenizer())
    assert info.value.param == "messages" and "messages[0]" in str(info.value)


def test_chat_images_outside_user_messages_and_templates_without_images_are_refused():
    image = [_image_part(_data_url(PNG_A))]
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.content: image_url parts are taken in user messages only"):
        build_chat_request({"messages": [{"role": "system", "content": image}]}, VisionTokenizer())

    class TextOnly(FakeTokenizer):  # a text model's template: content + string
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "".join("<" + m["role"] + ">" + m["content"] for m in messages)

    with pytest.raises(OpenAIError, match="chat template cannot render image parts"):
        build_chat_request({"messages": [{"role": "user", "content": image}]}, TextOnly())
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.content: must be a string or a list of text and image_url"):
        build_chat_request({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, VisionTokenizer())
