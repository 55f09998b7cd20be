"""Tenants at the router: API keys, cache isolation, per-tenant rate and concurrency limits.

Keys (``pagoda router --api-keys-file PATH``, or the same text in ``$PAGODA_API_KEYS``;
in Kubernetes a Secret mounted as a file): one key per line,
``KEY TENANT [rpm=N] [tpm=N] [concurrency=N] [admin]``; ``#`` starts a comment. ``admin``
keys alone may load and unload LoRA adapters at run time (``lora_admin.check_change``). Clients send
``Authorization: Bearer KEY`` (HTTP, OpenAI) or the ``authorization`` gRPC metadata with
the same value. Only SHA-256 digests of the keys are kept in memory, a lookup compares
digests, and no message, log line, metric or span ever contains a key (tests check it).
No keys configured: the open mode of before (every request is the anonymous tenant, no
salting, no limits), announced by a WARNING at start.

Isolation: a tenant's requests carry ``cache_salt = "tenant-" + HMAC-SHA256(router
secret, tenant id)`` (hex), followed by ``":<length>:<client salt>"`` when the client sends
its own, set by the router on every door before routing, so the router's block hashes and
the replica's agree and two tenants never share a KV block: a timing probe of another
tenant's prompt finds nothing cached. The salt is injective (the HMAC has a fixed length
and the client's salt is length-prefixed: tenant ``acme`` with salt ``x`` and tenant
``acme:x`` differ) and unguessable without the secret, so whoever reaches a replica
directly cannot send another tenant's salt. The secret (``load_router_secret``): the file
``--router-secret-file``, else ``$PAGODA_ROUTER_SECRET``, else one derived from the API
keys (``ApiKeys.derived_secret``: a hash of every key's digest, so routers sharing a keys
file agree and a restart keeps the salts, and only who holds every key can compute it;
changing the keys changes every salt, which starts tenants' caches cold).
``share_cache=True`` (``--share-prefix-cache``) keeps the client's salt as is.

Rate limits (``TenantLimiter``): per tenant, a token bucket of requests per minute and
one of tokens per minute, both holding at most one minute's worth; and a cap on requests
in flight. A request is charged before it runs, at its worst case: prompt tokens plus
``n`` x its effective ``max_tokens`` (the replicas' ``default_max_tokens`` when absent;
``Gate.num_tokens``); when it ends its door *settles* the ``Ticket`` with what it really
used (``Ticket.settle``: the difference goes back to the bucket, or is taken when it used
more), so the bucket tracks actual usage. A refusal is ``RateLimited`` (429 with
``Retry-After``: the time until the bucket holds enough). Buckets read an injected clock.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger(__name__)

API_KEYS_ENV = "PAGODA_API_KEYS"
ROUTER_SECRET_ENV = "PAGODA_ROUTER_SECRET"
MIN_SECRET_BYTES = 16


class AuthError(ValueError):
    """No key, or a key that is not configured (401). The message never contains the key."""


class RateLimited(RuntimeError):
    """A tenant is over one of its limits (429); ``retry_after_s`` says when to retry."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Tenant:
    """One tenant and its limits (``None``: unlimited)."""

    tenant_id: str
    requests_per_minute: Optional[float] = None
    tokens_per_minute: Optional[float] = None
    max_concurrent: Optional[int] = None
    is_admin: bool = False  # may load/unload LoRA adapters at run time (keys-file option ``admin``)


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeys:
    """Key digests -> tenants. Build with ``parse``; ``tenant_of`` checks an Authorization value."""

    def __init__(self, tenants_by_digest: dict[str, Tenant]) -> None:
        self._tenants = tenants_by_digest

    @classmethod
    def parse(cls, text: str, source: str, defaults: Optional[Tenant] = None) -> "ApiKeys":
        """Parse ``KEY TENANT [rpm=N] [tpm=N] [concurrency=N]`` lines.

        Raises:
            ValueError: naming the line (never the key) of a malformed entry.
        """
        defaults = defaults or Tenant("")
        tenants: dict[str, Tenant] = {}
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) < 2:
                raise ValueError(f"{source} line {number}: expected 'KEY TENANT [rpm=N] [tpm=N] [concurrency=N]'")
            limits = {"rpm": defaults.requests_per_minute, "tpm": defaults.tokens_per_minute,
                      "concurrency": defaults.max_concurrent}
            is_admin = "admin" in fields[2:]
            for option in (f for f in fields[2:] if f != "admin"):
                name, sep, value = option.partition("=")
                if not sep or name not in limits:
                    raise ValueError(f"{source} line {number}: unknown option {name!r}; "
                                     "known: rpm, tpm, concurrency, admin")
                try:
                    limits[name] = int(value) if name == "concurrency" else float(value)
                except ValueError:
                    raise ValueError(f"{source} line {number}: {name} must be a number, got {value!r}") from None
                if limits[name] <= 0:
                    raise ValueError(f"{source} line {number}: {name} must be > 0")
            if not _printable_ascii(fields[0]):
                raise ValueError(f"{source} line {number}: a key must be printable ASCII")
            digest = _digest(fields[0])
            if digest in tenants:
                raise ValueError(f"{source} line {number}: this key is listed twice")
            tenants[digest] = Tenant(fields[1], limits["rpm"], limits["tpm"], limits["concurrency"], is_admin)
        if not tenants:
            raise ValueError(f"{source}: no keys (lines 'KEY TENANT')")
        return cls(tenants)

    @property
    def num_keys(self) -> int:
        return len(self._tenants)

    def derived_secret(self) -> bytes:
        """A router secret derived from every key (see the module docstring)."""
        return hashlib.sha256(b"pagoda router secret\0" + "\n".join(sorted(self._tenants)).encode()).digest()

    def tenant_ids(self) -> list[str]:
        return sorted({t.tenant_id for t in self._tenants.values()})

    def tenant_of(self, authorization: Optional[str]) -> Tenant:
        """The tenant of an ``Authorization`` value (``Bearer KEY``).

        Raises:
            AuthError: missing, malformed, or unknown key.
        """
        if not authorization:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip() or not _printable_ascii(key):
            raise AuthError("malformed Authorization: expected 'Bearer <key>', the key in printable ASCII")
        tenant = self._tenants.get(_digest(key.strip()))
        if tenant is None:
            raise AuthError(f"invalid API key {_masked(key.strip())}")
        return tenant


