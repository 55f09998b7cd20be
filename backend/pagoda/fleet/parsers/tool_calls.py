"""Tool-call parsers for ``tool_choice: "auto"``: each family's own format, read as it streams.

One class per format, each ``feed(delta) -> events`` / ``finish() -> events``
(``parsers.events``); the text around the calls is ``Content``:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2/2.5/3, Hermes,
  and pagoda's description for templates that ignore tools); several calls in a row are
  parallel calls;
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>`` (Qwen3-Coder, Qwen3.5): each value read by its parameter's JSON-schema type
  (strings as written, numbers, booleans, objects and arrays as JSON; a value that does not
  read as its type stays a string); the arguments are the JSON object of them;
- ``llama3_json``: an answer that is ``{"name": ..., "parameters": {...}}`` objects joined by
  ``;`` (after an optional ``<|python_tag|>``); an answer that does not begin so is content;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects.

gpt-oss's harmony calls are ``parsers.harmony``'s. JSON calls are read by
``json_calls.CallObject``: a call's arguments stream as the model writes them. A call that
does not parse (not JSON, no name) is the answer's text, never an error, when the parser sees
it whole; streamed, what was already sent of it stays sent (vLLM does the same).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from pagoda.fleet.parsers.events import CallArguments, CallStart, Content, Event, held_back, new_call_id
from pagoda.fleet.parsers.json_calls import CallObject


class _Tagged:
    """Calls between a start and an end tag, text outside them (Hermes' and Qwen3-Coder's)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._inside:
                start = self._buffer.find(self.START)
                if start < 0:
                    keep = held_back(self._buffer, (self.START,))
                    self._flush_content(events, len(self._buffer) - keep)
                    return events
                self._flush_content(events, start)
                self._buffer = self._buffer[len(self.START):]
                self._inside = True
                self._begin_call()
            end = self._buffer.find(self.END)
            body = self._buffer if end < 0 else self._buffer[:end]
            events += self._call_events(body, whole=end >= 0, tail=self.END if end >= 0 else "")
            if end < 0:
                return events
            self._buffer = self._buffer[end + len(self.END):]
            self._inside = False

    def finish(self) -> list[Event]:
        if self._inside:
            events = self._call_events(self._buffer, whole=True)
        else:
            events = [Content(self._buffer)] if self._buffer else []
        self._buffer, self._inside = "", False
        return events

    def _flush_content(self, events: list[Event], upto: int) -> None:
        if upto > 0:
            events.append(Content(self._buffer[:upto]))
            self._buffer = self._buffer[upto:]

    def _begin_call(self) -> None:
        raise NotImplementedError

    def _call_events(self, body: str, whole: bool, tail: str = "") -> list[Event]:
        """Events of a call's body so far (``whole``: it is all there; ``tail``: the end tag that
        closed it, for a body that is not a call and goes back as text)."""
        raise NotImplementedError


class HermesParser(_Tagged):
    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        super().__init__()
        self._call: Optional[CallObject] = None

    def _begin_call(self) -> None:
        self._call = CallObject(self._num_calls)

    def _call_events(self, body: str, whole: bool, tail: str = "") -> list[Event]:
        call = self._call
        try:
            events = call.feed(body, whole)
        except ValueError:  # not a call: the text it was
            return [Content(self.START + body + tail)]
        if call.started and whole:
            self._num_calls += 1
        return events


class Qwen3CoderParser(_Tagged):
    """Args:
    tools: the request's tools (each parameter's JSON-schema type reads its values).
    """

    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        super().__init__()
        self._types = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties", {})
                       for t in tools or []}
        self._name: Optional[str] = None
        self._read = 0  # characters of the body consumed
        self._num_params = 0

    def _begin_call(self) -> None:
        self._name, self._read, self._num_params = None, 0, 0

    def _call_events(self, body: str, whole: bool, tail: str = "") -> list[Event]:
        events: list[Event] = []
        index = self._num_calls
        if self._name is None:
            head = self._FUNCTION.match(body)
            if head is None:
                return [Content(self.START + body + tail)] if whole else []
            self._name, self._read = head.group(1).strip(), head.end()
            events.append(CallStart(index, new_call_id(), self._name))
        while True:
            parameter = self._PARAMETER.match(body, self._read)
            if parameter is None:
                break
            key, raw = parameter.group(1).strip(), parameter.group(2)
            value = _typed(raw.strip("\n"), self._types.get(self._name, {}).get(key, {}))
            prefix = "{" if self._num_params == 0 else ", "
            events.append(CallArguments(index, f"{prefix}{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}"))
            self._num_params += 1
            self._read = parameter.end()
        if whole:
            events.append(CallArguments(index, "}" if self._num_params else "{}"))
            self._num_calls += 1
        return events


