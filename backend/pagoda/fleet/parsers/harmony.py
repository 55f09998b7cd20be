"""gpt-oss's harmony format: reasoning, answer and tool calls as channels of one output, streamed.

A harmony answer is a run of messages, each a header and a body:
``<|start|>assistant<|channel|>analysis<|message|>...<|end|>`` (the first message's
``<|start|>assistant`` is the generation prompt's). The header's channel says what the body is:
``analysis`` is ``Reasoning``; ``final`` is ``Content``; ``commentary`` with a recipient
``to=functions.NAME`` (in the header, before or after the channel; ``<|constrain|>json``
may follow) is a tool call whose arguments are the body, as written; ``commentary`` without a
recipient (a preamble to the user) is ``Content``. A body ends at ``<|end|>``, ``<|call|>``
or ``<|return|>``, or at the answer's end (the stop tokens may be cut from the text).

The special tokens must be in the text: a door asks the replica for gpt-oss answers with
``skip_special_tokens`` false. An answer with no harmony header (they were skipped, or the
model did not use them) is all ``Content``.
"""

from __future__ import annotations

import re
from typing import Optional

from pagoda.fleet.parsers.events import CallArguments, CallStart, Content, Event, Reasoning, held_back, new_call_id

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser:
    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self._buffer = ""
        self._state = "header"  # header | body | plain
        self._kind = "content"  # the body's: reasoning | content | call
        self._num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._buffer and getattr(self, f"_{self._state}")(events):
            pass
        return events

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        if self._state == "body":
            return [self._body_event(rest)]
        if self._state == "plain":
            return [Content(rest)]
        return [] if rest.lstrip().startswith("<|") else [Content(rest)]  # a header cut short is nothing

    def _header(self, events: list[Event]) -> bool:
        head = self._buffer.lstrip()
        if head and not head.startswith("<|") and not "<|".startswith(head[:2]):
            self._state = "plain"  # no harmony headers: all of it is text
            return True
        at = self._buffer.find(MESSAGE)
        if at < 0:
            return False
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE):]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            self._kind = "call"
            events.append(CallStart(self._num_calls, new_call_id(), recipient.group(1)))
            self._num_calls += 1
        else:
            self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        self._state = "body"
        return True

    def _body(self, events: list[Event]) -> bool:
        ends = [(self._buffer.find(end), end) for end in ENDS if end in self._buffer]
        if ends:
            at, end = min(ends)
            if at:
                events.append(self._body_event(self._buffer[:at]))
            self._buffer, self._state = self._buffer[at + len(end):], "header"
            return True
        keep = held_back(self._buffer, ENDS)
        if len(self._buffer) > keep:
            events.append(self._body_event(self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _plain(self, events: list[Event]) -> bool:
        events.append(Content(self._buffer))
        self._buffer = ""
        return False

    def _body_event(self, text: str) -> Event:
        if self._kind == "call":
            return CallArguments(self._num_calls - 1, text)
        return Reasoning(text) if self._kind == "reasoning" else Content(text)
