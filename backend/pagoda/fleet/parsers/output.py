"""One answer's parser: its reasoning parser, then its tool-call parser over the answer text.

``OutputParser.feed(delta)`` / ``finish()`` return ``parsers.events`` events: the reasoning
parser (``reasoning``) splits thinking from text, and the text it lets through goes to the
tool-call parser (``tool_calls``) when the request has tools in play; gpt-oss's ``harmony``
reads both at once. ``make_output_parser`` picks them by name (``--reasoning-parser``,
``--tool-call-parser``, or detected from the chat template: ``detect``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagoda.fleet.parsers import reasoning, tool_calls
from pagoda.fleet.parsers.events import Content, Event
from pagoda.fleet.parsers.harmony import HarmonyParser

PARSER_NAMES = ("harmony", *reasoning.REASONING_PARSERS, *tool_calls.TOOL_PARSERS)


@dataclass(frozen=True)
class ParserChoice:
    """Which parsers a model's answers need (``None``: that kind has none)."""

    reasoning: Optional[str]
    tools: str

    @classmethod
    def detect(cls, chat_template: Optional[str], prompt: str = "", reasoning_parser: Optional[str] = None,
               tool_parser: Optional[str] = None) -> "ParserChoice":
        """From the chat template (and a rendered prompt: one ending inside ``<think>``), unless
        the server names them (``reasoning_parser``: a name or ``"none"``; ``tool_parser``)."""
        detected = reasoning.detect(chat_template, prompt)
        chosen = detected if reasoning_parser is None else (None if reasoning_parser == "none" else reasoning_parser)
        if chosen == "qwen3" and prompt.rstrip().endswith(reasoning.START):
            chosen = "deepseek_r1"  # this prompt opens the thinking itself
        return cls(chosen, tool_parser or tool_calls.detect(chat_template))

    @property
    def needs_special_tokens(self) -> bool:
        """gpt-oss's channels are special tokens: the replica must keep them in the text."""
        return "harmony" in (self.reasoning, self.tools)


class OutputParser:
    """Args:
    choice: the parsers (``ParserChoice``).
    tools: the request's tools (``None`` or empty: tool calls are not read).
    """

    def __init__(self, choice: ParserChoice, tools: Optional[list[dict]] = None) -> None:
        self._harmony = HarmonyParser(tools) if choice.needs_special_tokens else None
        self._reasoning = (reasoning.REASONING_PARSERS[choice.reasoning]()
                           if choice.reasoning in reasoning.REASONING_PARSERS else None)
        self._tools = tool_calls.TOOL_PARSERS[choice.tools](tools) if tools and choice.tools != "harmony" else None

    def feed(self, text: str) -> list[Event]:
        if self._harmony is not None:
            return self._harmony.feed(text)
        return self._through_tools(self._reasoning.feed(text) if self._reasoning else [Content(text)])

    def finish(self) -> list[Event]:
        if self._harmony is not None:
            return self._harmony.finish()
        events = self._through_tools(self._reasoning.finish()) if self._reasoning else []
        return events + (self._tools.finish() if self._tools is not None else [])

    def _through_tools(self, events: list[Event]) -> list[Event]:
        if self._tools is None:
            return [e for e in events if not isinstance(e, Content) or e.text]
        out: list[Event] = []
        for event in events:
            out += self._tools.feed(event.text) if isinstance(event, Content) else [event]
        return out
