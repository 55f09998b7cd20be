"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (and
``/v1/models/{id}``) and vLLM's ``/health``.

A request is validated here (the body as its typed model, ``openai_protocol``: strict
types and ranges, errors naming the field), turned into one ``WireRequest`` per prompt
(``openai_io``: the prompt, or the conversation rendered with the model's chat template, with
the token ids routing made of it; its ``SamplingParams`` and ``RequestOptions``; streamed from
the replica in pagoda's output shapes), routed like any other (``upstream.GrpcUpstream``, the
gRPC door's client too) and answered in OpenAI's shapes:
SSE ``chat.completion.chunk`` / ``text_completion`` events ending with ``data: [DONE]``,
or one JSON object with ``usage`` (``prompt_tokens_details.cached_tokens``: the prompt tokens
the replica found in its prefix cache) and a ``system_fingerprint`` (``pagoda-<version>``).

Parameter mapping (OpenAI -> ``SamplingParams``): ``max_tokens`` (chat also
``max_completion_tokens``; completions default 16, chat default: until a stop or the
context ends), ``temperature``, ``top_p``, ``n``, ``stop`` (string or list), ``seed``,
``presence_penalty``, ``frequency_penalty``, ``logprobs`` (completions: how many
alternatives; chat: ``logprobs`` + ``top_logprobs``); vLLM's extras pass through:
``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, plus ``cache_salt``, ``priority`` and ``timeout``; OpenAI's
``logit_bias`` (token id -> bias in [-100, 100]) is the engine's logit bias; chat's
``chat_template_kwargs`` reach the chat template (e.g. Qwen3's ``enable_thinking``); beam
search as vLLM's extras: ``use_beam_search`` (with ``best_of`` the beam width, ``n`` best
beams returned; ``temperature`` 0 unless given), ``length_penalty``, ``early_stopping``;
``logprobs`` then give each beam (choice) its per-token values.
Completions' ``prompt`` may be a string, a list of token
ids, or a list of either (lm-eval's ``tokenized_requests``): one replica request per prompt,
routed on its own (token ids travel as the ``input_ids`` input), run concurrently,
choices numbered ``prompt index * n + i`` as vLLM numbers them, usage summed; streamed, the
prompts' events interleave as they come (each names its ``index``), as vLLM's do. ``echo`` prepends the prompt; with
``logprobs`` the prompt's tokens' log-probabilities come first (the first ``null``; the replica's
``prompt_logprobs``, which the body may also set itself, as vLLM's extra), and
``max_tokens=0`` is allowed with ``echo`` (the prompt alone: one token is generated and
dropped, as vLLM does; ``openai_answer``). Structured
output: ``response_format`` (``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` (``pagoda.fleet.api.openai_guided``).

Refused with a 400 ``invalid_request_error`` (never silently ignored): an unknown field
(as OpenAI does; vLLM ignores it with a log line), more than ``openai_io.MAX_PROMPTS``
prompts, ``prompt_embeds``, ``best_of`` other than ``n`` without beam search, ``suffix``,
the legacy ``functions``/``function_call``, more than one output format, and malformed
values. ``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and ignored (no
generation semantics). Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``) are
``pagoda.fleet.api.openai_tools``'s: forced calls through the grammar engine, parsed answers
(``openai_answer``). Errors the replica reports come back with its message, and the status and type
``pagoda.contracts.errors`` gives their kind (``classify_replica_error``; e.g. a prompt
longer than the context is a 400, an engine fault a 500); a replica that fails mid-stream
ends the stream with an ``error`` event (the SDK raises it).

Limits and tenants (``pagoda.fleet.gate.gate``): the body size and the API key are checked
before the body is read (413, 401); the number of messages, prompt length, ``max_tokens``,
``n``, ``logprobs``/``top_logprobs`` and stop strings against ``RequestLimits`` (400
naming the limit); the tenant's ``cache_salt`` is set; its rate limits charge the prompt
tokens plus ``n`` x ``max_tokens`` (the replicas' ``default_max_tokens`` when not given),
settled with the usage the replica reported when the request ends (429 +
``Retry-After``). When every
replica refuses the request as overloaded (admission control) the answer is 429 with
``Retry-After``; a request whose ``timeout`` passed gets 408.

``model`` may be omitted: the request goes to the served model (as vLLM does); any name
other than the served one (or ``pagoda``) or a served LoRA adapter is a 404.

LoRA adapters at run time (vLLM's endpoints; ``pagoda.fleet.api.lora_admin``):
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter {"lora_name"}`` apply the action to every routable replica
(all or nothing, rolled back otherwise) and answer 200 with a JSON document, or an error
naming each replica that failed and why (400 when every failure was the replicas' refusal,
502 when one was unreachable, 404 to unload an adapter nobody has, 503 without replicas).
They are refused with 403 unless the router runs with ``--allow-runtime-lora``, and sit
behind the same API keys as every ``/v1`` route. The served adapters (``model`` names,
``/v1/models``) are the admin's: ``--lora``, learned from replicas, or loaded here.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Optional

from aiohttp import web

from pagoda.contracts import json_input
from pagoda.contracts.errors import ErrorKind, classify_replica_error, kind_of_http_status, spec_of
from pagoda.fleet.gate.gate import TENANT_KEY, Gate, LimitError, RateLimited, retry_after_header
from pagoda.fleet.gate.limits import openai_sampling_values
from pagoda.fleet.api.lora_admin import LoRAAdmin, check_change
from pagoda.fleet.api.upstream import GrpcUpstream, ReplicaFailed
from pagoda.fleet.api.openai_answer import Answer, merge_final
from pagoda.fleet.api.openai_responses import ModelCard, ModelList, dump, error_body
from pagoda.fleet.api.openai_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, parse
from pagoda.fleet.api.openai_images import off_the_loop
from pagoda.fleet.api.openai_io import (OpenAIError, OpenAIRequest, build_chat_request, build_completion_requests,
                                        read_outputs)
from pagoda.fleet.api.routed_request import RoutedRequest, analysis_chars, analyzed
from pagoda.fleet.routing.router import NoReplicaAvailable, Router
from pagoda.fleet.api.tracing import TRACEPARENT, RouterTracer


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> web.Response:
    return web.json_response(error_body(message, kind, param, code), status=status, headers=headers)


_REPLICA_ERROR_TYPE = spec_of(ErrorKind.REPLICA_FAILED).openai_type  # an error event mid-stream


def kind_response(kind: ErrorKind, message: str, param: Optional[str] = None,
                  headers: Optional[dict[str, str]] = None) -> web.Response:
    """An OpenAI error answer for ``kind`` (its status and type from ``pagoda.contracts.errors``)."""
    spec = spec_of(kind)
    if spec.retry_after and headers is None:
        headers = retry_after_header()
    return error_response(spec.http_status, message, spec.openai_type, param=param, headers=headers)


def _replica_error(message: str) -> web.Response:
    return kind_response(classify_replica_error(message), message)


class OpenAIApi:
    """The ``/v1`` routes. Collaborators come in through the constructor (``RouterService``
    composes them); the door mutates none of them.

    Args:
        router: routing analysis (tokenizer, block hashes) and the replicas.
        tracer: router spans.
        gate: limits, tenants and overload memory.
        lora_admin: the served LoRA adapters and their run-time loading.
        upstream: the client that streams a routed request to a replica.
        model_name: the served model name (``/v1/models``; requests may also say ``pagoda``).
        parsers: the reasoning and tool-call parsers chat answers are read with
            (``fleet.parsers``: ``--reasoning-parser``, ``--tool-call-parser``); ``None``: the
            ones the model's chat template calls for.
    """

    def __init__(self, router: Router, tracer: RouterTracer, gate: Gate, lora_admin: LoRAAdmin,
                 upstream: GrpcUpstream, model_name: str,
                 parsers: tuple[Optional[str], Optional[str]] = (None, None)) -> None:
        self.router = router
        self.parsers = parsers  # (--reasoning-parser, --tool-call-parser); None: from the chat template
        self.tracer = tracer
        self.gate = gate
        self.lora_admin = lora_admin
        self.upstream = upstream
        self.model_name = model_name
        self.created = int(time.time())

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The adapters served now: OpenAI ``model`` names them."""
        return self.lora_admin.names()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)

    def _model_cards(self) -> list[ModelCard]:
        return [ModelCard(id=self.model_name, object="model", created=self.created, owned_by="pagoda")] + [
            ModelCard(id=name, object="model", created=self.created, owned_by="pagoda", root=name,
                      parent=self.model_name) for name in self.lora_names]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(dump(ModelList(object="list", data=self._model_cards())))

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``): the card, or 404 naming the id."""
        model_id = request.match_info["model_id"]
        for card in self._model_cards():
            if card.id == model_id:
                return web.json_response(dump(card))
        return error_response(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")

    async def health(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /health``: 200 while some replica is routable, else 503."""
        return web.Response(status=200 if self.router.replicas.routable() else 503)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._lora_action(request, "load")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._lora_action(request, "unload")

    async def _lora_action(self, request: web.Request, action: str) -> web.Response:
        admin = self.lora_admin
        if not admin.allow_runtime:
            return kind_response(ErrorKind.PERMISSION_DENIED, f"{action}ing LoRA adapters at run time is not enabled "
                                 "on this router; start it with `pagoda router --allow-runtime-lora`")
        try:
            body = parse(LoadLoRAAdapterRequest if action == "load" else UnloadLoRAAdapterRequest,
                         json_input.loads(await request.read(), "body"))
        except json_input.JSONInputError as exc:
            return error_response(400, str(exc), param=exc.param)
        except OpenAIError as exc:
            return error_response(400, str(exc), param=exc.param)
        refused = check_change(request.get(TENANT_KEY), body.lora_name)
        if refused is not None:
            kind = ErrorKind.PERMISSION_DENIED if refused[0] == "forbidden" else ErrorKind.INVALID_REQUEST
            return kind_response(kind, refused[1], param="lora_name")
        replicas = self.router.replicas.routable()
        answer = await (admin.load(replicas, body.lora_name, body.lora_path) if action == "load"
                        else admin.unload(replicas, body.lora_name))
        if answer.error is not None:
            return kind_response(kind_of_http_status(answer.status), answer.error, param="lora_name")
        return web.json_response(answer.document)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    # ------------------------------------------------------------------ common path
    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = json_input.loads(await request.read(), "body")
        except json_input.JSONInputError as exc:
            self.gate.count("invalid_input")
            return error_response(400, str(exc), param=exc.param)
        try:
            if not isinstance(body, dict):
                raise OpenAIError("the request body must be a JSON object")
            model = body.get("model", self.model_name)
            if model not in (self.model_name, "pagoda", *self.lora_names):
                served = ", ".join(repr(m) for m in (self.model_name, *self.lora_names))
                return error_response(404, f"the model '{model}' does not exist; this server serves {served}",
                                      param="model", code="model_not_found")
            builts = await off_the_loop(self._build, body, chat)
        except (OpenAIError, LimitError) as exc:
            self.gate.count("invalid_input")
            return error_response(getattr(exc, "status", 400), str(exc), param=exc.param)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        answers = [Answer(chat, request_id, model, built, self.router.tokenizer, index_offset=k * built.n)
                   for k, built in enumerate(builts)]
        tickets, analyses = [], []
        try:
            for answer in answers:
                if model in self.lora_names:
                    answer.built.wire = answer.built.wire.with_options(lora_name=model)
                analysis, ticket = await self._admit(request, answer.built)
                tickets.append((ticket, answer))
                analyses.append(analysis)
            return await self._route_all(request, answers, analyses)
        except RateLimited as exc:
            return kind_response(ErrorKind.RATE_LIMITED, str(exc), headers=retry_after_header(exc.retry_after_s))
        finally:
            for ticket, answer in tickets:
                ticket.settle(answer.num_used_tokens)  # the quota keeps what it really used
                ticket.release()

    async def _admit(self, request: web.Request, built: OpenAIRequest) -> tuple[Any, Any]:
        """One prompt's tenant salt, routing analysis (its token ids go on to the replica) and
        rate-limit charge (raises RateLimited)."""
        gate = self.gate
        tenant = request.get(TENANT_KEY)
        if tenant is not None:
            built.wire = built.wire.with_options(cache_salt=gate.salt(tenant, built.wire.options.cache_salt))
        size = analysis_chars(built.prompt, built.wire)
        analysis, built.wire = await gate.analyze(size, analyzed, self.router, built.wire)
        num_prompt_tokens = analysis.num_prompt_tokens if analysis is not None else 0
        return analysis, gate.charge(tenant, num_prompt_tokens, built.wire.params)

    def _build(self, body: dict, chat: bool) -> list[OpenAIRequest]:
        """Validate and convert a body within the router's limits (raises OpenAIError /
        LimitError): one built request (chat), or one per prompt (completions)."""
        limits = self.gate.limits
        if chat and isinstance(body.get("messages"), list):
            limits.check_messages(body["messages"])
        if not chat and isinstance(body.get("prompt"), str):
            limits.check_prompt(body["prompt"])
        limits.check_sampling(openai_sampling_values(body, chat))  # before a tighter check of its own refuses it
        builts = ([build_chat_request(body, self.router.tokenizer, *self.parsers)] if chat
                  else build_completion_requests(body, self.router.tokenizer))
        for built in builts:
            if isinstance(built.prompt, str):  # token prompts: the replica checks them against max_model_len
                limits.check_prompt(built.prompt, "messages" if chat else "prompt")
            limits.check_params(built.wire.params)
        return builts

    async def _route_all(self, request: web.Request, answers: list[Answer], analyses: list[Any]) -> web.StreamResponse:
        """Every prompt's request, concurrently: collected whole, or streamed into one event
        stream (events interleaved as they come, told apart by ``index``, as vLLM's). The
        first failure ends the request (the others are cancelled): an error answer when
        nothing was streamed yet, else an ``error`` event."""
        stream = _EventStream(request) if answers[0].built.stream else None
        tasks = [asyncio.ensure_future(self._route(request, answer, analysis, k, stream))
                 for k, (answer, analysis) in enumerate(zip(answers, analyses))]
        failed = None
        try:
            for done in asyncio.as_completed(tasks):
                failed = await done
                if failed is not None:
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if stream is None:
            return kind_response(*failed) if failed is not None else web.json_response(merge_final(answers))
        if failed is not None and not stream.is_open:
            return kind_response(*failed)
        if failed is not None:
            await stream.send_error(failed[1])
        elif answers[0].built.include_usage:
            await stream.send(answers[0].usage_chunk(answers))
        return await stream.close()

    async def _route(self, request: web.Request, answer: Answer, analysis: Any, number: int,
                     stream: Optional["_EventStream"]) -> Optional[tuple[ErrorKind, str]]:
        """One prompt's request to a replica, its outputs into ``answer`` (and ``stream``).

        Returns:
            None, or the error (kind, message) that ended it.
        """
        carrier = {TRACEPARENT: request.headers[TRACEPARENT]} if TRACEPARENT in request.headers else {}
        with self.tracer.route_span("openai", carrier) as span:
            span.set_attribute("pagoda.openai.endpoint", "chat.completions" if answer.chat else "completions")
            upstream_id = answer.request_id if number == 0 else f"{answer.request_id}-{number}"
            wire = answer.built.wire
            turn = self.gate.turn(request.get(TENANT_KEY), analysis, wire.params, wire.options)
            responses = self.upstream.stream(analysis, RoutedRequest(upstream_id, wire, turn=turn), span)
            try:
                first = await anext(responses, None)
            except RateLimited as exc:  # the router's queue (flow control) could not hold it
                span.fail(str(exc))
                return ErrorKind.RATE_LIMITED, str(exc)
            except NoReplicaAvailable as exc:
                span.fail(str(exc))
                return ErrorKind.UNAVAILABLE, str(exc)
            except ReplicaFailed as exc:
                span.fail(str(exc))
                return ErrorKind.REPLICA_FAILED, str(exc)
            if first is not None and first.error_message:
                await responses.aclose()
                kind = classify_replica_error(first.error_message)
                if kind is ErrorKind.OVERLOADED:
                    self.gate.count("overloaded")
                return kind, first.error_message
            if stream is not None:
                return await self._stream(stream, answer, first, responses, span)
            return await self._collect(answer, first, responses, span)

    async def _collect(self, answer: Answer, first: Any, responses: Any, span: Any) -> Optional[tuple[ErrorKind, str]]:
        try:
            message = first
            while message is not None:
                if message.error_message:
                    return classify_replica_error(message.error_message), message.error_message
                answer.add(read_outputs(message.infer_response))
                message = await anext(responses, None)
        except ReplicaFailed as exc:
            span.fail(str(exc))
            return ErrorKind.REPLICA_FAILED, str(exc)
        return None

    async def _stream(self, stream: "_EventStream", answer: Answer, first: Any, responses: Any,
                      span: Any) -> Optional[tuple[ErrorKind, str]]:
        await stream.open()
        try:
            if answer.chat:
                await stream.send(answer.role_chunk())
            message = first
            while message is not None:
                if message.error_message:
                    return classify_replica_error(message.error_message), message.error_message
                for chunk in answer.chunks(read_outputs(message.infer_response)):
                    await stream.send(chunk)
                message = await anext(responses, None)
        except ReplicaFailed as exc:
            span.fail(str(exc))
            return ErrorKind.REPLICA_FAILED, str(exc)
        finally:
            await responses.aclose()
        return None


class _EventStream:
    """The SSE answer of a streamed request: opened on its first event, ``data: [DONE]`` last;
    an error after it opened is an ``error`` event (the SDK raises it)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.is_open = False
        self._opening = asyncio.Lock()  # several prompts' tasks may open it at once

    async def open(self) -> None:
        async with self._opening:
            if not self.is_open:
                await self.response.prepare(self.request)
                self.is_open = True

    async def send(self, obj: Any) -> None:
        await self.response.write(f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode())

    async def send_error(self, message: str) -> None:
        await self.send(error_body(message, _REPLICA_ERROR_TYPE))

    async def close(self) -> web.StreamResponse:
        await self.open()
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
