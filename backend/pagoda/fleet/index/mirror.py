"""The prefix index mirrored in memory: ``LocalIndex``, and ``IndexFollower`` that feeds one.

``LocalIndex`` answers ``match`` exactly as ``PrefixIndex`` does in Redis (longest prefix
of leading blocks per replica, ``pagoda.fleet.index.prefix_index``), from two dicts under
one lock: a router's mirror and the simulator's index.

``IndexFollower`` keeps a ``LocalIndex`` in a router's memory: it snapshots every
replica's blocks, then tails the stream from the stream id it read *before* the
snapshot, skipping entries the snapshot already holds (``last_seq < next_seq``). A
replica whose next entry does not start at the expected seq (the follower missed
entries, the stream was trimmed past it, or the replica restarted with a new epoch
without starting at 0) is resynced alone from its snapshot. A KV shared tier's entries (epoch
``shared``, ``PrefixIndex.apply_shared``) carry no sequence: they are set adds, applied as
they come; the snapshot covers the registered replicas and the shared tiers. ``match`` is then served from
memory without a round trip. ``is_synced`` is False until the first snapshot and after a
Redis error, until the next successful snapshot.

Trimming: the stream keeps about ``stream_maxlen`` batches. A follower counts the entries
up to its position (the stream's ``entries-added`` at its snapshot, plus each entry read);
when more entries than that were trimmed, it missed some and resyncs fully.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from pagoda.contracts import redis_keys as keys
from pagoda.fleet.index.daemon import DaemonThread
from pagoda.fleet.index.prefix_index import (REMOVED_EPOCH, SHARED_EPOCH, EventLike, PrefixIndex, as_hex, as_text,
                                             event_dict)

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)


class LocalIndex:
    """The same index in memory (thread-safe): a router's mirror, and the simulator's."""

    def __init__(self) -> None:
        self._owners: dict[str, set[str]] = {}
        self._blocks: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def apply(self, replica_id: str, events: Iterable[EventLike]) -> None:
        """Apply contract-3 events of one replica."""
        with self._lock:
            for event in events:
                e = event_dict(event)
                if e["type"] == "AllBlocksCleared":
                    self._clear(replica_id)
                elif e["type"] == "BlockStored":
                    held = self._blocks.setdefault(replica_id, set())
                    for h in e["block_hashes"]:
                        self._owners.setdefault(h, set()).add(replica_id)
                        held.add(h)
                else:
                    held = self._blocks.get(replica_id, set())
                    for h in e["block_hashes"]:
                        self._discard(h, replica_id)
                        held.discard(h)

    def replace_replica(self, replica_id: str, block_hashes: Iterable[str]) -> None:
        """Set a replica's blocks to exactly ``block_hashes`` (a snapshot)."""
        with self._lock:
            self._clear(replica_id)
            held = self._blocks.setdefault(replica_id, set())
            for h in block_hashes:
                self._owners.setdefault(h, set()).add(replica_id)
                held.add(h)

    def remove_replica(self, replica_id: str) -> None:
        with self._lock:
            self._clear(replica_id)
            self._blocks.pop(replica_id, None)

    def _clear(self, replica_id: str) -> None:
        for h in self._blocks.get(replica_id, ()):
            self._discard(h, replica_id)
        self._blocks[replica_id] = set()

    def _discard(self, block_hash: str, replica_id: str) -> None:
        owners = self._owners.get(block_hash)
        if owners is not None:
            owners.discard(replica_id)
            if not owners:
                del self._owners[block_hash]

    def match(self, block_hashes: Sequence[Union[str, bytes]]) -> dict[str, int]:
        """Longest matched prefix, in blocks, per replica holding at least the first block."""
        matched: dict[str, int] = {}
        with self._lock:
            alive: Optional[set[str]] = None
            for i, h in enumerate(block_hashes):
                owners = self._owners.get(as_hex(h))
                if not owners:
                    break
                alive = set(owners) if alive is None else alive & owners
                if not alive:
                    break
                for r in alive:
                    matched[r] = i + 1
        return matched

    def get_blocks(self, replica_id: str) -> set[str]:
        with self._lock:
            return set(self._blocks.get(replica_id, ()))

    @property
    def replica_ids(self) -> list[str]:
        with self._lock:
            return sorted(r for r, held in self._blocks.items() if held)


