"""Reasoning and tool-call parsers (``fleet.parsers``) on each family's documented output format.

Each answer is parsed whole and streamed split at every character boundary (two pieces) and
one character at a time: the events fold to the same answer (reasoning, text, the calls' names
and arguments), and each call's streamed fragments concatenate to its arguments."""

from __future__ import annotations

import json

import pytest

from pagoda.fleet.parsers.events import CallArguments, CallStart, Parsed
from pagoda.fleet.parsers.output import OutputParser, ParserChoice

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def parse(choice: ParserChoice, pieces: list[str], tools=TOOLS) -> tuple[Parsed, list]:
    parser = OutputParser(choice, tools)
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    return Parsed().add(events), events


def check_streaming(choice: ParserChoice, text: str, tools=TOOLS) -> Parsed:
    whole, _ = parse(choice, [text], tools)
    for cut in range(len(text) + 1):
        split, _ = parse(choice, [text[:cut], text[cut:]], tools)
        assert split.same_as(whole), (cut, split, whole)
    by_char, events = parse(choice, list(text), tools)
    assert by_char.same_as(whole), (by_char, whole)
    started = [e.index for e in events if isinstance(e, CallStart)]
    assert started == list(range(len(whole.calls)))  # each call starts once, in order, before its fragments
    assert all(e.index in started[:e.index + 1] for e in events if isinstance(e, CallArguments))
    return whole


HERMES = ParserChoice("qwen3", "hermes")


def test_qwen3_thinking_then_hermes_calls_in_parallel():
    text = ("<think>\nThe user wants the weather.\n</think>\n\nLet me check.<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {}}\n</tool_call>')
    parsed = check_streaming(HERMES, text)
    assert parsed.reasoning == "\nThe user wants the weather.\n"
    assert parsed.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert parsed.calls[0].arguments == '{"city": "Paris", "days": 2}'  # as the model wrote it


def test_reasoning_without_tools_and_answers_without_reasoning():
    assert check_streaming(HERMES, "<think>2 + 2 = 4</think>\n\nIt is 4.", tools=None).content == "It is 4."
    plain = check_streaming(HERMES, "Hello <there> world", tools=None)
    assert plain.content == "Hello <there> world" and plain.reasoning == ""
    opened = check_streaming(ParserChoice("deepseek_r1", "hermes"), "So 4.</think>The answer is 4.", tools=None)
    assert (opened.reasoning, opened.content) == ("So 4.", "The answer is 4.")
    cut = check_streaming(HERMES, "<think>still thinking when max_tokens ran o", tools=None)
    assert cut.reasoning == "still thinking when max_tokens ran o" and cut.content == ""


def test_qwen3_coder_xml_calls_read_each_value_by_its_type():
    text = ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
            "</parameter>\n</function>\n</tool_call><tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    parsed = check_streaming(ParserChoice(None, "qwen3_coder"), text)
    assert parsed.content.strip() == "I'll look."
    assert json.loads(parsed.calls[0].arguments) == {"city": "New York", "days": 3, "metric": True, "hours": [1, 2]}
    assert parsed.calls[1].name == "get_time" and json.loads(parsed.calls[1].arguments) == {}


def test_llama3_json_and_mistral_calls():
    llama = check_streaming(ParserChoice(None, "llama3_json"),
                            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                            '{"name": "get_time", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in llama.calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_time", {})]
    assert check_streaming(ParserChoice(None, "llama3_json"), "Paris is sunny.").content == "Paris is sunny."
    mistral = check_streaming(ParserChoice(None, "mistral"), 'Sure.[TOOL_CALLS][{"name": "get_weather", '
                              '"arguments": {"city": "Paris"}}, {"name":"get_time","arguments":{}}]')
    assert mistral.content == "Sure." and [c.name for c in mistral.calls] == ["get_weather", "get_time"]
    assert mistral.calls[1].arguments == "{}"


def test_gpt_oss_harmony_channels():
    harmony = ParserChoice("harmony", "harmony")
    call = check_streaming(harmony, "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
                           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                           '{"city":"Paris"}<|call|>')
    assert call.reasoning == "Need the weather tool." and call.content == ""
    assert [(c.name, c.arguments) for c in call.calls] == [("get_weather", '{"city":"Paris"}')]
    final = check_streaming(harmony, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                            "<|message|>It is 4.<|return|>")
    assert (final.reasoning, final.content, final.calls) == ("Easy.", "It is 4.", [])
    assert check_streaming(harmony, "No channels here.").content == "No channels here."


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": oops}</tool_call>',  # not JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    "<tool_call>just words</tool_call>",
])
def test_a_call_that_does_not_parse_is_text_never_an_error(text):
    parsed, _ = parse(HERMES, [text])
    assert parsed.calls == [] and parsed.content == text


def test_a_call_cut_by_max_tokens_is_read_when_whole():
    parsed, _ = parse(HERMES, ['<tool_call>\n{"name": "get_time", "arguments": {}}'])
    assert [c.name for c in parsed.calls] == ["get_time"]
    cut, _ = parse(HERMES, ['<tool_call>\n{"name": "get_time", "argu'])
    assert cut.calls == [] and cut.content.startswith("<tool_call>")


def test_choices_are_detected_from_the_chat_template():
    qwen3 = ParserChoice.detect("{% if enable_thinking %}<think>{% endif %}<tool_call>", "<|im_start|>assistant\n")
    assert (qwen3.reasoning, qwen3.tools) == ("qwen3", "hermes")
    opened = ParserChoice.detect("<think></think><tool_call>", "<|im_start|>assistant\n<think>\n")
    assert opened.reasoning == "deepseek_r1"
    assert ParserChoice.detect("<|channel|>").needs_special_tokens
    coder = ParserChoice.detect("<tool_call><function=x><parameter=y>", reasoning_parser="none")
    assert (coder.reasoning, coder.tools) == (None, "qwen3_coder")
    assert ParserChoice.detect(None, tool_parser="mistral").tools == "mistral"
