"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the OpenAI door.

A request is checked as ``messages_protocol.MessagesRequest``, made a chat turn
(``to_chat_body``), built by the chat door's ``build_chat_request`` (the chat template, tools,
the model's reasoning and tool-call parsers), run as one ``AgentTurn`` and answered by
``MessageRender``: a ``message`` object, or with ``stream`` Anthropic's SSE events
(``event: <type>`` and ``data: <event>``: ``message_start``, the content blocks' start, deltas
and stop, ``message_delta``, ``message_stop``). ``count_tokens`` renders the same prompt and
counts its tokens with the model's tokenizer (``{"input_tokens": N}``).

Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the
status of their kind (``invalid_request_error`` 400, ``authentication_error`` 401,
``permission_error`` 403, ``not_found_error`` 404, ``request_too_large`` 413,
``rate_limit_error`` 429, ``api_error`` 500, ``overloaded_error`` 529 for a fleet with no room);
an error after the stream began is an ``error`` event. API keys come as ``x-api-key`` (the
anthropic SDK's header) or as ``Authorization: Bearer`` (``http_api.gate_middleware``).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any, Optional

from aiohttp import web

from pagoda.contracts import json_input
from pagoda.contracts.errors import ErrorKind, spec_of
from pagoda.fleet.api.agent_turn import AgentTurn, TurnFailed, TurnUpdate, stream_turn
from pagoda.fleet.api.messages_protocol import CountTokensRequest, MessagesRequest, chat_messages, to_chat_body, \
    tools_body
from pagoda.fleet.api.messages_render import MessageRender
from pagoda.fleet.api.openai_images import off_the_loop
from pagoda.fleet.api.openai_io import OpenAIError, build_chat_request
from pagoda.fleet.api.openai_protocol import parse
from pagoda.fleet.gate.gate import LimitError, RateLimited, retry_after_header

if TYPE_CHECKING:
    from pagoda.fleet.api.openai_api import OpenAIApi

# HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               529: "overloaded_error"}


def anthropic_error(status: int, message: str, headers: Optional[dict[str, str]] = None) -> web.Response:
    """An error answer in Anthropic's shape (``api_error`` for statuses it has no type for)."""
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    return web.json_response(body, status=status, headers=headers)


def kind_error(kind: ErrorKind, message: str) -> web.Response:
    status = spec_of(kind).http_status
    if kind in (ErrorKind.UNAVAILABLE, ErrorKind.OVERLOADED):
        status = 529  # Anthropic's "overloaded"
    return anthropic_error(status, message, retry_after_header() if spec_of(kind).retry_after else None)


class MessagesApi:
    """Args:
    openai: the OpenAI door (its collaborators, model names and parsers).
    """

    def __init__(self, openai: "OpenAIApi") -> None:
        self.openai = openai

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.create)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def create(self, request: web.Request) -> web.StreamResponse:
        openai = self.openai
        try:
            parsed = parse(MessagesRequest, json_input.loads(await request.read(), "body"))
            self._check_model(parsed.model)
            built = await off_the_loop(_built, parsed, openai)
            openai.gate.limits.check_prompt(built.wire.prompt or "", "messages")
            openai.gate.limits.check_params(built.wire.params)
            built.wire = built.wire.replace(output=dataclasses.replace(built.wire.output, return_stop_reason=True))
        except _ModelNotFound as exc:
            return anthropic_error(404, str(exc))
        except (json_input.JSONInputError, OpenAIError, LimitError) as exc:
            openai.gate.count("invalid_input")
            return anthropic_error(getattr(exc, "status", 400), str(exc))
        render = MessageRender(f"msg_{uuid.uuid4().hex}", parsed.model, parsed.stop_sequences)
        turn = AgentTurn(openai, built, "messages")
        try:
            if parsed.stream:
                return await stream_turn(
                    request, turn, lambda: render.start(turn.usage), render.feed,
                    lambda exc: [{"type": "error", "error": {
                        "type": ERROR_TYPES.get(spec_of(exc.kind).http_status, "api_error"), "message": str(exc)}}],
                    lambda last: render.finish(last, turn.usage))
            last = TurnUpdate()
            async for update in turn.run(request):
                render.feed(update)
                last = update if update.finish_reason is not None else last
            return web.json_response(render.message(last, turn.usage))
        except RateLimited as exc:
            return anthropic_error(429, str(exc), retry_after_header(exc.retry_after_s))
        except TurnFailed as exc:
            return kind_error(exc.kind, str(exc))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt a Messages request makes, counted with the model's tokenizer; an image counts
        the placeholder tokens the replica expands it into (the router's ``RouterImages``, given
        the model folder; without it, one placeholder per image)."""
        openai = self.openai
        try:
            parsed = parse(CountTokensRequest, json_input.loads(await request.read(), "body"))
            self._check_model(parsed.model)
            body = {"messages": chat_messages(parsed), "max_tokens": 1, **tools_body(parsed)}
            built = await off_the_loop(build_chat_request, body, openai.router.tokenizer, *openai.parsers)
        except _ModelNotFound as exc:
            return anthropic_error(404, str(exc))
        except (json_input.JSONInputError, OpenAIError, LimitError) as exc:
            return anthropic_error(400, str(exc))
        token_ids = openai.router.tokenizer.encode(built.wire.prompt)
        images = openai.router.images
        if built.wire.images and images is not None:  # each placeholder counts the tokens its image becomes
            try:
                return web.json_response({"input_tokens": images.count(token_ids, built.wire.images)})
            except ValueError as exc:
                return anthropic_error(400, str(exc))
        return web.json_response({"input_tokens": len(token_ids)})

    def _check_model(self, model: str) -> None:
        openai = self.openai
        if model not in (openai.model_name, "pagoda", *openai.lora_names):
            raise _ModelNotFound(f"model: {model!r} is not served here (this server serves {openai.model_name!r})")


class _ModelNotFound(Exception):
    pass


def _built(parsed: MessagesRequest, openai: "OpenAIApi") -> Any:
    """The chat request of a Messages request (its images decoded, or fetched: ``off_the_loop``)."""
    return build_chat_request(to_chat_body(parsed), openai.router.tokenizer, *openai.parsers)
