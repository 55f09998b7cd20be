"""Reasoning parsers: the model's thinking out of its answer text, streamed.

``ThinkParser`` reads the ``<think> ... </think>`` convention (Qwen3, QwQ, DeepSeek-R1 and the
families that copy it): text between the tags is ``Reasoning``, the rest ``Content``. Two
openings, as vLLM's ``qwen3`` and ``deepseek_r1`` parsers:

- ``opens_inside=False`` (Qwen3): reasoning only when the answer begins with ``<think>``
  (leading whitespace allowed); an answer without it is all content;
- ``opens_inside=True`` (DeepSeek-R1, Qwen3 "thinking" templates whose generation prompt ends
  with ``<think>``): the answer begins inside the reasoning, which ends at ``</think>``; a
  ``<think>`` the model writes anyway is dropped.

The newlines right after ``</think>`` (Qwen3 writes ``</think>\\n\\n``) are not content. A
reasoning the answer never closes (cut by ``max_tokens``) stays reasoning.

``REASONING_PARSERS`` names them for ``--reasoning-parser``; ``detect`` picks one from a chat
template (``harmony``, gpt-oss's channels, is ``parsers.harmony``).
"""

from __future__ import annotations

from typing import Optional

from pagoda.fleet.parsers.events import Content, Event, Reasoning, held_back

START, END = "<think>", "</think>"


class ThinkParser:
    """Args:
    opens_inside: the answer begins inside the reasoning (module docstring).
    """

    def __init__(self, opens_inside: bool = False) -> None:
        self._state = "inside" if opens_inside else "start"
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        """The events ``text`` completes (a possible partial tag waits for the next delta)."""
        self._buffer += text
        events: list[Event] = []
        while self._buffer:
            progressed = getattr(self, f"_{self._state}")(events)
            if not progressed:
                break
        return events

    def finish(self) -> list[Event]:
        """The events of what is held back, at the answer's end."""
        rest, self._buffer = self._buffer, ""
        if not rest or self._state == "after_newlines" and not rest.strip("\n"):
            return []
        if self._state in ("inside", "opened"):
            return [Reasoning(rest)]
        return [Content(rest.lstrip("\n") if self._state == "after_newlines" else rest)]

    # ---- states: each consumes from the buffer and returns whether it made progress
    def _start(self, events: list[Event]) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(START):
            self._buffer = stripped[len(START):]
            self._state = "opened"
            return True
        if START.startswith(stripped):
            return False  # maybe "<thi" so far
        self._state = "after"
        return True

    def _inside(self, events: list[Event]) -> bool:
        """Opened inside the reasoning: a ``<think>`` the model writes anyway is dropped."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(START):
            self._buffer = stripped[len(START):]
        elif START.startswith(stripped):
            return False  # only whitespace, or "<thi", so far
        self._state = "opened"
        return True

    def _opened(self, events: list[Event]) -> bool:
        end = self._buffer.find(END)
        if end >= 0:
            if end:
                events.append(Reasoning(self._buffer[:end]))
            self._buffer = self._buffer[end + len(END):]
            self._state = "after_newlines"
            return True
        keep = held_back(self._buffer, (END,))
        if len(self._buffer) > keep:
            events.append(Reasoning(self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _after_newlines(self, events: list[Event]) -> bool:
        stripped = self._buffer.lstrip("\n")
        if not stripped:
            self._buffer = ""
            return False
        self._buffer = stripped
        self._state = "after"
        return True

    def _after(self, events: list[Event]) -> bool:
        events.append(Content(self._buffer))
        self._buffer = ""
        return False


REASONING_PARSERS = {"qwen3": lambda: ThinkParser(opens_inside=False),
                     "deepseek_r1": lambda: ThinkParser(opens_inside=True)}


def detect(chat_template: Optional[str], prompt: str = "") -> Optional[str]:
    """The reasoning format a model uses, from its chat template (and the rendered prompt: one
    that ends inside ``<think>`` opens inside it); ``None`` when it has none pagoda knows."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony"
    if START in template or END in template:
        return "deepseek_r1" if prompt.rstrip().endswith(START) else "qwen3"
    return None
