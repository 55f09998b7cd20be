"""What a model's output means to an agent, as a stream of events: text, reasoning, tool calls.

Every parser of this room (``reasoning``, ``tool_calls``, ``harmony``) turns the model's text
into these events, streamed: ``feed(delta)`` returns the events the new text completes and
``finish()`` the rest. The doors render them in their API's shapes (chat deltas, Responses'
events, Messages' blocks); ``Parsed`` folds them into one answer.

Invariant (tests/fleet/test_parsers.py, every format, the text split at every character
boundary): the events of a streamed text fold to the same ``Parsed`` as the whole text's,
and a call's ``CallArguments`` texts concatenate to its final ``arguments``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Iterable, Union


@dataclass(frozen=True)
class Content:
    """Answer text."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """The model's thinking (chat's ``reasoning``, Responses' reasoning items, Messages' thinking blocks)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its index among the answer's calls, its id and the function's name."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A fragment of call ``index``'s arguments (JSON text, as the model writes it)."""

    index: int
    text: str


Event = Union[Content, Reasoning, CallStart, CallArguments]


def new_call_id() -> str:
    """An OpenAI-style call id (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class Parsed:
    """An answer folded from its events: text, reasoning, calls in order."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: Iterable[Event]) -> "Parsed":
        for event in events:
            if isinstance(event, Content):
                self.content += event.text
            elif isinstance(event, Reasoning):
                self.reasoning += event.text
            elif isinstance(event, CallStart):
                assert event.index == len(self.calls), f"call {event.index} starts out of order"
                self.calls.append(ToolCall(event.call_id, event.name))
            else:
                self.calls[event.index].arguments += event.text
        return self

    def same_as(self, other: "Parsed") -> bool:
        """Equal but for the calls' ids (each parse makes its own)."""
        return (self.content, self.reasoning, [(c.name, c.arguments) for c in self.calls]) == \
            (other.content, other.reasoning, [(c.name, c.arguments) for c in other.calls])


def held_back(buffer: str, markers: Iterable[str]) -> int:
    """How many characters at the end of ``buffer`` might be the start of one of ``markers``
    (a tag split across two deltas): they wait for the next delta."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if marker.startswith(buffer[-size:]):
                longest = size
                break
    return longest
