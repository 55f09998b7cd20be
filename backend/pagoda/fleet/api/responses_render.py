"""A Responses API answer from one agent turn's updates: output items, typed stream events, the response.

``ResponseRender.feed(update)`` turns the parser's events into output items, in the order the
model wrote them (a ``reasoning`` item, a ``message`` with one ``output_text`` part, a
``function_call`` item per call), and returns the stream events that say so: an item is
``output_item.added`` when it begins, gets its deltas (``reasoning_text.delta``,
``output_text.delta``, ``function_call_arguments.delta``), and is closed (``*.done``,
``output_item.done``) when the next item begins or the turn ends. ``start`` gives
``response.created`` / ``response.in_progress``; ``finish`` closes the open item and gives
``response.completed`` with the whole ``response``, the object a non-streamed request gets.

Status: ``completed``, or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``
when the turn was cut by its length. Every event carries a ``sequence_number`` from 0.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from pagoda.fleet.api.agent_turn import TurnUpdate, TurnUsage
from pagoda.fleet.api.responses_protocol import ResponsesRequest
from pagoda.fleet.parsers.events import CallArguments, CallStart, Content, Event, Reasoning


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseRender:
    """Args:
    response_id: ``resp_...``.
    model: the served model's name.
    request: the turn's request (its settings are echoed in the response, as OpenAI's).
    """

    def __init__(self, response_id: str, model: str, request: ResponsesRequest) -> None:
        self.response_id = response_id
        self.model = model
        self.request = request
        self.created_at = int(time.time())
        self.items: list[dict] = []
        self._open: Optional[dict] = None
        self._sequence = 0

    # ---------------------------------------------------------------- events
    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, update: TurnUpdate) -> list[dict]:
        """The stream events of one update's parser events."""
        events: list[dict] = []
        for event in update.events:
            events += self._apply(event)
        return events

    def finish(self, finish_reason: Optional[str], usage: TurnUsage) -> list[dict]:
        """Close the open item; ``response.completed`` (or ``response.incomplete``) with the response."""
        events = self._close()
        response = self.response("incomplete" if finish_reason == "length" else "completed", usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=response)]

    def _apply(self, event: Event) -> list[dict]:
        kind = "reasoning" if isinstance(event, Reasoning) else "message" if isinstance(event, Content) \
            else "function_call"
        events: list[dict] = []
        if isinstance(event, CallStart) or self._open is None or self._open["type"] != kind:
            events += self._close() + self._begin(kind, event)
        item, index = self._open, len(self.items) - 1
        if isinstance(event, Reasoning):
            item["content"][0]["text"] += event.text
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=event.text))
        elif isinstance(event, Content):
            item["content"][0]["text"] += event.text
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=event.text, logprobs=[]))
        elif isinstance(event, CallArguments) and event.text:
            item["arguments"] += event.text
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=event.text))
        return events

    def _begin(self, kind: str, event: Event) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        elif kind == "message":
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}
        else:
            name = event.name if isinstance(event, CallStart) else ""
            call_id = event.call_id if isinstance(event, CallStart) else _id("call")
            item = {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": "",
                    "status": "in_progress"}
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events = [self._event("response.output_item.added", output_index=index, item=_shown(item))]
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            item["status"] = "completed"
            text = item["content"][0]["text"]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=item["content"][0]))
        else:
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"], name=item["name"]))
        return events + [self._event("response.output_item.done", output_index=index, item=_shown(item))]

    def error(self, code: str, message: str) -> list[dict]:
        """The ``error`` event that ends a stream whose turn failed after it began."""
        return [self._event("error", code=code, message=message, param=None)]

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    # ---------------------------------------------------------------- the response
    def response(self, status: str, usage: Optional[TurnUsage] = None) -> dict:
        """The response object (its ``output`` as written so far)."""
        r = self.request
        text = ({"format": {"type": "text"}} if r.text is None
                else r.text.model_dump(by_alias=True, exclude_none=True))
        response = {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": [_shown(item) for item in self.items],
            "parallel_tool_calls": r.parallel_tool_calls, "tool_choice": _tool_choice(r), "tools": r.tools or [],
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id, "temperature": r.temperature, "top_p": r.top_p,
            "text": text, "metadata": r.metadata or {}, "store": bool(r.store) if r.store is not None else True,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "user": r.user,
        }
        if r.reasoning is not None:
            response["reasoning"] = r.reasoning.model_dump(exclude_none=True)
        if usage is not None:
            reasoning_tokens = 0  # counted with the output: the replica does not split them
            details = {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0}  # writes not counted apart
            response["usage"] = {"input_tokens": usage.prompt_tokens, "input_tokens_details": details,
                                 "output_tokens": usage.completion_tokens,
                                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                                 "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return response


def _shown(item: dict) -> dict:
    """An item as the API shows it (a copy: later deltas do not change events already sent)."""
    return {**item, "content": [dict(part) for part in item["content"]]} if "content" in item else dict(item)


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
