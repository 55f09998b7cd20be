"""The Responses and Messages doors without a replica: their bodies made chat turns, and a Qwen3-like
answer (``<think>`` then a Hermes call) rendered as each API's items and stream events, split at
every character boundary, each event validated by the official SDK's types; the stream folds to
the unstreamed answer. Stored turns are per tenant and expire (memory, and a real Redis)."""

from __future__ import annotations

import json
import re

import pytest

from pagoda.fleet.api.agent_turn import TurnUpdate, TurnUsage
from pagoda.fleet.api.messages_protocol import MessagesRequest
from pagoda.fleet.api.messages_protocol import to_chat_body as messages_chat_body
from pagoda.fleet.api.messages_render import MessageRender
from pagoda.fleet.api.openai_protocol import OpenAIError, parse
from pagoda.fleet.api.response_store import MemoryResponseStore, RedisResponseStore
from pagoda.fleet.api.responses_protocol import ResponsesRequest, to_chat_body
from pagoda.fleet.api.responses_render import ResponseRender
from pagoda.fleet.parsers.output import OutputParser, ParserChoice

pydantic = pytest.importorskip("pydantic")
responses_types = pytest.importorskip("openai.types.responses")
anthropic_types = pytest.importorskip("anthropic.types")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ANSWER = ('<think>\nWeather needs the tool.\n</think>\n\nChecking.<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
USAGE = TurnUsage(prompt_tokens=12, completion_tokens=30, cached_tokens=0)


def updates(pieces, reason="stop", stop=None):
    parser = OutputParser(ParserChoice("qwen3", "hermes"), TOOLS)
    out = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out.append(TurnUpdate(parser.feed(piece) + (parser.finish() if last else []), reason if last else None,
                              stop if last else None))
    return out


def event_types(union):
    """An SDK's stream-event union as ``{type: its model}`` (each event checked by its own type)."""
    from typing import get_args

    members = get_args(union)
    members = get_args(members[0]) if len(members) and get_args(members[0]) else members
    return {get_args(m.model_fields["type"].annotation)[0]: m for m in members if hasattr(m, "model_fields")}


def validate_events(union, events):
    types = event_types(union)
    for event in events:
        types[event["type"]].model_validate(event)


def splits(text):
    yield [text]
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]
    yield list(text)


# ---------------------------------------------------------------- Responses
def test_responses_input_items_become_chat_messages():
    request = parse(ResponsesRequest, {"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "developer", "content": "Use Celsius."}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}})
    body = to_chat_body(request, [{"role": "user", "content": "earlier"}])
    assert [m["role"] for m in body["messages"]] == ["user", "system", "user", "assistant", "tool", "system"]
    assert [c["id"] for c in body["messages"][3]["tool_calls"]] == ["c1", "c2"]  # consecutive calls: one message
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["max_tokens"] == 7 and body["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("body, field", [
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "file_search"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "bogus": 1}, "bogus"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "role"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_responses_bad_bodies_name_the_field(body, field):
    with pytest.raises(OpenAIError, match=field.replace(".", r"\.")):
        to_chat_body(parse(ResponsesRequest, body), [])


def fold_response(events):
    """A streamed response as a client folds it: the output items from the deltas."""
    items = {}
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            items[event["output_index"]] = dict(event["item"], text="")
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[event["output_index"]]["text"] += event["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[event["output_index"]]["arguments"] += event["delta"]
    return [(i["type"], i.get("name"), i.get("arguments") or i["text"]) for _, i in sorted(items.items())]


def test_a_streamed_response_validates_and_folds_to_the_whole_one():
    request = parse(ResponsesRequest, {"input": "Weather in Paris?", "tools": [
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]})
    whole = None
    for pieces in splits(ANSWER):
        render = ResponseRender("resp_1", "m", request)
        events = render.start() + [e for u in updates(pieces) for e in render.feed(u)] + render.finish("stop", USAGE)
        validate_events(responses_types.ResponseStreamEvent, events)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        response = responses_types.Response.model_validate(events[-1]["response"])
        got = [(i.type, getattr(i, "name", None), getattr(i, "arguments", None) or
                (i.content[0].text if i.content else "")) for i in response.output]
        assert got == fold_response(events)
        whole = whole or got
        assert got == whole
    assert whole == [("reasoning", None, "\nWeather needs the tool.\n"), ("message", None, "Checking."),
                     ("function_call", "get_weather", '{"city": "Paris"}')]


def test_a_response_cut_by_its_length_is_incomplete():
    render = ResponseRender("resp_2", "m", parse(ResponsesRequest, {"input": "hi"}))
    final = render.finish("length", USAGE)[-1]
    assert final["type"] == "response.incomplete"
    response = responses_types.Response.model_validate(final["response"])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.asyncio
async def test_stored_turns_are_per_tenant_and_expire():
    now = [0.0]
    store = MemoryResponseStore(ttl_s=10, max_entries=2, clock=lambda: now[0])
    await store.put("a", "resp_1", [{"role": "user", "content": "x"}])
    assert await store.get("a", "resp_1") == [{"role": "user", "content": "x"}]
    assert await store.get("b", "resp_1") is None
    now[0] = 11
    assert await store.get("a", "resp_1") is None
    for k in range(3):
        await store.put("a", f"resp_{k}", [])
    assert await store.get("a", "resp_0") is None and await store.get("a", "resp_2") == []  # the oldest dropped


@pytest.mark.asyncio
async def test_redis_keeps_stored_turns_per_tenant_with_a_ttl(redis_client):
    store = RedisResponseStore(redis_client, "smol", ttl_s=30)
    await store.put("tenant-a", "resp_1", [{"role": "user", "content": "x"}])
    assert await store.get("tenant-a", "resp_1") == [{"role": "user", "content": "x"}]
    assert await store.get("tenant-b", "resp_1") is None
    assert 0 < redis_client.pttl("pagoda:smol:response:tenant-a:resp_1") <= 30_000


# ---------------------------------------------------------------- Messages
def test_message_blocks_become_chat_messages():
    request = parse(MessagesRequest, {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Sys"}],
                                      "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 2048},
                                      "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                                      "tool_choice": {"type": "any"}, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"c": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "down"}]}]}]})
    body = messages_chat_body(request)
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
    assert body["messages"][2]["content"] == "Let me check."  # the thinking is not written back
    assert json.loads(body["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"c": 1}
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "Error: down"}
    assert body["tool_choice"] == "required" and body["stop"] == ["END"] and body["max_tokens"] == 9
    assert body["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]}, "document blocks are not served"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
])
def test_messages_bad_bodies_name_the_field(body, field):
    with pytest.raises(OpenAIError, match=field):
        messages_chat_body(parse(MessagesRequest, {"model": "m", **body}))


def test_image_blocks_and_input_image_parts_become_chat_image_url_parts():
    """Both doors translate images into chat's ``image_url`` parts in place, the text around them kept."""
    png = "iVBORw0KGgo="  # any base64: the bytes are checked as an image by the engine
    request = parse(MessagesRequest, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "A"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                     "data": png}},
        {"type": "image", "source": {"type": "url", "url": "data:image/jpeg;base64," + png}}]}]})
    assert messages_chat_body(request)["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "A"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + png}}]}]
    responses = parse(ResponsesRequest, {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64," + png, "detail": "low"},
        {"type": "input_text", "text": "B"}]}]})
    assert to_chat_body(responses, [])["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}}, {"type": "text", "text": "B"}]}]
    with pytest.raises(OpenAIError, match=re.escape("input[0].content[0]: input_image parts are taken in user")):
        to_chat_body(parse(ResponsesRequest, {"input": [{"role": "system", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + png}]}]}), [])


