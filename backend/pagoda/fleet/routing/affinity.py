"""Routing-time affinity: the router's own recent decisions as *pending* prefix ownership.

The prefix index learns a prefix only from the KV events a replica publishes after it has
prefilled it. Every request that arrives while the first one of its prefix is still queued
or prefilling would be routed by load alone, and a burst sharing one prefix (an agent
fanning out tool calls, ``n`` parallel completions, a popular system prompt after a
deploy) would be split across replicas, each prefilling the same prefix.

So a router remembers where it just sent each prompt: after a decision, every block hash
of the prompt is recorded as *pending* on the chosen replica for ``ttl_s`` seconds
(``PendingIndex.record``). ``PendingIndex.match`` answers like the exact index (replica ->
leading blocks, counting the replica's confirmed leading blocks too, so a prefix whose
first chunks are prefilled keeps its pending tail), and the ``prefix_aware`` policy
credits pending blocks at a discount (``pending_discount``) where the exact index does not
already cover them. Confirmation: when the replica's KV events reach the router's index
(``IndexFollower`` in the router, the replicas' events in the simulator), ``confirm``
drops the pending entries of the blocks they store or remove; from then on the exact index
alone speaks for them, evictions included. An entry that is never confirmed (the request
failed, it is still queued) lapses at its TTL: at most ``ttl_s`` of misplaced, discounted
credit.

Several routers share their decisions through one Redis stream (``keys.routed_stream_key``,
``AffinityShare``): each decision is appended (off the request path, by a background
thread, with the TTL left) and every router tails the stream into its own
``PendingIndex``, skipping its own entries. Matching stays a memory lookup; a decision
reaches the other routers within about one poll interval (``poll_block_ms``), so a burst
spread across routers lands together too. Redis down: each router keeps its own pending
entries; shared ones resume when Redis answers (failures are logged at most once a minute).

Invariants: an entry is live iff ``now < expiry``; expired entries are purged lazily (a
heap ordered by expiry), so memory is bounded by the decisions of the last ``ttl_s``.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

from pagoda.fleet.index.daemon import DaemonThread
from pagoda.contracts import redis_keys as keys
from pagoda.fleet.index.retry import Backoff, RateLimitedLog

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)


class PendingIndex:
    """Pending ownership: block hash -> {replica_id: expiry}, with an injectable clock.

    Args:
        clock: monotonic seconds (``time.monotonic``; tests and the simulator inject theirs).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._owners: dict[str, dict[str, float]] = {}
        self._expiries: list[tuple[float, str, str]] = []  # heap of (expiry, block_hash, replica_id)
        self._lock = threading.Lock()
        self.num_recorded = 0

    def record(self, replica_id: str, block_hashes: Sequence[str], ttl_s: float, now: Optional[float] = None) -> None:
        """Mark ``block_hashes`` as pending on ``replica_id`` until ``now + ttl_s``."""
        if not block_hashes or ttl_s <= 0:
            return
        now = self.clock() if now is None else now
        expiry = now + ttl_s
        with self._lock:
            self._purge(now)
            for h in block_hashes:
                owners = self._owners.setdefault(h, {})
                if owners.get(replica_id, -1.0) < expiry:
                    owners[replica_id] = expiry
                    heapq.heappush(self._expiries, (expiry, h, replica_id))
            self.num_recorded += 1

    def match(self, block_hashes: Sequence[str], now: Optional[float] = None,
              confirmed: Optional[Mapping[str, int]] = None) -> dict[str, int]:
        """Leading blocks per replica that are pending there, or confirmed (the exact
        index's ``confirmed[r]`` leading blocks) and then pending: a prefix whose first
        chunks were prefilled and confirmed keeps its pending tail. Replicas whose run
        does not reach past ``confirmed`` are left out."""
        now = self.clock() if now is None else now
        confirmed = confirmed or {}
        matched: dict[str, int] = {}
        if not block_hashes:
            return matched
        with self._lock:
            first = self._owners.get(block_hashes[0], {})
            candidates = {r for r, expiry in first.items() if expiry > now} | set(confirmed)
            for r in candidates:
                start = k = min(confirmed.get(r, 0), len(block_hashes))
                while k < len(block_hashes) and self._owners.get(block_hashes[k], {}).get(r, -1.0) > now:
                    k += 1
                if k > start:
                    matched[r] = k
        return matched

    def confirm(self, replica_id: str, events: Iterable[Any]) -> None:
        """A replica's KV events arrived: its stored or removed blocks stop being pending
        there (the exact index now knows them); ``AllBlocksCleared`` drops all of its."""
        with self._lock:
            for event in events:
                e = event if isinstance(event, Mapping) else event.to_dict()
                if e["type"] == "AllBlocksCleared":
                    self._remove_replica(replica_id)
                    continue
                for h in e.get("block_hashes", ()):
                    owners = self._owners.get(h)
                    if owners is not None and owners.pop(replica_id, None) is not None and not owners:
                        del self._owners[h]

    def remove_replica(self, replica_id: str) -> None:
        """Forget every pending entry of a replica (it left, died or was reaped)."""
        with self._lock:
            self._remove_replica(replica_id)

    def _remove_replica(self, replica_id: str) -> None:
        for h in [h for h, owners in self._owners.items() if replica_id in owners]:
            del self._owners[h][replica_id]
            if not self._owners[h]:
                del self._owners[h]

    @property
    def num_entries(self) -> int:
        with self._lock:
            self._purge(self.clock())
            return sum(len(owners) for owners in self._owners.values())

    def _purge(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expiry, h, rid = heapq.heappop(self._expiries)
            owners = self._owners.get(h)
            if owners is not None and owners.get(rid) == expiry:
                del owners[rid]
                if not owners:
                    del self._owners[h]


class AffinityShare(DaemonThread):
    """Shares routing decisions between routers through the ``routed`` stream.

    Args:
        redis_client: a ``redis.Redis`` client whose socket timeout exceeds ``poll_block_ms``.
        model_id: the key namespace.
        pending: the router's ``PendingIndex`` (other routers' decisions are recorded there).
        router_id: this router's id (its own entries are skipped when read back).
        poll_block_ms: how long one read waits for new entries (also the outbox's latency).
        stream_maxlen: about how many decisions the stream keeps.
    """

    def __init__(self, redis_client: "redis.Redis", model_id: str, pending: PendingIndex,
                 router_id: Optional[str] = None, *, poll_block_ms: int = 20, stream_maxlen: int = 5_000) -> None:
        super().__init__("pagoda-affinity-share")
        self.client = redis_client
        self.key = keys.routed_stream_key(model_id)
        self.pending = pending
        self.router_id = router_id or f"router-{os.getpid()}-{os.urandom(3).hex()}"
        self.poll_block_ms = poll_block_ms
        self.stream_maxlen = stream_maxlen
        self.last_id: Optional[str] = None
        self.num_published = 0
        self.num_applied = 0
        self.num_failures = 0
        self._outbox: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._log = RateLimitedLog(logger, interval_s=60.0)

    def publish(self, replica_id: str, block_hashes: Sequence[str], ttl_s: float) -> None:
        """Queue one decision for the other routers (never blocks on Redis)."""
        if block_hashes:
            with self._lock:
                if len(self._outbox) < 10_000:  # Redis down for long: newest decisions matter least, drop
                    self._outbox.append((replica_id, " ".join(block_hashes), int(ttl_s * 1000)))

    def flush(self) -> int:
        """Append queued decisions (one pipelined round trip); returns how many. Raises on Redis errors."""
        with self._lock:
            batch, self._outbox = self._outbox, []
        if not batch:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for replica_id, hashes, ttl_ms in batch:
            pipe.xadd(self.key, {"router": self.router_id, "replica": replica_id, "ttl_ms": ttl_ms,
                                 "hashes": hashes}, maxlen=self.stream_maxlen, approximate=True)
        pipe.execute()
        self.num_published += len(batch)
        return len(batch)

    def poll(self, block_ms: Optional[int] = None) -> int:
        """Record the other routers' decisions appended since the last poll; returns how many."""
        if self.last_id is None:
            newest = self.client.xrevrange(self.key, count=1)
            self.last_id = _text(newest[0][0]) if newest else "0-0"
        reply = self.client.xread({self.key: self.last_id}, count=1000, block=block_ms or None)  # 0 = forever
        num = 0
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.last_id = _text(entry_id)
                f = {_text(k): _text(v) for k, v in fields.items()}
                if f.get("router") == self.router_id:
                    continue
                self.pending.record(f["replica"], f["hashes"].split(), int(f["ttl_ms"]) / 1000.0)
                num += 1
        self.num_applied += num
        return num

    def _run(self) -> None:
        backoff = Backoff(initial_s=0.05, max_s=2.0)
        while not self._stop.is_set():
            try:
                self.flush()
                self.poll(block_ms=self.poll_block_ms)
                backoff.reset()
            except Exception as exc:  # noqa: BLE001 - Redis down: keep local pending entries, retry
                self.num_failures += 1
                # Decisions queued or missed meanwhile are stale by the time Redis answers.
                self.last_id = None
                with self._lock:
                    self._outbox.clear()
                self._log.warning("routing affinity share: Redis failed (%s); retrying", exc)
                self._stop.wait(backoff.next_delay())


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
