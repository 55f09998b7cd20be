"""Chat answers an agent reads: reasoning in its own field and tool calls streamed as they are
written (``openai_answer`` over ``fleet.parsers``), validated by the openai SDK's own types.

The replica's text is fed to the door's ``Answer`` in pieces (every split into two, and one
character at a time); the streamed deltas fold to the unstreamed message."""

from __future__ import annotations

import json

import pytest

from pagoda.fleet.api.openai_answer import Answer, merge_final
from pagoda.fleet.api.openai_io import build_chat_request

openai_types = pytest.importorskip("openai.types.chat")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ANSWER = ("<think>\nWeather needs the tool.\n</think>\n\nChecking.<tool_call>\n"
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


class QwenLikeTokenizer:
    """A chat template that teaches ``<think>`` and ``<tool_call>`` (Qwen3's conventions)."""

    chat_template = "{% if enable_thinking %}<think>{% endif %}<tool_call></tool_call>"

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kwargs):
        tools_text = f"<tools>{json.dumps(tools)}</tools>" if tools else ""
        return tools_text + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text):
        return [1] * len(text)

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def answer_for(body):
    built = build_chat_request({"messages": [{"role": "user", "content": "Weather in Paris?"}], **body},
                               QwenLikeTokenizer())
    return Answer(True, "chatcmpl-1", "m", built, QwenLikeTokenizer())


def outputs(text, reason=None):
    return {"text_output": [text], "finish_reason": [reason or ""], "num_input_tokens": [5], "num_output_tokens": [1]}


def stream(answer, pieces):
    chunks = [answer.role_chunk()]
    for k, piece in enumerate(pieces):
        chunks += answer.chunks(outputs(piece, "stop" if k == len(pieces) - 1 else None))
    for chunk in chunks:
        openai_types.ChatCompletionChunk.model_validate(chunk)
    return chunks


def fold(chunks):
    """A streamed answer as a client folds it: content, reasoning, calls and the finish reason."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")  # both names, as vLLM
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
            reason = choice["finish_reason"] or reason
    return content, reasoning, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], reason


def test_the_whole_answer_has_reasoning_content_and_calls():
    answer = answer_for({"tools": TOOLS})
    answer.add(outputs(ANSWER, "stop"))
    whole = merge_final([answer])
    openai_types.ChatCompletion.model_validate(whole)
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nWeather needs the tool.\n"
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert whole["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_calls_and_reasoning_arrive_as_written_and_fold_to_the_whole_answer():
    expected = ("Checking.", "\nWeather needs the tool.\n", [("get_weather", '{"city": "Paris"}')], "tool_calls")
    for cut in range(len(ANSWER) + 1):
        folded = fold(stream(answer_for({"tools": TOOLS}), [ANSWER[:cut], ANSWER[cut:]]))
        assert (folded[0].strip(), *folded[1:]) == expected, cut
    chunks = stream(answer_for({"tools": TOOLS}), list(ANSWER))
    argument_deltas = [c for chunk in chunks for choice in chunk["choices"]
                       for c in choice["delta"].get("tool_calls") or [] if c["function"].get("arguments")]
    assert len(argument_deltas) > 3  # fragments as they come, not one held-back delta
    assert fold(chunks)[1:] == expected[1:]


def test_without_tools_reasoning_still_has_its_field_and_plain_answers_are_untouched():
    answer = answer_for({})
    answer.add(outputs("<think>2 + 2</think>\n\n4.", "stop"))
    message = merge_final([answer])["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("2 + 2", "4.") and "tool_calls" not in message
    assert fold(stream(answer_for({"chat_template_kwargs": {}}), list("Just text <b>.")))[:2] == ("Just text <b>.", "")


def test_forced_calls_keep_the_grammar_path():
    answer = answer_for({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert answer.built.wire.params.guided_decoding is not None and answer.parsers == [None]
    chunks = stream(answer, ['{"city": ', '"Paris"}'])
    assert fold(chunks)[2] == [("get_weather", '{"city": "Paris"}')]
