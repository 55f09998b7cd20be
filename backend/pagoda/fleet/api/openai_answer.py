"""One OpenAI answer: a prompt's replica outputs folded in, rendered as OpenAI objects.

``Answer`` accumulates one engine request's outputs (one prompt; its ``n`` completions) and
renders chat or completions objects, whole or as stream chunks. A completions request with
several prompts has one ``Answer`` per prompt; their choices are numbered as vLLM numbers
them, ``prompt index * n + completion index`` (``index_offset``), and ``merge_final``
concatenates them in prompt order with the usage summed.

Echo (completions): the prompt's text comes first; with ``logprobs`` the prompt's tokens
come first in ``logprobs`` too (the replica's ``prompt_logprobs``, asked for by
``openai_io``): the first with ``null`` log-prob and ``null`` alternatives, as vLLM and
OpenAI send it, ``text_offset`` counted from the start of the echoed text. ``echo_only``
(``max_tokens=0``): the one generated token is dropped, text, log-prob and usage alike
(vLLM drops its text and log-prob but counts it in ``completion_tokens``; pagoda counts
only what it returns).

Tools (chat): with a ``ToolPlan`` in play the answer's text is read for tool calls when its
choice finishes (``openai_tools.parse_answer``): ``message.tool_calls`` and the finish reason
in the final object; streamed, the choice's text is held back and sent as one delta then.

Every object leaves through its typed model (``openai_responses``): choices are assembled
here as dicts and validated once, as part of the object they go out in.
"""

from __future__ import annotations

import json
import time
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any, Optional

from pagoda.fleet.api.openai_io import OpenAIRequest, chat_logprobs, completion_logprobs, echoed_prompt_logprobs
from pagoda.fleet.api.openai_responses import (ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, Usage,
                                               dump)
from pagoda.fleet.api.openai_tools import finish_reason as tool_finish_reason, parse_answer
from pagoda.fleet.parsers.events import CallArguments, CallStart, Content, Event, Parsed
from pagoda.fleet.parsers.output import OutputParser

if TYPE_CHECKING:
    from pagoda.models.tokenizer import Tokenizer

# OpenAI's backend-configuration fingerprint: the serving software and its version.
SYSTEM_FINGERPRINT = f"pagoda-{_version('pagoda')}"


