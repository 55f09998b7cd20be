"""The router's front gate: what every request passes before it is routed.

``Gate`` bundles the input limits (``limits.RequestLimits``), the tenants
(``auth.ApiKeys``, ``auth.TenantLimiter``, the tenant salt) and the overload memory, so
each door (``http_api``, ``openai_api``, ``grpc_proxy``) adds one call per concern
instead of its own policy. ``RouterService`` makes one and gives it to each door's
constructor (and to the upstream client, for the overload memory).

Order at every door: body size (HTTP, from ``Content-Length``, before reading) ->
API key (401) -> parse and validate (400 naming the field; the prompt's character cap,
``--max-prompt-chars``, before anything is tokenized) -> tenant salt -> routing analysis
(tokens) -> rate limits (429 + ``Retry-After``) -> the router's queue while the fleet is
saturated (``flow_control``, ``--queue-size-per-tenant``: a ``Turn`` per request, awaited by
``choose``; 429 + ``Retry-After`` when it cannot wait) -> route.

Routing analysis (tokenizing and hashing the prompt: about a second per 1 MB) of a prompt
longer than ``INLINE_ANALYSIS_CHARS`` never runs on the event loop that relays every other
stream: ``Gate.analyze`` runs it on the gate's small thread pool (the tokenizer releases
the GIL; hashing yields it every few ms), so a huge prompt adds milliseconds, not seconds,
to other requests' inter-token gaps; a short one is analyzed inline (1-2 ms).

Overload: a replica that refuses a request because its waiting queue is full (an error
``pagoda.contracts.errors.classify_replica_error`` calls ``OVERLOADED``) is remembered as
full for ``retry_after_s`` (``mark_full``); ``route_excluding`` then keeps new requests
off it while another replica has room, and the request itself is retried on a replica
not yet tried. Only when every replica refused does the client get the overload error:
429 + ``Retry-After`` on OpenAI, 503 + ``Retry-After`` on Triton HTTP, the replica's
error message on gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from aiohttp import web

from pagoda.contracts.errors import DEFAULT_RETRY_AFTER_S
from pagoda.fleet.gate.auth import (ApiKeys, AuthError, RateLimited, Tenant, TenantLimiter, Ticket, check_secret,
                                    tenant_salt)
from pagoda.fleet.gate.fair_queue import OPEN_TENANT, QueueRefused, Turn
from pagoda.fleet.gate.flow_control import FlowControl, FlowOptions, Saturation
from pagoda.fleet.gate.limits import LimitError, RequestLimits, as_int

logger = logging.getLogger(__name__)

# The reasons of pagoda_router_refused_total (rate_limited_<bucket> rows come from the limiter).
REFUSAL_REASONS = ("unauthenticated", "invalid_input", "body_too_large", "rate_limited", "overloaded")
# Prompts up to this many characters are tokenized on the event loop (1-2 ms), longer ones
# on the gate's thread pool.
INLINE_ANALYSIS_CHARS = 1024

# Where the HTTP middleware leaves the caller's tenant on the aiohttp request.
TENANT_KEY = web.RequestKey("pagoda_tenant", object)


class Gate:
    """Limits, tenants and overload memory of one router.

    Args:
        limits: input limits.
        keys: API keys, or ``None`` for the open mode.
        share_cache: keep clients' own salts (tenants may share cached blocks).
        clock: monotonic seconds (rate limits and overload memory; tests inject one).
        analysis_threads: threads that tokenize prompts off the event loop.
        salt_secret: the router secret tenant salts are keyed with (``auth.load_router_secret``;
            ``None``: random bytes for this gate, for tests and the open mode).
        flow: the flow-control flags (``flow_control``; ``None``: off).
    """

    def __init__(self, limits: Optional[RequestLimits] = None, keys: Optional[ApiKeys] = None,
                 share_cache: bool = False, clock: Callable[[], float] = time.monotonic,
                 analysis_threads: int = 2, salt_secret: Optional[bytes] = None,
                 flow: Optional[FlowOptions] = None) -> None:
        self.limits = limits or RequestLimits()
        self.keys = keys
        self.share_cache = share_cache
        if salt_secret is not None:
            check_secret(salt_secret)
        self._salt_secret = salt_secret if salt_secret is not None else os.urandom(32)
        self.clock = clock
        self.limiter = TenantLimiter(clock)
        self._full_until: dict[str, float] = {}
        # reason -> count (/metrics; never a key or tenant secret). Every reason starts at 0, so
        # dashboards and alerts see the series before the first refusal (rate() needs two samples).
        self.num_refused: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        self._analysis_pool = ThreadPoolExecutor(analysis_threads, thread_name_prefix="pagoda-tokenize")
        flow = flow or FlowOptions()
        self.flow = FlowControl(flow, Saturation(flow, self.full_replica_ids), clock)

    def announce(self) -> None:
        """Log the mode once at start: loudly when anyone may call."""
        if self.keys is None:
            logger.warning("OPEN MODE: no API keys configured (--api-keys-file / $PAGODA_API_KEYS); every caller "
                           "is served, tenants are not isolated and no rate limits apply")
        else:
            logger.info("API keys: %d keys for %d tenants; prefix cache %s across tenants", self.keys.num_keys,
                        len(self.keys.tenant_ids()), "shared" if self.share_cache else "isolated")

    def count(self, reason: str) -> None:
        assert reason in REFUSAL_REASONS, f"unknown refusal reason {reason!r}: add it to REFUSAL_REASONS"
        self.num_refused[reason] = self.num_refused.get(reason, 0) + 1

    # ------------------------------------------------------------------ tenants
    def authenticate(self, authorization: Optional[str]) -> Optional[Tenant]:
        """The caller's tenant (``None`` in open mode). Raises ``AuthError``."""
        if self.keys is None:
            return None
        try:
            return self.keys.tenant_of(authorization)
        except AuthError:
            self.count("unauthenticated")
            raise

    def salt(self, tenant: Optional[Tenant], client_salt: Optional[str]) -> Optional[str]:
        return tenant_salt(tenant, client_salt, self.share_cache, secret=self._salt_secret)

    def num_tokens(self, num_prompt_tokens: int, sampling: Any) -> int:
        """A request's worst case: prompt + n x effective max_tokens (the replicas'
        ``default_max_tokens`` when absent). ``sampling``: a ``SamplingParams``, or the
        SamplingParams-named values of a request forwarded as it came."""
        if isinstance(sampling, dict):
            n, max_tokens = as_int(sampling.get("n")), as_int(sampling.get("max_tokens"))
        else:
            n, max_tokens = sampling.n, sampling.max_tokens
        return num_prompt_tokens + max(1, n or 1) * (max_tokens if max_tokens and max_tokens > 0
                                                      else self.limits.default_max_tokens)

    def charge(self, tenant: Optional[Tenant], num_prompt_tokens: int, sampling: Any) -> Ticket:
        """``admit`` the request's worst case (``num_tokens``); the door ``settle``s the
        ticket with what it used when it ends. Raises ``RateLimited``."""
        return self.admit(tenant, self.num_tokens(num_prompt_tokens, sampling))

    def admit(self, tenant: Optional[Tenant], num_tokens: int) -> Ticket:
        """Charge the tenant's rate limits. Raises ``RateLimited``."""
        try:
            return self.limiter.admit(tenant, num_tokens)
        except RateLimited:
            self.count("rate_limited")
            raise

    def turn(self, tenant: Optional[Tenant], analysis: Any, sampling: Any, options: Any = None) -> Optional[Turn]:
        """A request's place in the router's queue (``flow_control``), or ``None`` while flow
        control is off. ``analysis``: its routing analysis (prompt tokens); ``sampling`` as for
        ``num_tokens`` (the cost: prompt + n x max_tokens); ``options``: its ``RequestOptions``
        (priority band, timeout; ``None``: band 0, no timeout)."""
        if not self.flow.enabled:
            return None
        cost = self.num_tokens(analysis.num_prompt_tokens if analysis is not None else 0, sampling)
        return self.flow.turn(tenant.tenant_id if tenant is not None else OPEN_TENANT,
                              options.priority if options is not None else 0, cost,
                              options.timeout if options is not None else None)

    async def analyze(self, num_chars: int, analyze: Callable[..., Any], *args: Any) -> Any:
        """``analyze(*args)`` (``Router.analyze``, or a door's wrapper of it) for a prompt of
        ``num_chars`` characters: inline when it is short (``INLINE_ANALYSIS_CHARS``, a
        millisecond or two, about the hop to a thread), else on the analysis pool, off the
        event loop. The caller has checked the prompt's character cap."""
        if num_chars <= INLINE_ANALYSIS_CHARS:
            return analyze(*args)
        return await asyncio.get_running_loop().run_in_executor(self._analysis_pool, analyze, *args)

    # ------------------------------------------------------------------ overload memory
    def mark_full(self, replica_id: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        self._full_until[replica_id] = self.clock() + retry_after_s

    def full_replica_ids(self) -> list[str]:
        now = self.clock()
        for replica_id in [r for r, until in self._full_until.items() if until <= now]:
            del self._full_until[replica_id]
        return list(self._full_until)

    async def choose(self, router: Any, analysis: Any, tried: list[str], attempt: int,
                     turn: Optional[Turn] = None) -> Any:
        """``router.choose`` avoiding replicas known full while another has room; a request with
        a ``turn`` not yet admitted first waits for it in the router's queue (``flow_control``).

        Raises:
            QueueRefused: it could not wait (its tenant's queue full, its deadline passed).
            NoReplicaAvailable: as ``Router.choose``.
        """
        if turn is not None:
            await self.flow.wait(turn, router.replicas)
        try:
            decision = await self._choose(router, analysis, tried, attempt)
            self.flow.started(turn, decision)
            return decision
        finally:
            self.flow.routed(turn)

    async def _choose(self, router: Any, analysis: Any, tried: list[str], attempt: int) -> Any:
        from pagoda.fleet.routing.router import NoReplicaAvailable

        full = [r for r in self.full_replica_ids() if r not in tried]
        if full:
            try:
                return await router.choose(analysis, exclude=[*tried, *full], attempt=attempt)
            except NoReplicaAvailable:
                pass  # every replica with room was tried: a full one may have drained since
        return await router.choose(analysis, exclude=tried, attempt=attempt)


def retry_after_header(seconds: float = DEFAULT_RETRY_AFTER_S) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


__all__ = ["Gate", "retry_after_header", "AuthError", "RateLimited", "QueueRefused", "Turn",
           "LimitError", "TENANT_KEY"]
