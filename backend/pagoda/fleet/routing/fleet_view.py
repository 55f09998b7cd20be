"""The router's view of the fleet in Redis: registry heartbeats and prefix-index matches.

``IndexView`` is what ``Router`` reads and tells: ``available``, ``match`` (replica ->
leading blocks, or ``None`` while the index cannot answer), the ``pending`` index of
routing-time affinity (``pagoda.fleet.routing.affinity``) and the two things a decision
leaves for the fleet (``share_decision``, ``confirm_pending_on_kv_events``). The base holds
no index (nothing matches; a test stand-in overrides ``match``); ``FleetView`` is the
Redis one.

Redis faults (``FleetView``): every Redis call runs with a timeout (``redis_timeout_s``) in
a small thread pool, so a slow or dead Redis never stalls the event loop. The first failure
marks Redis unavailable; from then on no request waits on Redis: routing is load-only
(``least_loaded`` over the router's own in-flight counts, the cached heartbeat values are
ignored as stale) over the replicas known from the last registry read or the static list.
The registry refresh loop keeps probing; its first success makes Redis available again and
prefix routing resumes by itself.

Index reads: with ``index_mode="follower"`` matches come from an ``IndexFollower`` (a local
mirror fed by the event stream, replayed from the start when the router joins late) as
soon as it reports ``is_synced``; until then, and with ``index_mode="direct"``, each
request asks ``PrefixIndex.match`` (at most two round trips).

Reaping: every ``reap_interval_s`` the registry refresh also runs
``ReplicaRegistry.reap_expired`` (idempotent and race-safe, so every router may), which
drops the index entries of replicas whose heartbeat expired; the count is exported as
``pagoda:router_reaped_replicas_total``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from pagoda.fleet.index.retry import RateLimitedLog
from pagoda.fleet.routing.affinity import AffinityShare, PendingIndex

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)


class IndexView:
    """The index surface the router uses; this base has no index (module docstring)."""

    available: bool = False
    num_reaped: int = 0

    def __init__(self) -> None:
        self.pending = PendingIndex()  # shared with the other routers by FleetView

    async def match(self, block_hashes: list[str]) -> Optional[dict[str, int]]:
        """Matched leading blocks per replica; ``None`` when the index cannot answer."""
        return {} if self.available else None

    def share_decision(self, replica_id: str, block_hashes: Sequence[str], ttl_s: float) -> None:
        """Tell the other routers about a decision recorded as pending (no-op without Redis)."""

    def confirm_pending_on_kv_events(self) -> None:
        """Let the replicas' KV events drop ``pending`` entries (no-op without an event feed)."""


class FleetView(IndexView):
    """The router's Redis side: registry heartbeats and prefix-index matches, fault tolerant.

    Args:
        redis_client: a ``redis.Redis`` (sync; calls run in a thread pool).
        model_name: the fleet key namespace (served model name).
        index_mode: ``"follower"`` or ``"direct"`` (see the module docstring).
        timeout_s: the longest any request waits on Redis.
        reap_interval_s: how often ``refresh`` also reaps expired replicas (0: never).
        clock: monotonic seconds (when a reap is due).
    """

    def __init__(self, redis_client: "redis.Redis", model_name: str, index_mode: str = "follower",
                 timeout_s: float = 0.05, reap_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from pagoda.fleet.index.mirror import IndexFollower
        from pagoda.fleet.index.prefix_index import PrefixIndex
        from pagoda.fleet.index.registry import ReplicaRegistry

        super().__init__()
        if index_mode not in ("follower", "direct"):
            raise ValueError(f"index mode must be 'follower' or 'direct', got {index_mode!r}")
        self.client = redis_client
        self.registry = ReplicaRegistry(redis_client, model_name)
        self.index = PrefixIndex(redis_client, model_name)
        self.follower = IndexFollower(redis_client, model_name) if index_mode == "follower" else None
        self.timeout_s = timeout_s
        self.available = False
        self.last_error = ""
        self.num_failures = 0
        self.last_infos: list[Any] = []
        self.share = AffinityShare(redis_client, model_name, self.pending)
        self.reap_interval_s = reap_interval_s
        self.clock = clock
        self.num_reaped = 0
        self._next_reap = float("-inf")
        self._log = RateLimitedLog(logger, interval_s=30.0)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagoda-router-redis")

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: Optional[float] = None) -> Any:
        """Run a Redis-touching function with a timeout; a failure marks Redis unavailable."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, fn, *args), timeout_s or self.timeout_s)
        except Exception as exc:
            self._failed(exc)
            raise

    def _failed(self, exc: BaseException) -> None:
        if self.available:
            self._log.reset()
        self._log.warning("Redis unavailable (%s: %s): routing by load only until it answers again",
                          type(exc).__name__, exc)
        self.available = False
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.num_failures += 1

    async def refresh(self, timeout_s: float = 1.0) -> Optional[list[Any]]:
        """Read the registry; ``None`` when Redis did not answer (the cache stays)."""
        try:
            infos = await self.call(self.registry.list_replicas, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - already recorded by call()
            return None
        if not self.available:
            logger.info("Redis is available again: prefix-aware routing resumes")
        self.available = True
        self.last_infos = list(infos)
        await self._reap_if_due()
        return self.last_infos

    async def _reap_if_due(self) -> None:
        """Reap expired replicas every ``reap_interval_s`` (module docstring)."""
        now = self.clock()
        if self.reap_interval_s <= 0 or now < self._next_reap:
            return
        self._next_reap = now + self.reap_interval_s
        try:
            reaped = await self.call(self.registry.reap_expired, timeout_s=1.0)
        except Exception:  # noqa: BLE001 - recorded by call(); the next refresh retries
            self._next_reap = now
            return
        if reaped:
            logger.info("reaped expired replicas %s: their heartbeats lapsed; index entries removed", reaped)
            self.num_reaped += len(reaped)
            for rid in reaped:
                self.pending.remove_replica(rid)
                if self.follower is not None:
                    self.follower.local.remove_replica(rid)

    async def match(self, block_hashes: list[str]) -> Optional[dict[str, int]]:
        """Matched leading blocks per replica; ``None`` when Redis is unavailable."""
        if not self.available:
            return None
        if not block_hashes:
            return {}
        if self.follower is not None and self.follower.is_synced:
            return self.follower.match(block_hashes)
        try:
            return await self.call(self.index.match, block_hashes)
        except Exception:  # noqa: BLE001 - recorded; this request routes by load
            return None

    def share_decision(self, replica_id: str, block_hashes: Sequence[str], ttl_s: float) -> None:
        if self.available:
            self.share.publish(replica_id, block_hashes, ttl_s)

    def confirm_pending_on_kv_events(self) -> None:
        if self.follower is not None:
            self.follower.on_events = self.pending.confirm

    def start(self) -> None:
        if self.follower is not None:
            self.follower.start()
        self.share.start()

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.share.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