class Answer:
    """Accumulates one request's (one prompt's) outputs and renders OpenAI objects."""

    def __init__(self, chat: bool, request_id: str, model: str, built: OpenAIRequest, tokenizer: "Tokenizer",
                 index_offset: int = 0) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.built = built
        self.tokenizer = tokenizer
        self.index_offset = index_offset
        self.created = int(time.time())
        n = built.n
        self.texts = [built.echo_prefix] * n
        self.finish_reasons: list[Optional[str]] = [None] * n
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.prompt_logprobs: Optional[list[Optional[dict]]] = None  # the replica's, null first
        self.echoed = [False] * n  # streaming: the echoed prompt went out in a chunk
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_completion_tokens = [0] * n
        # Chat answers read by a reasoning and/or tool-call parser (``fleet.parsers``), one per choice.
        self.parsers: list[Optional[OutputParser]] = [self._make_parser() for _ in range(n)]
        self.num_calls = [0] * n  # calls streamed so far, per choice

    def add(self, outputs: dict[str, list]) -> list[tuple[int, str, Optional[str], list[dict]]]:
        """Fold one response in; returns (index, delta text, finish reason, delta logprobs) per completion."""
        if outputs.get("num_input_tokens"):
            self.num_prompt_tokens = int(outputs["num_input_tokens"][0])
        if outputs.get("num_cached_tokens"):
            self.num_cached_tokens = int(outputs["num_cached_tokens"][0])
        if outputs.get("prompt_logprobs"):
            self.prompt_logprobs = json.loads(outputs["prompt_logprobs"][0])
        keep = not self.built.echo_only
        deltas = []
        for i, text in enumerate(outputs.get("text_output", [])):
            reason = (outputs.get("finish_reason") or [""] * (i + 1))[i] or None
            step_logprobs = json.loads(outputs["logprobs"][i]) if outputs.get("logprobs") and keep else []
            text = text if keep else ""
            self.texts[i] += text
            self.finish_reasons[i] = reason or self.finish_reasons[i]
            self.logprobs[i].extend(step_logprobs)
            if outputs.get("num_output_tokens") and keep:
                self.num_completion_tokens[i] += int(outputs["num_output_tokens"][i])
            deltas.append((i, text, reason, step_logprobs))
        return deltas

    @property
    def num_used_tokens(self) -> int:
        """Prompt + completion tokens the replica reported (0 when it ran nothing)."""
        completion = sum(self.num_completion_tokens)
        return self.num_prompt_tokens + completion if completion or self.num_prompt_tokens else 0

    def usage(self) -> Usage:
        completion = sum(self.num_completion_tokens)
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion,
                     prompt_tokens_details={"cached_tokens": self.num_cached_tokens})

    def _prompt_entries(self) -> list[dict]:
        """The echoed prompt's log-prob entries (first token: ``None``)."""
        if self.prompt_logprobs is None:
            return []
        prompt = self.built.prompt
        first = prompt[0] if isinstance(prompt, list) else self.tokenizer.encode(prompt)[0]
        return echoed_prompt_logprobs(self.prompt_logprobs, first)

    def _logprobs(self, entries: list[dict], offset: int = 0, with_prompt: bool = False) -> Optional[dict]:
        if self.built.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.tokenizer)
        if with_prompt and self.prompt_logprobs is not None:
            return completion_logprobs(self._prompt_entries() + entries, self.tokenizer, 0)
        return completion_logprobs(entries, self.tokenizer, offset)

    @property
    def _forced_tools(self) -> bool:
        """A named or required call: the grammar wrote it, ``openai_tools.parse_answer`` reads it whole."""
        plan = self.built.tools
        return self.chat and plan is not None and plan.choice in ("named", "required")

    def _make_parser(self) -> Optional[OutputParser]:
        plan, choice = self.built.tools, self.built.parsers
        tools = plan.tools if plan is not None and plan.choice == "auto" else None
        if not self.chat or choice is None or self._forced_tools or (tools is None and choice.reasoning is None):
            return None
        return OutputParser(choice, tools)

    def _forced_answer(self, i: int) -> tuple[Optional[str], list[dict], Optional[str]]:
        """(content, tool_calls, finish_reason) of finished choice ``i`` with a forced call."""
        plan = self.built.tools
        content, calls = parse_answer(self.texts[i], plan)
        return content, calls, tool_finish_reason(self.finish_reasons[i], plan, calls)

    def _chat_choice(self, i: int, text: str) -> dict:
        message, reason = {"role": "assistant", "content": text}, self.finish_reasons[i]
        if self._forced_tools:
            content, calls, reason = self._forced_answer(i)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        elif self.parsers[i] is not None:
            parser = self._make_parser()
            parsed = Parsed().add(parser.feed(text) + parser.finish())
            calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in parsed.calls]
            message = {"role": "assistant", "content": parsed.content.strip() or (None if calls else ""),
                       **({"tool_calls": calls} if calls else {}),
                       **({"reasoning": parsed.reasoning, "reasoning_content": parsed.reasoning}
                          if parsed.reasoning else {})}
            reason = tool_finish_reason(reason, self.built.tools, calls) if self.built.tools else reason
        return {"index": self.index_offset + i, "message": message, "logprobs": self._logprobs(self.logprobs[i]),
                "finish_reason": reason}

    def choices(self) -> list[dict]:
        """The final choices, numbered from ``index_offset``."""
        if self.chat:
            return [self._chat_choice(i, text) for i, text in enumerate(self.texts)]
        return [{"index": self.index_offset + i, "text": text,
                 "logprobs": self._logprobs(self.logprobs[i], len(self.built.echo_prefix), self.built.echo),
                 "finish_reason": self.finish_reasons[i]} for i, text in enumerate(self.texts)]

    def final_object(self) -> dict:
        return merge_final([self])

    def chunk(self, choices: list[dict], usage: Optional[Usage] = None) -> dict:
        """One stream chunk (``usage`` only on the last one, when asked for)."""
        if self.chat:
            model, kind = ChatCompletionChunk, "chat.completion.chunk"
        else:
            model, kind = CompletionChunk, "text_completion"
        fields = {"usage": usage} if usage is not None else {}
        return dump(model(id=self.request_id, object=kind, created=self.created, model=self.model,
                          system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, **fields))

    def role_chunk(self) -> dict:
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(self.built.n)])

    def chunks(self, outputs: dict[str, list]) -> list[dict]:
        lengths = [len(t) for t in self.texts]
        out = []
        for i, text, reason, step_logprobs in self.add(outputs):
            echo_now = self.built.echo and not self.echoed[i]
            if not text and reason is None and not echo_now:
                continue
            if self._forced_tools:
                if reason is None:
                    continue  # a forced call is read whole when the choice finishes (openai_tools)
                content, calls, reason = self._forced_answer(i)
                delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]} if calls else {}
                choice = {"index": i, "delta": {**({"content": content} if content else {}), **delta},
                          "logprobs": self._logprobs(self.logprobs[i]), "finish_reason": reason}
            elif self.parsers[i] is not None:
                events = self.parsers[i].feed(text) + (self.parsers[i].finish() if reason is not None else [])
                delta = self._delta(i, events)
                if not delta and reason is None:
                    continue  # held back: a tag may be beginning
                if reason is not None and self.num_calls[i] and self.built.tools is not None:
                    reason = tool_finish_reason(reason, self.built.tools, [None] * self.num_calls[i])
                choice = {"index": i, "delta": delta, "logprobs": self._logprobs(step_logprobs),
                          "finish_reason": reason}
            elif self.chat:
                choice = {"index": i, "delta": {"content": text} if text else {},
                          "logprobs": self._logprobs(step_logprobs), "finish_reason": reason}
            else:
                self.echoed[i] = True
                prefix = self.built.echo_prefix if echo_now else ""
                choice = {"index": self.index_offset + i, "text": prefix + text,
                          "logprobs": self._logprobs(step_logprobs, lengths[i], echo_now), "finish_reason": reason}
            out.append(self.chunk([choice]))
        return out

    def _delta(self, i: int, events: list[Event]) -> dict:
        """A chat chunk's delta of choice ``i`` from its parser's events: text, reasoning (under
        both names), and each call's start (id, name) and argument fragments as they stream."""
        delta: dict = {}
        calls: list[dict] = []
        for event in events:
            if isinstance(event, Content):
                delta["content"] = delta.get("content", "") + event.text
            elif isinstance(event, CallStart):
                self.num_calls[i] += 1
                calls.append({"index": event.index, "id": event.call_id, "type": "function",
                              "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, CallArguments):
                if calls and calls[-1]["index"] == event.index:
                    calls[-1]["function"]["arguments"] += event.text
                else:
                    calls.append({"index": event.index, "function": {"arguments": event.text}})
            else:
                delta["reasoning"] = delta.get("reasoning", "") + event.text
                delta["reasoning_content"] = delta["reasoning"]
        return {**delta, **({"tool_calls": calls} if calls else {})}

    def usage_chunk(self, answers: Optional[list["Answer"]] = None) -> dict:
        return self.chunk([], summed_usage(answers or [self]))


def summed_usage(answers: list[Answer]) -> Usage:
    """One usage object for several prompts' answers (vLLM sums them)."""
    usages = [answer.usage() for answer in answers]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 total_tokens=sum(u.total_tokens for u in usages),
                 prompt_tokens_details={"cached_tokens": sum(u.prompt_tokens_details.cached_tokens for u in usages)})


def merge_final(answers: list[Answer]) -> dict:
    """The whole (non-streamed) object of a request's answers, choices in prompt order."""
    first = answers[0]
    model = ChatCompletion if first.chat else Completion
    return dump(model(id=first.request_id, object="chat.completion" if first.chat else "text_completion",
                      created=first.created, model=first.model, system_fingerprint=SYSTEM_FINGERPRINT,
                      choices=[choice for answer in answers for choice in answer.choices()],
                      usage=summed_usage(answers)))
