"""Stored Responses API turns, for ``previous_response_id``: off by default, kept per tenant with a TTL.

A turn is stored as its whole conversation (chat messages: the earlier turns', this turn's
input, and its answer as an assistant message with its tool calls), so a follow-up that names it
continues from it without resending it. Keys are per tenant (``redis_keys.response_key``): a
tenant never reads another tenant's responses, whatever id it sends; an id that is unknown,
expired, or another tenant's is the same 404.

Two places to keep them: Redis (a router with ``--redis-url``: every router of the fleet sees
them; ``RedisResponseStore``) or this process's memory (``MemoryResponseStore``: a router alone,
or ``pagoda serve``'s OpenAI door), both with ``ttl_s``; memory holds at most ``max_entries``,
dropping the oldest.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from pagoda.contracts import redis_keys as keys

if TYPE_CHECKING:
    import redis


class ResponseStore(Protocol):
    async def put(self, tenant: str, response_id: str, messages: list[dict]) -> None: ...

    async def get(self, tenant: str, response_id: str) -> Optional[list[dict]]: ...


class MemoryResponseStore:
    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, list[dict]]] = OrderedDict()

    async def put(self, tenant: str, response_id: str, messages: list[dict]) -> None:
        self._entries[(tenant, response_id)] = (self.clock() + self.ttl_s, messages)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def get(self, tenant: str, response_id: str) -> Optional[list[dict]]:
        entry = self._entries.get((tenant, response_id))
        if entry is None or entry[0] <= self.clock():
            self._entries.pop((tenant, response_id), None)
            return None
        return entry[1]


class RedisResponseStore:
    """Args:
    redis_client: the router's ``redis.Redis`` (sync; its calls run on a thread).
    model: the fleet's key namespace.
    """

    def __init__(self, redis_client: "redis.Redis", model: str, ttl_s: float = 3600.0) -> None:
        self.redis = redis_client
        self.model = model
        self.ttl_s = ttl_s

    async def put(self, tenant: str, response_id: str, messages: list[dict]) -> None:
        key = keys.response_key(self.model, tenant, response_id)
        await asyncio.to_thread(self.redis.set, key, json.dumps(messages), px=int(self.ttl_s * 1000))

    async def get(self, tenant: str, response_id: str) -> Optional[list[dict]]:
        value = await asyncio.to_thread(self.redis.get, keys.response_key(self.model, tenant, response_id))
        return json.loads(value) if value is not None else None
