"""The router's Triton HTTP door relaying one replica's answer to its client, journaled for migration.

``Relay`` copies a replica's answer (``http_api._route`` posts the request): a JSON body as
it came; an SSE answer (``generate_stream``) event by event, each event's bytes unchanged
except one: the ``output_token_ids`` the router asked for (``api.migration``) are cut out of
the event's JSON text unless the client asked for them (a JSON string of digits, commas and
spaces, so a pattern removes exactly it). Each event's ``text_output``, ``output_token_ids``
and ``cumulative_logprob`` go to the request's ``Journal``.

One ``Relay`` serves every attempt of a request: the client's SSE answer, once opened, stays
open across a migration, and the next replica's events follow the last one relayed. What a
relay returns:

- the client's response, finished (the replica answered);
- an overload message (``str``): the replica refused the request before anything was sent
  (the door tries another replica);
- ``Broken``: the replica failed: the connection broke (before or during the answer), or it
  answered with an error that is its own fault (``contracts.errors.is_replica_fault``: an
  SSE error event, or an error body). The door asks the journal for a plan (restart,
  resume, or the failure to the client: ``finish_failed``).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import aiohttp
from aiohttp import web

from pagoda.contracts.errors import error_text, is_overloaded, is_replica_fault
from pagoda.fleet.api.migration import CONNECTION_LOST, REPLICA_FAULT, TOKEN_IDS_OUTPUT, Journal

# The token ids the router asked for, as tritonserver writes them in an event's JSON (one completion).
_TOKEN_IDS = re.compile(rb',"' + TOKEN_IDS_OUTPUT.encode() + rb'":"\[[0-9, ]*\]"|"' + TOKEN_IDS_OUTPUT.encode()
                        + rb'":"\[[0-9, ]*\]",?')
_FAILURES = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)


@dataclass
class Broken:
    """The replica failed the request: ``message`` for logs and the client; ``reason``
    (``migration.CONNECTION_LOST`` / ``REPLICA_FAULT``); ``answer``: the replica's own
    error answer (status, body), relayed as it was when the request is not migrated."""

    message: str
    reason: str = CONNECTION_LOST
    answer: Optional[tuple[int, bytes]] = None


class Relay:
    """One request's answer to its client, across attempts (module docstring).

    Args:
        client: the client's request (its SSE answer is prepared on it).
        journal: what the client received (``api.migration``).
        hides_token_ids: cut ``output_token_ids`` out of the events.
    """

    def __init__(self, client: web.Request, journal: Journal, hides_token_ids: bool) -> None:
        self.client = client
        self.journal = journal
        self.hides_token_ids = hides_token_ids
        self.response: Optional[web.StreamResponse] = None

    async def relay(self, upstream: aiohttp.ClientResponse, replica_id: str) -> Union[web.StreamResponse, str, Broken]:
        """Copy ``upstream`` (the replica's answer) to the client; see the module docstring."""
        content_type = upstream.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            return await self._body(upstream, replica_id, content_type)
        buffer = b""
        try:
            async for chunk in upstream.content.iter_any():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    verdict = await self._event(event + b"\n\n", replica_id, content_type, upstream.status)
                    if verdict is not None:
                        return verdict
        except _FAILURES as exc:
            return Broken(f"replica {replica_id} failed {self._where()}: {type(exc).__name__}: {exc}")
        if buffer.strip():
            await self._write(buffer, content_type, upstream.status)
        await self._open(content_type, upstream.status)
        await self.response.write_eof()
        return self.response

    async def finish_failed(self, message: str) -> web.StreamResponse:
        """End the client's opened SSE answer with one error event (Triton's SSE error shape)."""
        assert self.response is not None, "only an opened answer ends with an error event"
        await self.response.write(f"data: {json.dumps({'error': message})}\n\n".encode())
        await self.response.write_eof()
        return self.response

    def _where(self) -> str:
        return "while streaming this request" if self.journal.num_responses else "before answering"

    async def _body(self, upstream: aiohttp.ClientResponse, replica_id: str,
                    content_type: str) -> Union[web.Response, str, Broken]:
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Broken(f"replica {replica_id} failed before answering: {type(exc).__name__}: {exc}")
        if upstream.status != 200:
            message = error_text(data)
            if is_overloaded(message):
                return message
            if is_replica_fault(message):
                return Broken(f"replica {replica_id} failed: {message}", REPLICA_FAULT, (upstream.status, data))
        return web.Response(status=upstream.status, body=data, headers={"Content-Type": content_type})

    async def _event(self, event: bytes, replica_id: str, content_type: str,
                     status: int) -> Union[None, str, Broken]:
        """Relay one SSE event (or say why not: an overload before anything was sent, a failure)."""
        document = _event_document(event)
        if document is not None and "error" in document:
            message = str(document["error"])
            if is_overloaded(message) and self.response is None:
                return message
            if is_replica_fault(message):
                return Broken(f"replica {replica_id} failed: {message}", REPLICA_FAULT)
        elif document is not None:
            self.journal.observe(_one(document.get("text_output")), _one(document.get(TOKEN_IDS_OUTPUT)),
                                 _one(document.get("cumulative_logprob")))
            if self.hides_token_ids:
                event = _TOKEN_IDS.sub(b"", event, count=1)
        await self._write(event, content_type, status)
        return None

    async def _open(self, content_type: str, status: int) -> None:
        if self.response is None:
            self.response = web.StreamResponse(status=status, headers={"Content-Type": content_type,
                                                                       "Cache-Control": "no-cache"})
            await self.response.prepare(self.client)

    async def _write(self, data: bytes, content_type: str, status: int) -> None:
        await self._open(content_type, status)
        await self.response.write(data)


def _event_document(event: bytes) -> Optional[dict[str, Any]]:
    """An SSE event's ``data:`` JSON object (None: not one)."""
    text = event.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    try:
        value = json.loads(text[len("data:"):])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _one(value: Any) -> Any:
    """A one-completion output's value (tritonserver writes a one-element tensor as its element)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value
