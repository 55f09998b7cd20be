"""Disaggregated prefill/decode on the router's Triton HTTP generate door (``http_api._route``).

The same two stages as the gRPC and OpenAI doors (``api.upstream``, docs/kv_transfer.md),
over HTTP: when the routable replicas include a ``prefill`` and a ``decode`` role and a
request for pagoda's model carries no ``kv_transfer_params`` of its own, its prefill stage
(``first_token.prefill_stage``: ``kv_transfer_params`` ``{"do_remote_decode": true}`` and the
stage's ``max_tokens``/``min_tokens``) goes to a prefill replica as a body of its own, and its
answer's ``kv_transfer_params`` output, the KV handle, becomes the request's
``kv_transfer_params`` before it is routed, among the other replicas, as usual. A first stage
that fails is logged and the request runs whole on a decode replica: the same answer, later.

Early first token (``first_token``): a ``generate_stream`` request that streams
(``"stream": true``) has its first stage sent to the prefill replica's ``generate_stream``;
that stage's first event is written to the client at once (the client's SSE answer opens
then), and the decode replica's events follow with that token cut from their front
(``relay_into``: each event re-serialized until the cut is done, then copied byte for
byte). Once the answer is open, a failure is an SSE error event (``end_with_error``),
as for a replica that fails mid-stream. Otherwise the first stage is a ``generate`` POST
whose token is dropped, and the decode replica's answer is relayed unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

import aiohttp
from aiohttp import web

from pagoda.contracts.errors import error_text, is_overloaded
from pagoda.fleet.api.first_token import FirstTokenMismatch, Splice, is_early, prefill_stage, seeded_for_stages
from pagoda.fleet.api.generate_request import GenerateRequest
from pagoda.fleet.api.routed_request import as_released
from pagoda.fleet.routing.router import NoReplicaAvailable

logger = logging.getLogger(__name__)

_CUT_OUTPUTS = ("text_output", "num_output_tokens", "logprobs")


def is_disaggregated(router: Any, generate: GenerateRequest) -> bool:
    """Prefill and decode replicas routable, and a request for pagoda's model that does not
    drive the stages itself."""
    roles = {r.role for r in router.replicas.routable()}
    return "prefill" in roles and "decode" in roles and generate.wire is not None and \
        generate.wire.options.kv_transfer_params is None


@dataclass
class StageOne:
    """The first stage's outcome: the KV handle; with an early first token, the client's
    opened SSE answer and what to cut from the decode stream."""

    handle: Optional[dict] = None
    response: Optional[web.StreamResponse] = None
    splice: Optional[Splice] = None


async def prefill(session: aiohttp.ClientSession, router: Any, gate: Any, analysis: Any,
                  generate: GenerateRequest, client: web.Request,
                  turn: Optional[Any] = None) -> tuple[GenerateRequest, StageOne]:
    """Run the first stage on a prefill replica (module docstring); with flow control, the
    request first waits for its ``turn`` in the router's queue (``Gate.choose``).

    Returns:
        The request for the decode stage (with the KV handle, and the seed both stages share
        when the router chose one), and the ``StageOne``; on failure (logged) the request
        without a handle.

    Raises:
        QueueRefused: the router's queue could not hold the request.
    """
    early = is_early(generate.wire) and client.path.endswith("generate_stream")
    generate = dataclasses.replace(generate, wire=seeded_for_stages(generate.wire, early))
    stage = StageOne()
    skip = [r.replica_id for r in router.replicas.all() if r.role != "prefill"]
    try:
        decision = await gate.choose(router, analysis, skip, 1, turn)
    except NoReplicaAvailable as exc:
        logger.warning("prefill stage: %s; the decode replica computes the prompt", exc)
        return generate, stage
    path = "generate_stream" if early else "generate"
    url = f"http://{decision.replica.endpoints['http']}/v2/models/{generate.model}/{path}"
    try:
        stage_wire = prefill_stage(as_released(generate.wire, turn), early)  # ranked as the decode stage is
        async with session.post(url, json=generate.body(wire=stage_wire)) as response:
            if early and response.status == 200:
                await _stream_first_stage(response, stage, client)
            else:
                answer = await response.json(content_type=None)
                if response.status == 200 and isinstance(answer, dict) and answer.get("kv_transfer_params"):
                    stage.handle = _handle(answer["kv_transfer_params"])
        if stage.handle is None:
            logger.warning("prefill stage on %s gave no KV handle (%s): the decode replica computes the prompt",
                           decision.replica.replica_id, response.status)
    except (aiohttp.ClientError, ValueError, TimeoutError) as exc:
        logger.warning("prefill stage on %s failed (%s); the decode replica computes the prompt",
                       decision.replica.replica_id, exc)
    finally:
        router.release(decision)
    if stage.handle is not None:
        router.num_two_stage += 1
        generate = dataclasses.replace(generate, wire=generate.wire.with_options(kv_transfer_params=stage.handle))
    return generate, stage


def _handle(value: Any) -> dict:
    return json.loads(value) if isinstance(value, str) else value


async def _stream_first_stage(response: aiohttp.ClientResponse, stage: StageOne, client: web.Request) -> None:
    """Read the first stage's events: the first token's goes to the client, the last holds the handle."""
    async for event in _events(response.content):
        answer = _event_json(event)
        if not isinstance(answer, dict) or "error" in answer:
            logger.warning("prefill stage answered %r", event[:200])
            return
        if answer.get("kv_transfer_params"):
            stage.handle = _handle(answer["kv_transfer_params"])
            return
        if stage.response is None:
            stage.splice = Splice.of(answer.get("text_output"), answer.get("num_output_tokens"), answer.get("logprobs"))
            stage.response = web.StreamResponse(status=200, headers={
                "Content-Type": response.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            await stage.response.prepare(client)
            await stage.response.write(event + b"\n\n")


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The SSE events of an answer, one at a time (without their blank-line ends)."""
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event
    if buffer.strip():
        yield buffer