def fold_message(events):
    blocks = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"], partial="")
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            block["thinking" if delta["type"] == "thinking_delta" else "text" if delta["type"] == "text_delta"
                  else "partial" if delta["type"] == "input_json_delta" else "signature"] += \
                delta.get("thinking") or delta.get("text") or delta.get("partial_json") or delta.get("signature", "")
    for block in blocks.values():
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial"])
        block.pop("partial")
    return [blocks[k] for k in sorted(blocks)]


def test_a_streamed_message_validates_and_folds_to_the_whole_one():
    for pieces in splits(ANSWER):
        stream, whole = MessageRender("msg_1", "m"), MessageRender("msg_1", "m")
        turn = updates(pieces)
        events = stream.start(USAGE) + [e for u in turn for e in stream.feed(u)] + stream.finish(turn[-1], USAGE)
        validate_events(anthropic_types.RawMessageStreamEvent, events)
        for update in turn:
            whole.feed(update)
        message = anthropic_types.Message.model_validate(whole.message(turn[-1], USAGE))
        assert message.stop_reason == "tool_use" and events[-2]["delta"]["stop_reason"] == "tool_use"
        assert fold_message(events) == [b.model_dump(exclude_none=True) for b in message.content]
        assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
            ("thinking", None), ("text", None), ("tool_use", {"city": "Paris"})]


def test_a_messages_stop_reason_says_why_it_ended():
    render = MessageRender("msg_2", "m", ["END"])
    assert render.stop_reason(TurnUpdate([], "stop", "END")) == ("stop_sequence", "END")
    assert render.stop_reason(TurnUpdate([], "length")) == ("max_tokens", None)
    assert render.stop_reason(TurnUpdate([], "stop", "2")) == ("end_turn", None)  # an EOS token id


def test_a_call_forced_by_grammar_is_read_whole_at_the_end():
    """``tool_choice`` required / a named tool: the grammar wrote JSON, read as chat reads it."""
    from pagoda.fleet.api.agent_turn import AgentTurn
    from pagoda.fleet.api.openai_io import build_chat_request
    from tests.fleet.test_openai_agent_answers import QwenLikeTokenizer

    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": "required"}
    turn = AgentTurn(None, build_chat_request(body, QwenLikeTokenizer()), "responses")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert turn._update({"text_output": [text[:10]], "finish_reason": [""]}).events == []
    events = turn._update({"text_output": [text[10:]], "finish_reason": ["stop"]}).events
    render = ResponseRender("resp_3", "m", parse(ResponsesRequest, {"input": "Weather?"}))
    render.feed(TurnUpdate(events, "stop"))
    item = responses_types.Response.model_validate(render.finish("stop", USAGE)[-1]["response"]).output[0]
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", {"city": "Oslo"})
