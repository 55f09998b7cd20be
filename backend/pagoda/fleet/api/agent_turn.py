"""One agent turn through the fleet: what the Responses and Messages doors share.

Both APIs are a chat turn underneath: the door translates its body into a chat-completions body
(its protocol module), ``build_chat_request`` makes the ``WireRequest`` (the chat template, the
tools, the parsers the model calls for), and ``AgentTurn`` runs it: the gate (salt, routing
analysis, rate limits, as for chat), the shared upstream stream to a replica, and the answer read
by its ``OutputParser`` as it streams (a call forced by grammar, ``required`` or a named tool,
is read whole at the end, as chat reads it). A turn yields ``TurnUpdate``s (the parser's events of each
response, then the finish) that the door renders in its API's shapes, streamed or folded whole.

Failures: a replica's error before anything streamed, or no replica, is ``TurnFailed`` (the
error's kind gives the door its status); after the answer began, it ends the stream the API's
way. The tenant's quota keeps what the turn really used (``Ticket.settle``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

from aiohttp import web

from pagoda.contracts.errors import ErrorKind, classify_replica_error
from pagoda.fleet.api.openai_io import OpenAIRequest, read_outputs
from pagoda.fleet.api.routed_request import RoutedRequest, analysis_chars, analyzed
from pagoda.fleet.api.tracing import TRACEPARENT
from pagoda.fleet.api.upstream import ReplicaFailed
from pagoda.fleet.gate.gate import TENANT_KEY, RateLimited
from pagoda.fleet.api.openai_tools import parse_answer
from pagoda.fleet.parsers.events import CallArguments, CallStart, Content, Event
from pagoda.fleet.parsers.output import OutputParser
from pagoda.fleet.routing.router import NoReplicaAvailable

if TYPE_CHECKING:
    from pagoda.fleet.api.openai_api import OpenAIApi


class TurnFailed(Exception):
    """The turn ended without an answer: ``kind`` (its status in each API) and the message."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class TurnUpdate:
    """What one replica response brought: the parser's events, and at the end the finish."""

    events: list[Event] = field(default_factory=list)
    finish_reason: Optional[str] = None  # stop | length | abort, on the last update
    stop_reason: Optional[str] = None  # the stop string that ended it, when one did


