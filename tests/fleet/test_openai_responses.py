"""The OpenAI door's responses are typed (openai_responses) and the openai SDK's own types parse them.

The SDK builds its objects leniently from a server's JSON (it never rejects a response), so
here its pydantic types validate each object pagoda writes: a wrong type, a missing required
field or a finish reason outside OpenAI's set fails. No server: the Answer is fed the
replica's outputs as the door's end-to-end tests (tests/serving/test_openai_door.py) do.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion as SdkCompletion, Model as SdkModel  # noqa: E402
from openai.types.chat import ChatCompletion as SdkChat, ChatCompletionChunk as SdkChunk  # noqa: E402

from pagoda.fleet.api.openai_answer import Answer, merge_final  # noqa: E402
from pagoda.fleet.api.openai_io import OpenAIRequest, build_completion_requests  # noqa: E402
from pagoda.engine.sampling_params import SamplingParams  # noqa: E402
from pagoda.serving.wire import WireRequest  # noqa: E402
from pagoda.fleet.api.openai_responses import (ChatCompletion, CompletionChoice, ModelCard, ModelList,  # noqa: E402
                                               dump, error_body)
from tests.fleet.test_openai_answer import FakeTokenizer, _outputs  # noqa: E402


def _completion_answers(body):
    tokenizer = FakeTokenizer()
    return [Answer(False, "cmpl-1", "m", built, tokenizer, index_offset=k * built.n)
            for k, built in enumerate(build_completion_requests(body, tokenizer))]


def _chat_answer(logprobs):
    built = OpenAIRequest(WireRequest(prompt="abc", params=SamplingParams(max_tokens=2)), stream=True,
                          include_usage=True, logprobs=logprobs)
    return Answer(True, "chatcmpl-1", "m", built, FakeTokenizer())


def test_completions_whole_and_streamed_parse_as_the_sdks_types():
    answers = _completion_answers({"prompt": ["abc", "ab"], "logprobs": 1, "max_tokens": 2})
    chunks = []
    for answer in answers:
        chunks += answer.chunks(_outputs("d", 4, -0.25))
        chunks += answer.chunks(_outputs("e", 5, -0.75, "length", with_prompt=False))
    whole = merge_final(answers)
    parsed = SdkCompletion.model_validate(whole)
    assert [c.finish_reason for c in parsed.choices] == ["length", "length"]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0 and parsed.system_fingerprint.startswith("pagoda-")
    assert parsed.choices[0].logprobs.token_logprobs == [-0.25, -0.75]
    last = chunks[-1]
    assert SdkCompletion.model_validate(last).choices[0].finish_reason == "length"
    usage = answers[0].usage_chunk(answers)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    # A mid-stream chunk's finish_reason is null, as vLLM and OpenAI stream it (the SDK's
    # Completion type, used for chunks too, declares it required and never validates one).
    assert "finish_reason" in chunks[0]["choices"][0] and chunks[0]["choices"][0]["finish_reason"] is None
    # With echo the prompt's first token has a null log-prob and null alternatives, as OpenAI
    # and vLLM send it (the SDK's type says float there: it is stricter than OpenAI's server).
    (echoed,) = _completion_answers({"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 2})
    echoed.add(_outputs("d", 4, -0.25, "length"))
    logprobs = merge_final([echoed])["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None


def test_chat_whole_and_streamed_parse_as_the_sdks_types():
    answer = _chat_answer(logprobs=1)
    role = answer.role_chunk()
    deltas = answer.chunks(_outputs("d", 4, -0.25, with_prompt=False))
    deltas += answer.chunks(_outputs("e", 5, -0.75, "stop", with_prompt=False))
    for chunk in [role, *deltas, answer.usage_chunk()]:
        SdkChunk.model_validate(chunk)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert deltas[0]["choices"][0]["delta"] == {"content": "d"} and "usage" not in deltas[0]
    whole = SdkChat.model_validate(answer.final_object())
    (choice,) = whole.choices
    assert choice.message.content == "de" and choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert [t.logprob for t in choice.logprobs.content] == [-0.25, -0.75]
    assert "tool_calls" not in answer.final_object()["choices"][0]["message"]  # left out, not null


def test_a_tool_call_answer_and_the_model_list_parse_as_the_sdks_types():
    call = {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"x\": 1}"}}
    whole = dump(ChatCompletion(id="c", object="chat.completion", created=1, model="m", system_fingerprint="f",
                                choices=[{"index": 0, "message": {"role": "assistant", "content": None,
                                                                  "tool_calls": [call]},
                                          "logprobs": None, "finish_reason": "tool_calls"}],
                                usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                                       "prompt_tokens_details": {"cached_tokens": 0}}))
    parsed = SdkChat.model_validate(whole)
    assert json.loads(parsed.choices[0].message.tool_calls[0].function.arguments) == {"x": 1}
    assert whole["choices"][0]["message"]["content"] is None  # written as null, as OpenAI does
    cards = dump(ModelList(object="list", data=[ModelCard(id="base", object="model", created=1, owned_by="pagoda"),
                                                ModelCard(id="sql", object="model", created=1, owned_by="pagoda",
                                                          root="sql", parent="base")]))
    assert [SdkModel.model_validate(card).id for card in cards["data"]] == ["base", "sql"]
    assert "root" not in cards["data"][0] and cards["data"][1]["parent"] == "base"
    assert error_body("bad", "invalid_request_error", "n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}


def test_a_field_pagoda_does_not_declare_cannot_be_written():
    with pytest.raises(ValidationError, match="finsh_reason"):
        CompletionChoice(index=0, text="", logprobs=None, finish_reason=None, finsh_reason="stop")
    with pytest.raises(ValidationError, match="logprobs"):
        CompletionChoice(index=0, text="", finish_reason=None)  # nullable, but always sent
