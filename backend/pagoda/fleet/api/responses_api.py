"""``POST /v1/responses``: OpenAI's Responses API on the router's (and ``pagoda serve``'s) OpenAI door.

A request is checked as ``responses_protocol.ResponsesRequest`` (400 naming the field), made a
chat turn (``to_chat_body``; with ``previous_response_id``, the stored turn's conversation
first), built into its wire request by the chat door's ``build_chat_request`` (the chat
template, tools, structured output, the model's reasoning and tool-call parsers), run as one
``AgentTurn`` and answered by ``ResponseRender``: a ``response`` object, or with ``stream`` the
typed SSE events (``event: <type>`` and ``data: <event>``), ``response.created`` first and
``response.completed`` (or ``response.incomplete``) last. An error before the answer began is an
OpenAI error answer with the status of its kind; after, an ``error`` event ends the stream.

Storing turns (``previous_response_id``) is off unless the router runs with
``--response-store``: then a turn is kept (``response_store``; not when the request says
``store: false``) for ``--response-store-ttl`` seconds, per tenant. With the store off, a request
naming a ``previous_response_id`` is refused, naming the flag.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Optional

from aiohttp import web

from pagoda.contracts import json_input
from pagoda.contracts.errors import ErrorKind
from pagoda.fleet.api.agent_turn import AgentTurn, TurnFailed, stream_turn
from pagoda.fleet.api.openai_api import error_response, kind_response
from pagoda.fleet.api.openai_images import off_the_loop
from pagoda.fleet.api.openai_io import OpenAIError, build_chat_request
from pagoda.fleet.api.openai_protocol import parse
from pagoda.fleet.api.response_store import ResponseStore
from pagoda.fleet.api.responses_protocol import ResponsesRequest, to_chat_body
from pagoda.fleet.api.responses_render import ResponseRender
from pagoda.fleet.gate.gate import TENANT_KEY, LimitError, RateLimited, retry_after_header

if TYPE_CHECKING:
    from pagoda.fleet.api.openai_api import OpenAIApi


class ResponsesApi:
    """Args:
    openai: the OpenAI door (its collaborators, its model names and parsers).
    store: where turns are kept for ``previous_response_id``; ``None``: off.
    """

    def __init__(self, openai: "OpenAIApi", store: Optional[ResponseStore] = None) -> None:
        self.openai = openai
        self.store = store

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)

    async def create(self, request: web.Request) -> web.StreamResponse:
        openai = self.openai
        try:
            body = json_input.loads(await request.read(), "body")
            parsed = parse(ResponsesRequest, body)
            model = parsed.model or openai.model_name
            if model not in (openai.model_name, "pagoda", *openai.lora_names):
                return error_response(404, f"the model '{model}' does not exist", param="model",
                                      code="model_not_found")
            history = await self._history(request, parsed)
            chat_body, built = await off_the_loop(_built, parsed, history, openai)
            openai.gate.limits.check_prompt(built.wire.prompt or "", "input")
            openai.gate.limits.check_params(built.wire.params)
            if model in openai.lora_names:
                built.wire = built.wire.with_options(lora_name=model)
        except (json_input.JSONInputError, OpenAIError, LimitError) as exc:
            openai.gate.count("invalid_input")
            return error_response(getattr(exc, "status", 400), str(exc), param=getattr(exc, "param", None))
        except _NotFound as exc:
            return error_response(404, str(exc), param="previous_response_id")
        render = ResponseRender(f"resp_{uuid.uuid4().hex}", model, parsed)
        turn = AgentTurn(openai, built, "responses")
        try:
            if parsed.stream:
                answer = await stream_turn(
                    request, turn, render.start, render.feed,
                    lambda exc: render.error(exc.kind.value, str(exc)),
                    lambda last: render.finish(last.finish_reason, turn.usage))
            else:
                answer = await self._whole(request, turn, render)
        except RateLimited as exc:
            return kind_response(ErrorKind.RATE_LIMITED, str(exc), headers=retry_after_header(exc.retry_after_s))
        except TurnFailed as exc:
            return kind_response(exc.kind, str(exc))
        if self.store is not None and parsed.store is not False and render.items:
            await self.store.put(_tenant(request), render.response_id, chat_body["messages"] + _as_messages(render))
        return answer

    async def _history(self, request: web.Request, parsed: ResponsesRequest) -> list[dict]:
        if parsed.previous_response_id is None:
            return []
        if self.store is None:
            raise OpenAIError("previous_response_id: this server keeps no responses (start the router with "
                              "--response-store)", "previous_response_id")
        history = await self.store.get(_tenant(request), parsed.previous_response_id)
        if history is None:
            raise _NotFound(f"previous_response_id: no stored response {parsed.previous_response_id!r} "
                            "(unknown, expired, or not this tenant's)")
        return history

    async def _whole(self, request: web.Request, turn: AgentTurn, render: ResponseRender) -> web.Response:
        reason = None
        async for update in turn.run(request):
            render.feed(update)
            reason = update.finish_reason or reason
        return web.json_response(render.finish(reason, turn.usage)[-1]["response"])


class _NotFound(Exception):
    pass


def _tenant(request: web.Request) -> str:
    tenant = request.get(TENANT_KEY)
    return tenant.tenant_id if tenant is not None else ""


def _as_messages(render: ResponseRender) -> list[dict]:
    """The turn's answer as chat messages (its reasoning is not kept, as the model does not read it)."""
    text = "".join(part["text"] for item in render.items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in render.items if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def _built(parsed: ResponsesRequest, history: list[dict], openai: "OpenAIApi") -> tuple[dict, Any]:
    """The chat body and request of a Responses turn (its images decoded, or fetched: ``off_the_loop``)."""
    chat_body = to_chat_body(parsed, history)
    return chat_body, build_chat_request(chat_body, openai.router.tokenizer, *openai.parsers)
