"""A Messages API answer from one agent turn's updates: content blocks, SSE events, the message.

``MessageRender.feed(update)`` turns the parser's events into content blocks in the order the
model wrote them: a ``thinking`` block (its ``signature`` empty: pagoda signs nothing), a
``text`` block, a ``tool_use`` block per call (its ``input`` the call's arguments, as an object),
and returns the stream events: ``content_block_start`` when a block begins, its deltas
(``thinking_delta``, ``text_delta``, ``input_json_delta``), ``content_block_stop`` when the next
block begins or the turn ends. ``start`` gives ``message_start``; ``finish`` gives
``message_delta`` (the stop reason and the output tokens) and ``message_stop``.

``stop_reason``: ``tool_use`` when the answer called a tool, ``max_tokens`` when its length cut
it, ``stop_sequence`` (and ``stop_sequence``) when one of the request's stop sequences ended it,
else ``end_turn``. A call whose arguments are not a JSON object keeps them as text under
``input._arguments`` rather than failing the answer.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pagoda.fleet.api.agent_turn import TurnUpdate, TurnUsage
from pagoda.fleet.parsers.events import CallArguments, CallStart, Content, Event, Reasoning


class MessageRender:
    """Args:
    message_id: ``msg_...``.
    model: the model name the request named.
    stop_sequences: the request's (to tell ``stop_sequence`` from ``end_turn``).
    """

    def __init__(self, message_id: str, model: str, stop_sequences: Optional[list[str]] = None) -> None:
        self.message_id = message_id
        self.model = model
        self.stop_sequences = stop_sequences or []
        self.blocks: list[dict] = []
        self._arguments: dict[int, str] = {}  # tool_use block index -> its arguments' JSON text
        self._open: Optional[int] = None

    def start(self, usage: TurnUsage) -> list[dict]:
        return [{"type": "message_start", "message": {**self._message([], None, None, usage), "content": []}}]

    def feed(self, update: TurnUpdate) -> list[dict]:
        events: list[dict] = []
        for event in update.events:
            events += self._apply(event)
        return events

    def finish(self, update: TurnUpdate, usage: TurnUsage) -> list[dict]:
        """``content_block_stop`` of the open block, ``message_delta`` and ``message_stop``."""
        reason, sequence = self.stop_reason(update)
        events = self._close()
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": {"output_tokens": usage.completion_tokens}}, {"type": "message_stop"}]

    def stop_reason(self, update: TurnUpdate) -> tuple[str, Optional[str]]:
        if any(block["type"] == "tool_use" for block in self.blocks):
            return "tool_use", None
        if update.finish_reason == "length":
            return "max_tokens", None
        if update.stop_reason in self.stop_sequences:
            return "stop_sequence", update.stop_reason
        return "end_turn", None

    def message(self, update: TurnUpdate, usage: TurnUsage) -> dict:
        """The whole message (non-streamed answers)."""
        self._close()
        reason, sequence = self.stop_reason(update)
        return self._message(self.blocks, reason, sequence, usage)

    def _message(self, blocks: list[dict], reason: Optional[str], sequence: Optional[str], usage: TurnUsage) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": [dict(block) for block in blocks], "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                          "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}}

    def _apply(self, event: Event) -> list[dict]:
        kind = "thinking" if isinstance(event, Reasoning) else "text" if isinstance(event, Content) else "tool_use"
        events: list[dict] = []
        if isinstance(event, CallStart) or self._open is None or self.blocks[self._open]["type"] != kind:
            events += self._close() + self._begin(kind, event)
        index, block = self._open, self.blocks[self._open]
        if isinstance(event, Reasoning):
            block["thinking"] += event.text
            events.append(_delta(index, {"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, Content):
            block["text"] += event.text
            events.append(_delta(index, {"type": "text_delta", "text": event.text}))
        elif isinstance(event, CallArguments) and event.text:
            self._arguments[index] = self._arguments.get(index, "") + event.text
            events.append(_delta(index, {"type": "input_json_delta", "partial_json": event.text}))
        return events

    def _begin(self, kind: str, event: Event) -> list[dict]:
        if kind == "thinking":
            block: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == "text":
            block = {"type": "text", "text": ""}
        else:
            call = event if isinstance(event, CallStart) else None
            block = {"type": "tool_use", "id": "toolu_" + (call.call_id.removeprefix("call_") if call else "0"),
                     "name": call.name if call else "", "input": {}}
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        index, self._open = self._open, None
        if index is None:
            return []
        block = self.blocks[index]
        if block["type"] == "tool_use":
            block["input"] = _input(self._arguments.get(index, ""))
        events = [_delta(index, {"type": "signature_delta", "signature": ""})] if block["type"] == "thinking" else []
        return events + [{"type": "content_block_stop", "index": index}]


def _delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _input(arguments: str) -> dict:
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_arguments": arguments}
    return value if isinstance(value, dict) else {"_arguments": arguments}