def _masked(key: str) -> str:
    """A wrong key as the client can recognise it without the message repeating it (OpenAI's way:
    its first 6 and last 3 characters; a short key not at all)."""
    return f"{key[:6]}...{key[-3:]}" if len(key) >= 12 else "(of " + str(len(key)) + " characters)"


def load_api_keys(path: Optional[str], defaults: Optional[Tenant] = None,
                  environ: Optional[dict[str, str]] = None) -> Optional[ApiKeys]:
    """Keys from ``path`` or ``$PAGODA_API_KEYS``; ``None`` (open mode) when neither is set."""
    env = os.environ if environ is None else environ
    if path:
        with open(path, encoding="utf-8") as f:
            return ApiKeys.parse(f.read(), path, defaults)
    text = env.get(API_KEYS_ENV)
    if text:
        return ApiKeys.parse(text.replace(";", "\n"), f"${API_KEYS_ENV}", defaults)
    return None


def load_router_secret(path: Optional[str], environ: Optional[dict[str, str]] = None,
                       keys: Optional[ApiKeys] = None) -> bytes:
    """The secret tenant salts are keyed with: ``path``'s contents (surrounding whitespace
    dropped), else ``$PAGODA_ROUTER_SECRET``, else ``keys.derived_secret()``, else 32
    random bytes (with a WARNING: routers would disagree on salts).

    Raises:
        ValueError: a configured secret shorter than 16 bytes (never showing it).
    """
    env = os.environ if environ is None else environ
    if path:
        with open(path, "rb") as f:
            secret, source = f.read().strip(), path
    elif env.get(ROUTER_SECRET_ENV):
        secret, source = env[ROUTER_SECRET_ENV].strip().encode("utf-8"), f"${ROUTER_SECRET_ENV}"
    elif keys is not None:
        logger.info("tenant cache salts are keyed with a secret derived from the API keys (--router-secret-file / "
                    "$%s: one that survives key changes)", ROUTER_SECRET_ENV)
        return keys.derived_secret()
    else:
        logger.warning("no router secret (--router-secret-file / $%s): tenant cache salts use a random one; routers "
                       "will disagree on salts and a restart starts every tenant's cache cold; give every router "
                       "the same secret", ROUTER_SECRET_ENV)
        return os.urandom(32)
    check_secret(secret, source)
    return secret


def check_secret(secret: bytes, source: str = "the router secret") -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source}: the router secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")


