"""What agents speak, against `pagoda serve` alone and through `pagoda router`: OpenAI's Responses
API (the openai SDK) and Anthropic's Messages API (the anthropic SDK), each answer and each
stream event validated by the SDK's own types.

The default model (SmolLM2-135M) is a tiny model with no tool format of its own: each turn is
forced by a regex (``guided_regex``, vLLM's structured-output extra) to write what a Qwen3
model writes — a ``<think>`` block, then a Hermes ``<tool_call>`` — and the door's parsers
(``--reasoning-parser qwen3 --tool-call-parser hermes``) must read it back into the API's
reasoning and function-call items, so the tool loops below are real multi-turn loops through a
real model. The router in front keeps Responses turns in Redis (``--response-store``) and has
API keys for two tenants: the anthropic SDK sends its key as ``x-api-key``; one tenant cannot
continue the other's response.
"""

from __future__ import annotations

import json

import pytest

from pagoda.fleet.service import BackgroundRouter, RouterOptions
from tests.fleet.conftest import redis_server  # noqa: F401 (a fixture)
from tests.fleet.test_agent_apis import validate_events

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.server

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "sk-agents-a-41d2", "sk-agents-b-7c0e"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city", "days"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
THINK_THEN_CALL = r"<think>\nThe user wants the weather\.\n</think>\n\n<tool_call>\n" + \
    CALL.replace("{", r"\{").replace("}", r"\}") + r"\n</tool_call>"
ANSWER = "It is sunny in Paris for 2 days."
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def router(openai_serve, redis_server, tmp_path_factory, smollm2_path):  # noqa: F811
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    http, grpc, metrics = (f"127.0.0.1:{port}" for port in openai_serve.ports)
    options = RouterOptions(model_dir=smollm2_path, replicas=f"id=local,grpc={grpc},http={http},metrics={metrics}",
                            host="127.0.0.1", http_port=0, grpc_port=None, health_interval_s=0.5,
                            api_keys_file=str(keys), redis_url=redis_server.url, response_store=True,
                            response_store_ttl_s=600, reasoning_parser="qwen3", tool_call_parser="hermes")
    with BackgroundRouter(options) as background:
        yield background


@pytest.fixture(params=["serve", "router"])
def where(request, openai_serve):
    """(base URL, API key): the replica's own OpenAI door, or the router with tenant A's key."""
    if request.param == "serve":
        return f"http://127.0.0.1:{openai_serve.openai_port}", "unused"
    return f"http://{request.getfixturevalue('router').http_url}", KEY_A


def openai_client(where, key=None):
    return openai.OpenAI(base_url=f"{where[0]}/v1", api_key=key or where[1], max_retries=0, timeout=TIMEOUT_S)


def anthropic_client(where, key=None):
    return anthropic.Anthropic(base_url=where[0], api_key=key or where[1], max_retries=0, timeout=TIMEOUT_S)


def regex(pattern):
    return {"guided_regex": pattern}


# ---------------------------------------------------------------- chat completions
def test_chat_streams_reasoning_and_call_fragments_then_answers_the_tool(where):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = openai_client(where)
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    messages = [{"role": "user", "content": "What will the weather be in Paris?"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=80,
                                                 stream=True, extra_body=regex(THINK_THEN_CALL)))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.to_dict())
    deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    fragments = [call.function.arguments for d in deltas for call in d.tool_calls or [] if call.function.arguments]
    assert reasoning.strip() == "The user wants the weather." and len(fragments) > 1
    assert json.loads("".join(fragments)) == {"city": "Paris", "days": 2}
    first = [call for d in deltas for call in d.tool_calls or [] if call.id][0]
    assert first.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    call = {"id": first.id, "type": "function", "function": {"name": "get_weather", "arguments": "".join(fragments)}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": first.id, "content": "sunny, 24 C"}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=tools, max_tokens=30,
                                                           extra_body=regex(r"It is sunny in Paris for 2 days\."))
    answer = ChatCompletion.model_validate(raw.http_response.json())
    assert answer.choices[0].message.content == ANSWER and answer.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- the Responses API
def test_responses_tool_loop_with_reasoning_streamed_and_stored(where):
    from openai.types.responses import Response, ResponseStreamEvent

    client = openai_client(where)
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="What will the weather be in Paris?", instructions="You are a weather assistant.",
        tools=[WEATHER], temperature=0, max_output_tokens=80, extra_body=regex(THINK_THEN_CALL))
    first = Response.model_validate(raw.http_response.json())
    assert first.status == "completed" and [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text.strip() == "The user wants the weather."
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 10

    # The tool's answer goes back as a function_call_output, continuing the stored turn.
    events = list(client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}], stream=True,
        extra_body=regex(r"It is sunny in Paris for 2 days\.")))
    validate_events(ResponseStreamEvent, [event.to_dict() for event in events])
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    second = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    # The stored conversation was in the prompt: more input than the first turn had.
    assert second.usage.input_tokens > first.usage.input_tokens