def _event_json(event: bytes) -> Any:
    """An SSE event's ``data:`` JSON (None when it has none, or not JSON)."""
    if b"data:" not in event:
        return None
    try:
        return json.loads(event.split(b"data:", 1)[1])
    except ValueError:
        return None


async def end_with_error(response: web.StreamResponse, message: str) -> web.StreamResponse:
    """End an opened SSE answer with Triton's error event."""
    await response.write(f"data: {json.dumps({'error': message})}\n\n".encode())
    await response.write_eof()
    return response


async def relay_into(stage: StageOne, upstream: aiohttp.ClientResponse, router: Any, replica: Any,
                     span: Any) -> Union[web.StreamResponse, str]:
    """Relay the decode replica's answer into the client's opened SSE answer, the front cut.

    Returns:
        The answer, ended (a failure as its last event); or the overload message when the
        replica refused the request as overloaded before its first event (the caller tries
        another replica).
    """
    response, splice = stage.response, stage.splice
    assert response is not None and splice is not None, "relay_into needs the early event's answer"
    try:
        if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
            data = await upstream.read()
            if is_overloaded(data.decode("utf-8", "replace")):
                return error_text(data)
            return await end_with_error(response, error_text(data) or f"replica answered {upstream.status}")
        is_first = True
        async for event in _events(upstream.content):
            answer = _event_json(event)
            if isinstance(answer, dict) and "error" in answer and is_first and is_overloaded(str(answer["error"])):
                return str(answer["error"])
            is_first = False
            if isinstance(answer, dict) and "error" not in answer and not splice.is_done:
                cut = splice.cut({k: answer[k] for k in _CUT_OUTPUTS if k in answer})
                event = b"data: " + json.dumps({**answer, **cut}).encode()
            await response.write(event + b"\n\n")
    except FirstTokenMismatch as exc:
        span.fail(str(exc))
        return await end_with_error(response, str(exc))
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        failure = (f"replica {replica.replica_id} failed while streaming this request: {type(exc).__name__}: "
                   f"{exc}. The router avoids it until it is healthy again; retry the request.")
        router.replicas.mark_unhealthy(replica, failure)
        span.fail(failure)
        return await end_with_error(response, failure)
    await response.write_eof()
    return response
