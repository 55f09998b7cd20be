"""The replica side of the fleet layer: block events and heartbeats to Redis.

The engine thread hands over what each step produced (``submit_events``,
``submit_stats``); both only take a short lock and return, so Redis can never stall a
step. The publisher's own thread flushes every ``flush_interval_s``: one pipelined round
trip holds the batch's index update (the atomic apply script of ``pagoda.fleet.index.prefix_index``,
which also appends the batch to the events stream) and, when due, the heartbeat
(``HSET`` + ``PEXPIRE ttl_s`` + ``SADD`` to the registry). A replica that stops
heartbeating vanishes from ``ReplicaRegistry.list_replicas`` when its key expires.

The publisher keeps a mirror of the replica's cached blocks (hash -> parent hash and
tokens), updated from every submitted event whether or not Redis is reachable. That makes
failures cheap to repair: whenever the published state may differ from the truth, the
next flush publishes a *resync* batch, ``AllBlocksCleared`` followed by one
``BlockStored`` per mirrored block, instead of the lost events. Resyncs happen:

- at start (a new epoch; clears what an earlier process with this replica id left),
- after a failed flush (Redis down, timeout; whether the batch landed is unknown),
- when more than ``max_pending_events`` events wait (Redis down for long: the pending
  events are dropped and counted in ``num_dropped_events``, memory stays bounded),
- when a heartbeat finds the replica's seq key gone although batches were written (Redis
  was flushed or restarted empty, or a router reaped the replica): the index is rebuilt
  within one heartbeat interval;
- when the engine's event sequence numbers show a gap (its own buffer overflowed; the
  mirror is then the best knowledge available and ``num_engine_gaps`` counts it).

KV shared tier. Blocks the engine wrote to a shared tier (``BlockStored`` with medium
``SHARED``) are published under the tier's pseudo replica id (``PrefixIndex.apply_shared``,
idempotent set adds) once the engine's stats name the tier (``kv_shared_tier_id``), which the
heartbeat also announces as ``shared_tier``: routers credit the tier's blocks to every replica
announcing it. They are not part of the resync mirror (the tier is unbounded and outlives the
replica): a failed flush sends them again, but a Redis that lost its data forgets them until a
block is written again.

Sequence numbers in Redis are the publisher's own, per epoch (see ``pagoda.contracts.redis_keys``);
a failed flush still consumes its numbers, so a batch that did land is never followed by
a different batch reusing its seqs.

Redis outages. After a failed flush the thread retries with exponential backoff and
jitter (``retry_initial_s`` doubling to ``retry_max_s``, ``pagoda.fleet.index.retry.Backoff``)
instead of every ``flush_interval_s``, and each retry is a ``PING`` first: the resync
batch is built (and seqs consumed) only once Redis answers, so an outage of any length
costs one resync when Redis returns, not one per attempt. Failures are logged at once and
then at most every 30 s (with a count); the recovery is logged once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from pagoda.contracts.kv_events import MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagoda.fleet.index.daemon import DaemonThread
from pagoda.contracts import redis_keys as keys
from pagoda.fleet.index.prefix_index import PrefixIndex, make_redis_client
from pagoda.fleet.index.retry import Backoff, RateLimitedLog

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)


class Publisher(DaemonThread):
    """Publishes one replica's block events and heartbeats.

    Args:
        redis_url: e.g. ``redis://host:6379/0``.
        model_id: the key namespace (served model name).
        replica_id: this replica's id (the pod name in Kubernetes); no ``:``.
        endpoints: how routers reach it, e.g. ``{"grpc": "10.0.0.5:8001", "http": ...}``.
        heartbeat_interval_s: heartbeat period.
        ttl_s: heartbeat key lifetime; a replica silent for this long disappears.
        clock: unix seconds (the heartbeat's ``ts`` and when one is due); injectable.
        hash_model_id: the engine's ``model_id`` seeding block hashes (routers need it
            to hash prompts as this replica does); defaults to ``model_id``.
        block_size: tokens per block (also taken from stats that carry ``block_size``).
        flush_interval_s: how often the thread flushes pending events.
        max_pending_events: bound on events waiting for Redis before a resync replaces them.
        stream_maxlen: about how many batches the events stream keeps.
        redis_client: use this client instead of building one from ``redis_url``.
        retry_initial_s, retry_max_s: the backoff between attempts while Redis fails.
    """

    def __init__(self, redis_url: str, model_id: str, replica_id: str, endpoints: dict[str, str],
                 heartbeat_interval_s: float = 1.0, ttl_s: float = 5.0, clock: Callable[[], float] = time.time,
                 *, hash_model_id: Optional[str] = None, block_size: int = 0, flush_interval_s: float = 0.02,
                 max_pending_events: int = 50_000, stream_maxlen: int = 10_000,
                 redis_client: Optional["redis.Redis"] = None, retry_initial_s: float = 0.1,
                 retry_max_s: float = 5.0) -> None:
        super().__init__("pagoda-fleet-publisher")
        keys.check_replica_id(replica_id)
        if ttl_s <= heartbeat_interval_s:
            raise ValueError(f"ttl_s ({ttl_s}) must exceed heartbeat_interval_s ({heartbeat_interval_s})")
        if redis_client is None:
            redis_client = make_redis_client(redis_url)
        self.client = redis_client
        self.model_id = model_id
        self.replica_id = replica_id
        self.endpoints = dict(endpoints)
        # Disaggregated serving: prefill | decode | mixed (pagoda serve --role; PAGODA_ROLE).
        self.role = os.environ.get("PAGODA_ROLE", "mixed") or "mixed"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.ttl_s = ttl_s
        self.clock = clock
        self.hash_model_id = hash_model_id or model_id
        self.block_size = block_size
        self.flush_interval_s = flush_interval_s
        self.max_pending_events = max_pending_events
        self.index = PrefixIndex(redis_client, model_id, stream_maxlen=stream_maxlen)
        self.epoch = os.urandom(6).hex()

        self._lock = threading.Lock()
        self._mirror: dict[str, tuple[Optional[str], tuple[int, ...]]] = {}  # hash -> (parent, tokens)
        self._pending: deque = deque()
        self._shared_pending: list[str] = []  # block hashes this replica wrote to the KV shared tier
        self._needs_resync = True
        self._last_engine_seq: Optional[int] = None
        self._stats: Any = None
        self._next_seq = 0
        self._next_heartbeat = float("-inf")
        self.backoff = Backoff(retry_initial_s, retry_max_s)
        self._log = RateLimitedLog(logger, interval_s=30.0)

        self.is_connected = False
        self._is_draining = False  # mark_draining set the drain flag: deregister removes it
        self.num_dropped_events = 0
        self.num_engine_gaps = 0
        self.num_failed_flushes = 0
        self.num_flushes = 0
        self.num_resyncs = 0
        self.num_probes = 0  # PINGs sent while Redis was failing

    # ------------------------------------------------------- the engine thread
    def submit_events(self, events: Sequence[KVEvent]) -> None:
        """Hand over block events (``LLMEngine.take_block_events()``); never blocks on Redis."""
        if not events:
            return
        with self._lock:
            for event in events:
                if self._last_engine_seq is not None and event.seq != self._last_engine_seq + 1:
                    self.num_engine_gaps += 1
                    self._needs_resync = True
                self._last_engine_seq = event.seq
                if getattr(event.event, "group_idx", 0):
                    continue  # the index keys KV cache group 0, whose blocks cover every position
                medium = getattr(event.event, "medium", MEDIUM)
                if medium == "SHARED" and isinstance(event.event, BlockStored):
                    self._shared_pending.extend(event.event.block_hashes)  # under the tier's pseudo id
                if medium != MEDIUM:
                    continue  # and the device tier: a disk tier's blocks are not a device hit
                self._mirror_apply(event.event)
                if not self._needs_resync:
                    self._pending.append(event.event)
            if len(self._shared_pending) > self.max_pending_events:
                self.num_dropped_events += len(self._shared_pending)
                self._shared_pending.clear()
            if len(self._pending) > self.max_pending_events:
                self.num_dropped_events += len(self._pending)
                self._pending.clear()
                self._needs_resync = True

    def submit_stats(self, stats: Any) -> None:
        """Hand over the latest ``EngineStats`` (or anything with its fields)."""
        with self._lock:
            self._stats = stats

    def _mirror_apply(self, event: Any) -> None:
        if isinstance(event, BlockStored):
            size = event.block_size
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                self._mirror[h] = (parent, tuple(event.token_ids[i * size:(i + 1) * size]))
                parent = h
            self.block_size = self.block_size or size
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._mirror.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            self._mirror.clear()

    @property
    def num_blocks_held(self) -> int:
        with self._lock:
            return len(self._mirror)

    # ------------------------------------------------------- the publisher thread
    def _take_shared(self, stats: Any) -> tuple[str, list[str]]:
        """The shared tier's id (from the engine's stats) and the blocks written there since the last flush;
        none until the id is known (the first stats)."""
        tier_id = getattr(stats, "kv_shared_tier_id", "") or ""
        with self._lock:
            if not tier_id or not self._shared_pending:
                return tier_id, []
            hashes, self._shared_pending = self._shared_pending, []
            return tier_id, hashes

    def _take_batch(self) -> tuple[list[Any], bool, Any]:
        with self._lock:
            resync = self._needs_resync
            if resync:
                batch: list[Any] = [AllBlocksCleared()]
                batch += [BlockStored([h], parent, list(tokens), self.block_size)
                          for h, (parent, tokens) in self._mirror.items()]
                self._needs_resync = False
            else:
                batch = list(self._pending)
            self._pending.clear()
            return batch, resync, self._stats

    def flush(self) -> bool:
        """Publish pending events and, when due, the heartbeat, in one round trip.

        Returns:
            True if something was written; False if nothing was due or Redis failed (the
            next flush then resyncs). Never raises for Redis errors.
        """
        now = self.clock()
        if self.num_failed_flushes and not self.is_connected:
            try:  # cheap probe first: build the resync only once Redis answers
                self.num_probes += 1
                self.client.ping()
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)
                return False
        batch, resync, stats = self._take_batch()
        tier_id, shared = self._take_shared(stats)
        heartbeat_due = now >= self._next_heartbeat
        if not batch and not shared and not heartbeat_due:
            return False
        first_seq = self._next_seq
        self._next_seq += len(batch)  # consumed even if the flush fails (module docstring)
        # With each heartbeat: is our index state still in Redis? (Checked before this
        # batch's apply recreates it; not on a resync, which rebuilds it anyway.)
        check_state = heartbeat_due and first_seq > 0 and not resync
        try:
            pipe = self.client.pipeline(transaction=False)
            if check_state:
                pipe.exists(keys.replica_seq_key(self.model_id, self.replica_id))
            if batch:
                self.index.apply(self.replica_id, [e.to_dict() for e in batch], epoch=self.epoch,
                                 first_seq=first_seq, pipeline=pipe)
            if shared:
                self.index.apply_shared(tier_id, shared, pipeline=pipe)
            if heartbeat_due:
                self._queue_heartbeat(pipe, stats, now)
            results = pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any Redis failure: resync later
            with self._lock:
                self._needs_resync = True
                self._shared_pending[:0] = shared  # idempotent adds: sent again with the next flush
            self._failed(exc)
            return False
        if check_state and not results[0]:
            logger.info("fleet publisher: this replica's index entries are gone from Redis (flushed, restarted "
                        "empty or reaped); resyncing its blocks")
            with self._lock:
                self._needs_resync = True
        self.num_resyncs += int(resync)
        self.num_flushes += 1
        if not self.is_connected and self.num_failed_flushes:
            logger.info("fleet publisher: Redis answers again; resynced %d blocks", len(batch) - 1)
            self._log.reset()
        self.is_connected = True
        if heartbeat_due:
            self._next_heartbeat = now + self.heartbeat_interval_s
        return True

    def _failed(self, exc: BaseException) -> None:
        self._log.warning("fleet publisher: Redis write failed (%s); retrying with backoff, will resync", exc)
        self.is_connected = False
        self.num_failed_flushes += 1

    def run_once(self) -> float:
        """One flush; returns the seconds to wait before the next (backoff while Redis fails)."""
        if self.flush() or self.is_connected or not self.num_failed_flushes:
            self.backoff.reset()
            return self.flush_interval_s
        return self.backoff.next_delay()

    def heartbeat_fields(self, stats: Any, now: float) -> dict[str, str]:
        """The heartbeat hash (see ``pagoda.contracts.redis_keys``) for ``stats`` at ``now``."""
        queries = getattr(stats, "prefix_cache_queries", 0) or 0
        hits = getattr(stats, "prefix_cache_hits", 0) or 0
        return {
            "waiting": str(getattr(stats, "num_waiting", 0)),
            "running": str(getattr(stats, "num_running", 0)),
            "kv_usage": repr(float(getattr(stats, "kv_cache_usage", 0.0))),
            "prefix_hit_rate": repr(hits / queries if queries else 0.0),
            "block_size": str(getattr(stats, "block_size", 0) or self.block_size),
            "num_blocks": str(getattr(stats, "num_blocks", 0)),
            "ttft_p90": repr(float(getattr(stats, "ttft_p90", 0.0) or 0.0)),
            "ttft_buckets": keys.encode_ttft_buckets(getattr(stats, "recent_ttfts", ()) or ()),
            "ts": repr(now),
            "endpoints": json.dumps(self.endpoints, sort_keys=True),
            "hash_model_id": self.hash_model_id,
            "epoch": self.epoch,
            "num_dropped_events": str(self.num_dropped_events),
            "role": self.role,
            **({"shared_tier": tier} if (tier := getattr(stats, "kv_shared_tier_id", "")) else {}),
        }

    def _queue_heartbeat(self, pipe, stats: Any, now: float) -> None:
        key = keys.heartbeat_key(self.model_id, self.replica_id)
        pipe.hset(key, mapping=self.heartbeat_fields(stats, now))
        pipe.pexpire(key, int(self.ttl_s * 1000))
        pipe.sadd(keys.registry_key(self.model_id), self.replica_id)

    def advertise_kv(self, address: str) -> None:
        """Advertise the replica's KV connector (``HOST:PORT`` it listens on) in the heartbeat's
        endpoints as ``kv``, on this replica's advertised host (routers pull prefixes from it:
        ``fleet.routing.peer_pull``)."""
        host = self.endpoints.get("grpc", "127.0.0.1:0").rpartition(":")[0]
        self.endpoints["kv"] = f"{host}:{address.rpartition(':')[2]}"

    def mark_draining(self, ttl_s: float) -> None:
        """Set this replica's drain flag: routers send it nothing new. It expires after
        ``ttl_s`` should the process die; ``deregister`` removes it. Raises on a Redis error."""
        key = keys.drain_key(self.model_id, self.replica_id)
        self.client.set(key, repr(time.time()), ex=max(1, int(ttl_s)))
        self._is_draining = True

    def deregister(self) -> bool:
        """Remove this replica from the registry, the index and its drain flag now (graceful shutdown).

        Returns False if Redis could not be reached (the TTLs then do it).
        """
        try:
            pipe = self.client.pipeline(transaction=True)
            self.index.remove_replica(self.replica_id, pipeline=pipe)
            pipe.delete(keys.heartbeat_key(self.model_id, self.replica_id))
            if self._is_draining:
                pipe.delete(keys.drain_key(self.model_id, self.replica_id))
            pipe.srem(keys.registry_key(self.model_id), self.replica_id)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001
            logger.info("fleet publisher: deregister failed: %s", exc)
            return False
        return True


    def stop(self, deregister: bool = True, timeout: Optional[float] = 5.0) -> None:
        """Stop the thread (one last flush), then optionally ``deregister``."""
        super().stop(timeout)
        if deregister:
            self.deregister()

    def _run(self) -> None:
        while True:
            if self._stop.wait(self.run_once()):
                self.flush()
                return


def publisher_from_env(engine: Any, environ: Optional[dict[str, str]] = None) -> Optional[Publisher]:
    """A publisher configured by the replica's environment, or None without a Redis URL.

    Reads ``PAGODA_REDIS_URL`` (required), ``PAGODA_REPLICA_ID`` (default: host name),
    ``PAGODA_MODEL_NAME`` (namespace; default: the engine's ``model_id``),
    ``PAGODA_POD_IP`` / ``PAGODA_ADVERTISE_HOST`` (default 127.0.0.1) and
    ``PAGODA_{HTTP,GRPC,METRICS}_PORT`` (defaults 8000/8001/8002): the names the operator
    and ``pagoda serve --redis-url`` set.
    """
    env = os.environ if environ is None else environ
    url = env.get("PAGODA_REDIS_URL", "")
    if not url:
        return None
    host = env.get("PAGODA_ADVERTISE_HOST") or env.get("PAGODA_POD_IP") or "127.0.0.1"
    ports = {name: env.get(f"PAGODA_{name.upper()}_PORT", default)
             for name, default in (("http", "8000"), ("grpc", "8001"), ("metrics", "8002"))}
    model_id = getattr(engine, "model_id", "") or "pagoda"
    publisher = Publisher(
        url, env.get("PAGODA_MODEL_NAME") or model_id,
        env.get("PAGODA_REPLICA_ID") or os.uname().nodename.replace(":", "-"),
        {name: f"{host}:{port}" for name, port in ports.items()},
        heartbeat_interval_s=float(env.get("PAGODA_HEARTBEAT_INTERVAL_S", "1.0")),
        ttl_s=float(env.get("PAGODA_HEARTBEAT_TTL_S", "5.0")),
        hash_model_id=model_id,
        block_size=getattr(getattr(engine, "config", None), "block_size", 0),
    )
    # The first heartbeat already describes the replica (its KV shared tier above all): an idle
    # replica submits no stats until its first step.
    get_stats = getattr(engine, "get_stats", None)
    if get_stats is not None:
        publisher.submit_stats(get_stats())
    return publisher