@dataclass
class TurnUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class AgentTurn:
    """Args:
    door: the OpenAI door whose collaborators (router, gate, upstream, tracer) the turn uses.
    built: the turn's chat request (``openai_io.build_chat_request``).
    protocol: the API's name, for the router's span.
    """

    def __init__(self, door: "OpenAIApi", built: OpenAIRequest, protocol: str) -> None:
        self.door = door
        self.built = built
        self.protocol = protocol
        self.usage = TurnUsage()
        self.num_calls = 0
        plan = built.tools
        tools = plan.tools if plan is not None and plan.choice == "auto" else None
        self._parser = OutputParser(built.parsers, tools)
        self._forced = plan if plan is not None and plan.choice in ("named", "required") else None
        self._forced_text = ""

    async def run(self, request: web.Request) -> AsyncIterator[TurnUpdate]:
        """The turn's updates (module docstring). Raises ``TurnFailed`` before the first one, or
        ``RateLimited`` (the gate's) when the tenant is over its limits."""
        door, gate = self.door, self.door.gate
        tenant = request.get(TENANT_KEY)
        if tenant is not None:
            salt = gate.salt(tenant, self.built.wire.options.cache_salt)
            self.built.wire = self.built.wire.with_options(cache_salt=salt)
        size = analysis_chars(self.built.prompt, self.built.wire)
        analysis, self.built.wire = await gate.analyze(size, analyzed, door.router, self.built.wire)
        ticket = gate.charge(tenant, analysis.num_prompt_tokens if analysis else 0, self.built.wire.params)
        try:
            async for update in self._stream(request, analysis):
                yield update
        finally:
            ticket.settle(self.usage.prompt_tokens + self.usage.completion_tokens)
            ticket.release()

    async def _stream(self, request: web.Request, analysis: object) -> AsyncIterator[TurnUpdate]:
        carrier = {TRACEPARENT: request.headers[TRACEPARENT]} if TRACEPARENT in request.headers else {}
        with self.door.tracer.route_span(self.protocol, carrier) as span:
            wire = self.built.wire
            turn = self.door.gate.turn(request.get(TENANT_KEY), analysis, wire.params, wire.options)
            routed = RoutedRequest(f"{self.protocol}-{uuid.uuid4().hex}", wire, turn=turn)
            responses = self.door.upstream.stream(analysis, routed, span)
            started = False
            try:
                async for message in responses:
                    if message.error_message:
                        kind = classify_replica_error(message.error_message)
                        if kind is ErrorKind.OVERLOADED:
                            self.door.gate.count("overloaded")
                        raise TurnFailed(kind, message.error_message)
                    started = True
                    yield self._update(read_outputs(message.infer_response))
            except NoReplicaAvailable as exc:
                span.fail(str(exc))
                raise TurnFailed(ErrorKind.UNAVAILABLE, str(exc)) from None
            except RateLimited as exc:  # the router's queue (flow control) could not hold it
                span.fail(str(exc))
                raise TurnFailed(ErrorKind.RATE_LIMITED, str(exc)) from None
            except ReplicaFailed as exc:
                span.fail(str(exc))
                raise TurnFailed(ErrorKind.REPLICA_FAILED, str(exc)) from None
            finally:
                await responses.aclose()
            if not started:
                raise TurnFailed(ErrorKind.REPLICA_FAILED, "the replica answered nothing")

    def _update(self, outputs: dict[str, list]) -> TurnUpdate:
        usage = self.usage
        if outputs.get("num_input_tokens"):
            usage.prompt_tokens = int(outputs["num_input_tokens"][0])
        if outputs.get("num_cached_tokens"):
            usage.cached_tokens = int(outputs["num_cached_tokens"][0])
        usage.completion_tokens += int((outputs.get("num_output_tokens") or [0])[0])
        text = (outputs.get("text_output") or [""])[0]
        reason = (outputs.get("finish_reason") or [""])[0] or None
        if self._forced is not None:
            events = self._forced_events(text, reason is not None)
        else:
            events = self._parser.feed(text) + (self._parser.finish() if reason is not None else [])
        stop = (outputs.get("stop_reason") or [None])[0]
        return TurnUpdate(events, reason, stop if stop not in (None, "None") else None)

    def _forced_events(self, text: str, finished: bool) -> list[Event]:
        """A call the grammar forced (``required`` or a named tool) is read whole when the answer ends
        (``openai_tools.parse_answer``, as chat's); text cut by the length stays text."""
        self._forced_text += text
        if not finished:
            return []
        content, calls = parse_answer(self._forced_text, self._forced)
        events: list[Event] = [Content(content)] if content else []
        for k, call in enumerate(calls):
            events += [CallStart(k, call["id"], call["function"]["name"]),
                       CallArguments(k, call["function"]["arguments"])]
        return events


async def stream_turn(request: web.Request, turn: AgentTurn, start: Callable[[], list[dict]],
                      feed: Callable[[TurnUpdate], list[dict]], failed: Callable[[TurnFailed], list[dict]],
                      finish: Callable[[TurnUpdate], list[dict]]) -> web.StreamResponse:
    """A turn as server-sent events, each ``event: TYPE`` + its JSON (both APIs' framing).

    The stream opens with the first update, so a failure before it raises ``TurnFailed`` (the door
    answers it whole); a later one ends the stream with the API's error events (``failed``).

    Args:
        request: the client's request.
        turn: the turn to run.
        start: the events that open the stream.
        feed: the events of one update.
        failed: the events that end a stream the turn failed in.
        finish: the closing events, given the last update that carried a finish reason (an empty
            ``TurnUpdate`` when none did).

    Returns:
        The finished stream response.
    """
    response: Optional[web.StreamResponse] = None
    last = TurnUpdate()
    try:
        async for update in turn.run(request):
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
                await _send(response, start())
            await _send(response, feed(update))
            last = update if update.finish_reason is not None else last
    except TurnFailed as exc:
        if response is None:
            raise
        await _send(response, failed(exc))
        await response.write_eof()
        return response
    await _send(response, finish(last))
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, events: list[dict]) -> None:
    for event in events:
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
                             .encode())
