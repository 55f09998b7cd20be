"""Tool calling at the OpenAI chat door: the plan, its grammar, the prompt and the parsers."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda.engine.guided.params import GuidedDecodingParams
from pagoda.fleet.api.openai_io import OpenAIError, build_chat_request
from pagoda.fleet.api.openai_protocol import ChatCompletionRequest, parse
from pagoda.fleet.api.openai_tools import ToolPlan, finish_reason, parse_answer, tool_plan_from_body
from pagoda.fleet.parsers import tool_calls
from pagoda.fleet.parsers.events import Parsed
from pagoda.fleet.parsers.output import OutputParser, ParserChoice
from pagoda.models.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 2 days?"}]


def tools_of(body):
    """``tool_plan_from_body`` on the body validated as the chat door validates it."""
    return tool_plan_from_body(parse(ChatCompletionRequest, {"messages": MESSAGES, **body}), OpenAIError)


def plan(**body):
    return tools_of({"tools": [WEATHER, TIME], **body})


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function"}]}, "tools[0].function: required"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]},
     "tools[0].function.paramters: unknown parameter"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": "x"}, "tools: input should be a valid list"),
    ({"tool_choice": "auto"}, "tool_choice: needs tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice: must be none, auto, required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "no tool is named 'nope'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_refused_naming_the_field(body, message):
    with pytest.raises(OpenAIError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tools_of(body)


def test_forced_calls_are_grammars_that_every_valid_answer_satisfies():
    named = plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.guided() == {"json": WEATHER["function"]["parameters"]}
    required = plan(tool_choice="required", parallel_tool_calls=False)
    schema = required.guided()["json"]
    GuidedDecodingParams.from_dict(required.guided())  # the engine accepts it
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"zone": "PST"}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {"zone": "UTC"}}] * 2):  # maxItems 1: not parallel
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert plan().guided() is None and plan(tool_choice="none").active is False
    assert tools_of({"tools": []}) is None


def test_answers_parse_into_calls_and_finish_reasons():
    named = plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, [call] = parse_answer(' {"city": "Paris", "days": 2}', named)
    assert content is None and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    assert finish_reason("stop", named, [call]) == "stop" and finish_reason("length", named, [call]) == "length"
    required = plan(tool_choice="required")
    _, calls = parse_answer('[{"name": "get_time", "parameters": {"zone": "CET"}}]', required)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "CET"}]
    assert finish_reason("stop", required, calls) == "tool_calls"
    assert parse_answer('[{"name": "get_ti', required) == ('[{"name": "get_ti', [])  # cut short
    auto = plan()
    cases = {
        "hermes": 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        "llama3_json": '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
    }
    def auto_answer(text, parser):  # an auto answer is read by fleet.parsers
        reader = OutputParser(ParserChoice(None, parser), auto.tools)
        return Parsed().add(reader.feed(text) + reader.finish())

    for parser, text in cases.items():
        calls = auto_answer(text, parser).calls
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})], parser
    assert auto_answer(cases["hermes"], "hermes").content.strip() == "Sure."
    assert auto_answer("It is sunny.", "hermes").content == "It is sunny."
    assert auto_answer("<tool_call>{not json</tool_call>", "hermes").content == "<tool_call>{not json</tool_call>"
    assert finish_reason("stop", auto, []) == "stop"


def test_parser_is_detected_from_the_chat_template():
    assert tool_calls.detect("{{ '<tool_call>' }}") == "hermes"
    assert tool_calls.detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_calls.detect("{% if m.role == 'ipython' %}<|python_tag|>{% endif %}") == "llama3_json"
    assert tool_calls.detect(None) == "hermes"


def test_the_default_models_template_gets_the_tools_in_a_system_message(smollm2_path):
    tokenizer = Tokenizer.from_pretrained(str(smollm2_path))
    built = build_chat_request({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}, tokenizer)
    # SmolLM2's template ignores tools, so pagoda describes them itself (Hermes' format).
    assert "<tools>" in built.prompt and '"get_weather"' in built.prompt and "<tool_call>" in built.prompt
    assert built.prompt.endswith("<|im_start|>assistant\n")
    assert json.loads(built.wire.params.guided_decoding.json)["minItems"] == 1
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = build_chat_request({"messages": history, "tools": [WEATHER]}, tokenizer).prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>" in prompt
    with pytest.raises(OpenAIError, match="forced tool call is an output format"):
        build_chat_request({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
                            "response_format": {"type": "json_object"}}, tokenizer)


def test_a_template_that_renders_tools_renders_them_itself(smollm2_path):
    tokenizer = Tokenizer.from_pretrained(str(smollm2_path))
    tokenizer.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                               "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]")
    built = build_chat_request({"messages": MESSAGES, "tools": [WEATHER, TIME]}, tokenizer)
    assert built.prompt == "TOOLS:get_weather;get_time;[user]Weather in Paris for 2 days?[assistant]"
