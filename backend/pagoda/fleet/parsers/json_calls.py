"""Tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``), read as they stream.

Three formats write each call as such an object: Hermes (inside ``<tool_call>`` tags), Llama 3
(``;``-separated objects after an optional ``<|python_tag|>``) and Mistral (a JSON array after
``[TOOL_CALLS]``). ``CallObject`` reads one of them from a growing buffer: once the object's
head (``{"name": "get_weather", "arguments": ``) has arrived the call starts, and its
``arguments`` value is passed on as the model writes it, fragment by fragment, until the value
is complete; the object is done when its closing brace arrives. The arguments are the model's
own JSON text of the value (not re-serialized), so a streamed call's fragments concatenate to
exactly the unstreamed call's ``arguments``. Keys in the other order (``arguments`` first) or
``parameters`` for ``arguments`` (Llama 3) work; the call then starts when the object is whole.

``json_value_end`` finds where a JSON value ends without parsing it (strings and escapes
respected), or says that it has not ended yet.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from pagoda.fleet.parsers.events import CallArguments, CallStart, Event, new_call_id

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.DOTALL)
_OPENERS = {"{": "}", "[": "]"}


def json_value_end(text: str, start: int) -> Optional[int]:
    """The index just past the JSON value that begins at ``text[start]`` (after whitespace), or
    ``None`` when the text ends before the value does. Scalars end at a delimiter."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in _OPENERS:
        match = re.compile(r"[^\s,\]\}]+").match(text, i)
        end = match.end() if match else i
        return end if end < len(text) else None  # a number may go on
    depth, i = 0, i
    while i < len(text):
        char = text[i]
        if char == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _string_end(text: str, start: int) -> Optional[int]:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


class CallObject:
    """One call object read from a growing buffer (module docstring).

    Args:
        index: the call's index among the answer's calls.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.started = False
        self.done = False
        self.end = 0  # with ``done``: where the object ended in the buffer
        self._args_start = 0
        self._emitted = 0  # characters of the arguments value passed on

    def feed(self, buffer: str, whole: bool = False) -> list[Event]:
        """Events for the object at the start of ``buffer`` (the whole text so far; ``whole``: no
        more will come). Raises ValueError when the object is whole and is not a call."""
        events: list[Event] = []
        if self.done:
            return events
        end = json_value_end(buffer, 0)
        if not self.started:
            head = _HEAD.match(buffer)
            if head is not None and head.end() == len(buffer) and not whole:
                return events  # the value has not begun: more white space may come before it
            if head is None and end is None and not whole:
                return events
            if head is None or end is not None:
                return self._whole(buffer, end)
            self.started = True
            self._args_start = head.end()
            events.append(CallStart(self.index, new_call_id(), json.loads(f'"{head.group(1)}"')))
        args_end = json_value_end(buffer, self._args_start)
        upto = args_end if args_end is not None else len(buffer)
        if upto > self._args_start + self._emitted:
            events.append(CallArguments(self.index, buffer[self._args_start + self._emitted:upto]))
            self._emitted = upto - self._args_start
        if end is not None:
            self.done, self.end = True, end
        return events

    def _whole(self, buffer: str, end: Optional[int]) -> list[Event]:
        """The object arrived whole (or never will): a call, or ValueError."""
        if end is None:
            raise ValueError("the call object never ends")
        value = json.loads(buffer[:end])
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError("not a call object")
        key = "arguments" if "arguments" in value else "parameters"
        arguments = _value_text(buffer[:end], key) if key in value else "{}"
        self.started, self.done, self.end = True, True, end
        return [CallStart(self.index, new_call_id(), value["name"]), CallArguments(self.index, arguments)]


def _value_text(object_text: str, key: str) -> str:
    """The raw JSON text of ``key``'s value in a whole object (as the model wrote it)."""
    for match in re.finditer(rf'"{key}"\s*:\s*', object_text):
        end = json_value_end(object_text, match.end())
        if end is not None:
            return object_text[match.end():end]
    return "{}"