def test_responses_loop_without_the_store_streams_the_call(where):
    """The client sends the whole conversation back (stateless), and the call's arguments stream."""
    from openai.types.responses import ResponseStreamEvent

    client = openai_client(where)
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                          max_output_tokens=80, store=False, stream=True,
                                          extra_body=regex(THINK_THEN_CALL)))
    validate_events(ResponseStreamEvent, [event.to_dict() for event in events])
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == {"city": "Paris", "days": 2}
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_weather"
    call = [item for item in events[-1].response.output if item.type == "function_call"][0]
    answer = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=30, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        extra_body=regex(r"It is sunny in Paris for 2 days\."))
    assert answer.output_text == ANSWER
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=events[-1].response.id,
                                max_output_tokens=2)


def test_responses_bad_input_names_the_field(where):
    client = openai_client(where)
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=0)
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")


def test_a_tenant_cannot_continue_another_tenants_response(router):
    where = (f"http://{router.http_url}", KEY_A)
    first = openai_client(where).responses.create(model=MODEL, input="Hello", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError, match="not this tenant's"):
        openai_client(where, KEY_B).responses.create(model=MODEL, input="Go on.", previous_response_id=first.id,
                                                     max_output_tokens=2)
    stored = [key for key in router.service._redis.scan_iter("pagoda:*:response:*")]
    assert any(first.id in key.decode() for key in stored)
    assert 0 < router.service._redis.pttl(stored[0]) <= 600_000


# ---------------------------------------------------------------- the Messages API
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather forecast for a city",
                  "input_schema": WEATHER["parameters"]}


def test_messages_tool_loop_with_thinking_streamed(where):
    from anthropic.types import Message, RawMessageStreamEvent

    client = anthropic_client(where)
    messages = [{"role": "user", "content": "What will the weather be in Paris?"}]
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=80, messages=messages, tools=[ANTHROPIC_TOOL], system="You are a weather assistant.",
        thinking={"type": "adaptive"}, extra_body=regex(THINK_THEN_CALL))
    first = Message.model_validate(raw.http_response.json())
    assert [block.type for block in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    assert first.content[0].thinking.strip() == "The user wants the weather."
    use = first.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 2}

    messages += [{"role": "assistant", "content": first.content},  # as Anthropic's docs write it back
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "sunny, 24 C"}]}]
    with client.messages.stream(model=MODEL, max_tokens=30, messages=messages, tools=[ANTHROPIC_TOOL],
                                extra_body=regex(r"It is sunny in Paris for 2 days\.")) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw_events = [event for event in events if event.type in (
        "message_start", "message_delta", "message_stop", "content_block_start", "content_block_delta",
        "content_block_stop")]
    validate_events(RawMessageStreamEvent, [event.to_dict() for event in raw_events])
    assert raw_events[0].type == "message_start" and raw_events[-1].type == "message_stop"
    assert [block.type for block in final.content] == ["text"] and final.content[0].text == ANSWER
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    assert final.usage.input_tokens > first.usage.input_tokens


def test_a_named_tool_is_forced_by_grammar_on_both_apis(where):
    """``tool_choice`` naming a tool: the grammar writes its arguments, read back as the API's call."""
    from anthropic.types import Message
    from openai.types.responses import Response

    raw = anthropic_client(where).messages.with_raw_response.create(
        model=MODEL, max_tokens=40, tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}])
    message = Message.model_validate(raw.http_response.json())
    assert [b.type for b in message.content] == ["tool_use"] and message.stop_reason == "tool_use"
    assert message.content[0].name == "get_weather" and set(message.content[0].input) == {"city", "days"}
    raw = openai_client(where).responses.with_raw_response.create(
        model=MODEL, input="Weather in Oslo for 3 days?", tools=[WEATHER], max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"})
    [call] = Response.model_validate(raw.http_response.json()).output
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"city", "days"}


def test_messages_stop_sequences_and_count_tokens(where):
    client = anthropic_client(where)
    messages = [{"role": "user", "content": "Say something about Paris."}]
    answer = client.messages.create(model=MODEL, max_tokens=30, messages=messages, stop_sequences=["lovely"],
                                    extra_body=regex(r"Paris is lovely in spring\."))
    assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == "lovely"
    assert answer.content[0].text == "Paris is "
    counted = client.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == answer.usage.input_tokens
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=messages)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_messages_errors_are_anthropics_shape(where):
    client = anthropic_client(where)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="chat template cannot render image parts"):  # a text model
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    with pytest.raises(anthropic.NotFoundError, match="claude-opus"):
        client.messages.create(model="claude-opus", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])


def test_the_router_takes_x_api_key_and_refuses_a_bad_one(router):
    where = (f"http://{router.http_url}", KEY_A)
    assert anthropic_client(where).messages.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}]).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic_client(where, "sk-wrong").messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "Hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