def _typed(raw: str, schema: dict) -> Any:
    """A parameter's value by its schema's type; a value that does not read as it stays a string."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    try:
        if "integer" in kinds and re.fullmatch(r"-?\d+", raw.strip()):
            return int(raw)
        if "number" in kinds:
            return float(raw) if re.search(r"[.eE]", raw) else int(raw)
        if "boolean" in kinds and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        if {"object", "array", "null"} & set(kinds):
            return json.loads(raw)
    except ValueError:
        pass
    return raw


class Llama3JsonParser:
    """``{"name", "parameters"}`` objects joined by ``;``; an answer not beginning with one is text."""

    TAG = "<|python_tag|>"

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self._buffer = ""
        self._mode: Optional[str] = None  # None: undecided; "calls" or "text"
        self._call: Optional[CallObject] = None
        self._num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._advance(whole=False)

    def finish(self) -> list[Event]:
        events = self._advance(whole=True)
        if self._buffer.strip():
            events.append(Content(self._buffer))
        self._buffer = ""
        return events

    def _advance(self, whole: bool) -> list[Event]:
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                self._mode, self._buffer = "calls", head.removeprefix(self.TAG)
            elif (self.TAG.startswith(head) or not head) and not whole:
                return []
            else:
                self._mode = "text"
        if self._mode == "text":
            events = [Content(self._buffer)] if self._buffer else []
            self._buffer = ""
            return events
        events: list[Event] = []
        while self._buffer.strip(" \n;"):
            self._buffer = self._buffer.lstrip(" \n;")
            if self._call is None:
                self._call = CallObject(self._num_calls)
            try:
                events += self._call.feed(self._buffer, whole)
            except ValueError:
                self._mode, self._call = "text", None  # not a call: the rest is text
                return events + self._advance(whole)
            if not self._call.done:
                return events
            self._buffer = self._buffer[self._call.end:]
            self._call, self._num_calls = None, self._num_calls + 1
        return events


class MistralParser:
    """Text, then ``[TOOL_CALLS]`` and a JSON array of call objects."""

    TAG = "[TOOL_CALLS]"

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self._buffer = ""
        self._calls = False
        self._call: Optional[CallObject] = None
        self._num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._advance(whole=False)

    def finish(self) -> list[Event]:
        events = self._advance(whole=True)
        if self._buffer.strip(" \n]") and not self._calls:
            events.append(Content(self._buffer))
        self._buffer = ""
        return events

    def _advance(self, whole: bool) -> list[Event]:
        events: list[Event] = []
        if not self._calls:
            start = self._buffer.find(self.TAG)
            if start < 0:
                keep = 0 if whole else held_back(self._buffer, (self.TAG,))
                upto = len(self._buffer) - keep
                if upto > 0:
                    events.append(Content(self._buffer[:upto]))
                    self._buffer = self._buffer[upto:]
                return events
            if start:
                events.append(Content(self._buffer[:start]))
            self._buffer, self._calls = self._buffer[start + len(self.TAG):], True
        while self._buffer.strip(" \n[,]"):
            self._buffer = self._buffer.lstrip(" \n[,")
            if self._call is None:
                self._call = CallObject(self._num_calls)
            try:
                events += self._call.feed(self._buffer, whole)
            except ValueError:
                events.append(Content(self._buffer))  # not a call: the text it was
                self._buffer, self._call = "", None
                return events
            if not self._call.done:
                return events
            self._buffer = self._buffer[self._call.end:]
            self._call, self._num_calls = None, self._num_calls + 1
        return events


TOOL_PARSERS = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser, "llama3_json": Llama3JsonParser,
                "mistral": MistralParser}


def detect(chat_template: Optional[str]) -> str:
    """The tool-call format a chat template teaches; ``hermes`` by default (pagoda's own
    description for templates that ignore tools)."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"