class IndexFollower(DaemonThread):
    """A router's local mirror of the index, fed by the events stream (module docstring).

    Args:
        redis_client: a ``redis.Redis`` client whose socket timeout exceeds ``poll_block_ms``.
        model_id: the namespace.
        poll_block_ms: how long one ``poll`` waits in Redis for new entries (thread mode).
        batch_size: stream entries read per round trip.
        retry_interval_s: pause after a Redis error before the thread tries again.
    """

    def __init__(self, redis_client: "redis.Redis", model_id: str, *, poll_block_ms: int = 100, batch_size: int = 1000,
                 retry_interval_s: float = 0.5) -> None:
        super().__init__("pagoda-index-follower")
        self.index = PrefixIndex(redis_client, model_id)
        self.client = redis_client
        self.model_id = model_id
        self.local = LocalIndex()
        self.poll_block_ms = poll_block_ms
        self.batch_size = batch_size
        self.retry_interval_s = retry_interval_s
        self.is_synced = False
        self.last_id = "0-0"
        self._num_seen = 0  # stream entries up to and including last_id
        self.num_full_syncs = 0
        self.num_replica_resyncs = 0
        self.num_entries_applied = 0
        self._next: dict[str, tuple[str, int]] = {}  # replica -> (epoch, next expected seq)
        # Called with (replica_id, events) after each applied entry (the router confirms its
        # pending affinity entries with it); runs on the follower's thread.
        self.on_events: Optional[Callable[[str, list], None]] = None

    def match(self, block_hashes: Sequence[Union[str, bytes]]) -> dict[str, int]:
        """Longest-prefix matches from memory (meaningful only while ``is_synced``)."""
        return self.local.match(block_hashes)

    def sync(self) -> None:
        """Full resync: remember the stream position, then snapshot every replica."""
        last_id, num_added, _ = self.index.stream_info()
        registered = {as_text(r) for r in self.client.smembers(keys.registry_key(self.model_id))}
        registered |= {as_text(r) for r in self.client.smembers(keys.shared_tiers_key(self.model_id))}
        replica_ids = sorted(registered | set(self._next) | set(self.local.replica_ids))
        self._install(self.index.snapshot(replica_ids))
        self.last_id, self._num_seen = last_id, num_added
        self.is_synced = True
        self.num_full_syncs += 1

    def _install(self, snapshot: Mapping[str, tuple[str, int, list[str]]]) -> None:
        for rid, (epoch, seq, blocks) in snapshot.items():
            if seq < 0:
                self.local.remove_replica(rid)
                self._next.pop(rid, None)
            else:
                self.local.replace_replica(rid, blocks)
                self._next[rid] = (epoch, seq + 1)

    def poll(self, block_ms: Optional[int] = None) -> int:
        """Apply the stream entries after ``last_id`` (one batch).

        Returns:
            How many entries were applied. Raises ``redis.RedisError`` (and leaves
            ``is_synced`` False) when Redis fails.
        """
        try:
            if not self.is_synced:
                self.sync()
            _, num_added, num_retained = self.index.stream_info()
            if num_added - num_retained > self._num_seen or num_added < self._num_seen:
                self.sync()  # entries we never read were trimmed away, or the stream was reset
            entries = self.index.read_events(self.last_id, self.batch_size, block_ms)
            applied = sum(self._take_entry(entry_id, entry) for entry_id, entry in entries)
        except Exception:
            self.is_synced = False
            raise
        return applied

    def _take_entry(self, entry_id: str, entry: Mapping[str, Any]) -> int:
        rid, epoch = entry["replica"], entry["epoch"]
        first, last = entry["first_seq"], entry["last_seq"]
        expected = self._next.get(rid)
        self.last_id = entry_id
        self._num_seen += 1
        if epoch == REMOVED_EPOCH:
            self.local.remove_replica(rid)
            self._next.pop(rid, None)
            return 1
        if epoch == SHARED_EPOCH:  # a shared tier: idempotent adds from any replica, no sequence
            self.local.apply(rid, entry["events"])
            self.num_entries_applied += 1
            return 1
        if expected is not None and expected[0] == epoch and last < expected[1]:
            return 0  # already part of the snapshot
        new_epoch = first == 0 and (expected is None or expected[0] != epoch)
        if expected == (epoch, first) or new_epoch:
            self.local.apply(rid, entry["events"])
            if self.on_events is not None:
                self.on_events(rid, entry["events"])
            self._next[rid] = (epoch, last + 1)
            self.num_entries_applied += 1
            return 1
        # A gap: entries of this replica were missed. Its snapshot already includes this
        # entry (it is in Redis), so later entries continue from the snapshot's seq.
        self._install(self.index.snapshot([rid]))
        self.num_replica_resyncs += 1
        return 0

    def _run(self) -> None:
        from pagoda.fleet.index.retry import RateLimitedLog

        log = RateLimitedLog(logger, interval_s=30.0)
        while not self._stop.is_set():
            try:
                self.poll(block_ms=self.poll_block_ms)
                log.reset()
            except Exception as exc:  # noqa: BLE001 - Redis down: stay unsynced, retry
                log.info("index follower: %s; retrying every %.1fs", exc, self.retry_interval_s)
                self._stop.wait(self.retry_interval_s)