def tenant_salt(tenant: Optional[Tenant], client_salt: Optional[str], share_cache: bool = False,
                *, secret: bytes) -> Optional[str]:
    """The ``cache_salt`` a request is sent with (see the module docstring)."""
    if tenant is None or share_cache:
        return client_salt
    keyed = hmac.new(secret, tenant.tenant_id.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"tenant-{keyed}" + (f":{len(client_salt)}:{client_salt}" if client_salt else "")


@dataclass
class _Bucket:
    tokens: float
    last: float


@dataclass
class _TenantState:
    requests: Optional[_Bucket] = None
    tokens: Optional[_Bucket] = None
    in_flight: int = 0


@dataclass
class Ticket:
    """An admitted request's hold on its tenant's concurrency and its token charge.

    ``release()`` (idempotent) ends the hold; ``settle(used)`` (once; later calls are
    ignored) reconciles the charge with the tokens the request really used.
    """

    state: Optional[_TenantState] = None
    released: bool = field(default=False)
    charged: int = 0
    per_minute: Optional[float] = None
    settled: bool = False

    def release(self) -> None:
        if not self.released and self.state is not None:
            self.state.in_flight -= 1
        self.released = True

    def settle(self, used: int) -> None:
        """Give back ``charged - used`` tokens (take the excess when ``used`` is larger)."""
        if self.settled:
            return
        self.settled = True
        bucket = self.state.tokens if self.state is not None else None
        if bucket is not None and self.per_minute is not None:
            bucket.tokens = min(self.per_minute, bucket.tokens + self.charged - max(0, int(used)))


class TenantLimiter:
    """Per-tenant token buckets and in-flight caps (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._states: dict[str, _TenantState] = {}
        self.num_limited: dict[str, int] = {}  # reason -> refusals (metrics)

    def admit(self, tenant: Optional[Tenant], num_tokens: int) -> Ticket:
        """Take one request and ``num_tokens`` tokens from the tenant's buckets.

        Raises:
            RateLimited: over a limit; nothing is taken then.
        """
        if tenant is None:
            return Ticket()
        state = self._states.setdefault(tenant.tenant_id, _TenantState())
        now = self.clock()
        if tenant.max_concurrent is not None and state.in_flight >= tenant.max_concurrent:
            self._refuse("concurrency", f"rate limited: tenant {tenant.tenant_id!r} has {state.in_flight} requests "
                                        f"in flight, at most {tenant.max_concurrent}", 1.0)
        wait_requests = self._wait(state, "requests", tenant.requests_per_minute, 1, now)
        if wait_requests > 0:
            self._refuse("requests_per_minute", f"rate limited: tenant {tenant.tenant_id!r} is over its "
                                                f"{tenant.requests_per_minute:g} requests per minute", wait_requests)
        wait_tokens = self._wait(state, "tokens", tenant.tokens_per_minute, num_tokens, now)
        if wait_tokens > 0:
            if tenant.tokens_per_minute is not None and num_tokens > tenant.tokens_per_minute:
                raise RateLimited(f"rate limited: this request's {num_tokens} tokens (prompt + n x max_tokens) exceed "
                                  f"tenant {tenant.tenant_id!r}'s {tenant.tokens_per_minute:g} tokens per minute; "
                                  "lower max_tokens or n", 60.0)
            self._refuse("tokens_per_minute", f"rate limited: tenant {tenant.tenant_id!r} is over its "
                                              f"{tenant.tokens_per_minute:g} tokens per minute", wait_tokens)
        if state.requests is not None:
            state.requests.tokens -= 1
        if state.tokens is not None:
            state.tokens.tokens -= num_tokens
        state.in_flight += 1
        return Ticket(state, charged=num_tokens, per_minute=tenant.tokens_per_minute)

    def _wait(self, state: _TenantState, kind: str, per_minute: Optional[float], cost: int, now: float) -> float:
        """Seconds until the bucket holds ``cost`` (0: it does now); refills it first."""
        if per_minute is None:
            return 0.0
        bucket = getattr(state, kind)
        if bucket is None:
            bucket = _Bucket(per_minute, now)
            setattr(state, kind, bucket)
        rate = per_minute / 60.0
        bucket.tokens = min(per_minute, bucket.tokens + (now - bucket.last) * rate)
        bucket.last = now
        return 0.0 if bucket.tokens >= cost else (cost - bucket.tokens) / rate

    def _refuse(self, reason: str, message: str, retry_after_s: float) -> None:
        self.num_limited[reason] = self.num_limited.get(reason, 0) + 1
        retry = max(1, math.ceil(retry_after_s))
        raise RateLimited(f"{message}; retry after {retry} s", retry)
