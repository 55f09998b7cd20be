"""The global prefix index: which replica holds which KV blocks, in Redis and mirrored locally.

Data (key names in ``pagoda.contracts.redis_keys``): per block hash a SET of replica ids, per
replica a SET of its block hashes, per replica the ``epoch:seq`` of the last applied
event, and one STREAM of event batches for the model.

Longest-prefix match. Block hashes are chained (``pagoda.contracts.block_hash``), so a
replica can reuse the first ``k`` blocks of a prompt iff it holds blocks ``0..k-1``;
the engine stops at its first miss, so a block held further along without its
predecessors is worthless. ``match`` walks the prompt's hashes in order, intersecting
the owner sets, and stops as soon as no replica survives:
``matched[r] = max{k : r holds blocks 0..k-1}``. In Redis this runs as one Lua script
(``EVALSHA``; after a server restart forgot the script, one ``EVAL``): at most two round
trips whatever the prompt length.

Writes. ``apply`` runs one Lua script per batch that updates both SET sides, records the
batch's last seq, registers the replica and appends the batch to the stream, atomically; so the snapshot
(blocks SET, seq) and the stream never disagree (see the invariants in ``keys``).

``IndexFollower`` keeps a ``LocalIndex`` in a router's memory: it snapshots every
replica's blocks, then tails the stream from the stream id it read *before* the
snapshot, skipping entries the snapshot already holds (``last_seq < next_seq``). A
replica whose next entry does not start at the expected seq (the follower missed
entries, the stream was trimmed past it, or the replica restarted with a new epoch
without starting at 0) is resynced alone from its snapshot. ``match`` is then served from
memory without a round trip. ``is_synced`` is False until the first snapshot and after a
Redis error, until the next successful snapshot.

Trimming: the stream keeps about ``stream_maxlen`` batches. A follower counts the entries
up to its position (the stream's ``entries-added`` at its snapshot, plus each entry read);
when more entries than that were trimmed, it missed some and resyncs fully.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from pagoda.contracts.kv_events import BlockEvent, KVEvent
from pagoda.fleet.index.daemon import DaemonThread
from pagoda.contracts import redis_keys as keys

logger = logging.getLogger(__name__)

STORED, REMOVED, CLEARED = "+", "-", "!"  # op markers in the apply script's ARGV

# KEYS: blocks_key, seq_key, stream_key, registry_key. ARGV: block_prefix, replica_id, epoch, first_seq,
# last_seq, events_json, stream_maxlen, then ops: "+" / "-" switch mode, "!" clears all,
# anything else is a block hash stored or removed under the current mode.
_APPLY_LUA = """
local blocks_key, seq_key, stream_key = KEYS[1], KEYS[2], KEYS[3]
local prefix, rid = ARGV[1], ARGV[2]
local mode = '+'
for i = 8, #ARGV do
  local a = ARGV[i]
  if a == '+' or a == '-' then
    mode = a
  elseif a == '!' then
    for _, h in ipairs(redis.call('SMEMBERS', blocks_key)) do
      redis.call('SREM', prefix .. h, rid)
    end
    redis.call('DEL', blocks_key)
  elseif mode == '+' then
    redis.call('SADD', prefix .. a, rid)
    redis.call('SADD', blocks_key, a)
  else
    redis.call('SREM', prefix .. a, rid)
    redis.call('SREM', blocks_key, a)
  end
end
redis.call('SET', seq_key, ARGV[3] .. ':' .. ARGV[5])
redis.call('SADD', KEYS[4], rid)
return redis.call('XADD', stream_key, 'MAXLEN', '~', ARGV[7], '*', 'replica', rid, 'epoch', ARGV[3],
                  'first_seq', ARGV[4], 'last_seq', ARGV[5], 'events', ARGV[6])
"""

# KEYS: the prompt's block-owner keys in order. Returns {replica, matched, replica, matched...}.
_MATCH_LUA = """
local alive = nil
local matched = {}
for i, key in ipairs(KEYS) do
  local owners = redis.call('SMEMBERS', key)
  local survivors = {}
  local any = false
  for _, r in ipairs(owners) do
    if alive == nil or alive[r] then
      survivors[r] = true
      matched[r] = i
      any = true
    end
  end
  if not any then break end
  alive = survivors
end
local out = {}
for r, n in pairs(matched) do
  out[#out + 1] = r
  out[#out + 1] = n
end
return out
"""

# KEYS: blocks_key, seq_key, stream_key. ARGV: block_prefix, replica_id, stream_maxlen.
# Appends a "removed" entry (epoch REMOVED_EPOCH) so followers drop the replica too.
_CLEAR_LUA = """
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  redis.call('SREM', ARGV[1] .. h, ARGV[2])
end
redis.call('DEL', KEYS[1], KEYS[2])
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'replica', ARGV[2], 'epoch', 'removed',
                  'first_seq', '-1', 'last_seq', '-1', 'events', '[{"type":"AllBlocksCleared"}]')
"""
REMOVED_EPOCH = "removed"


class _Script:
    """A Lua script run with EVALSHA, falling back to EVAL once if Redis forgot it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client, keys_: Sequence[str], args: Sequence[Any]):
        from redis.exceptions import NoScriptError

        try:
            return client.evalsha(self.sha, len(keys_), *keys_, *args)
        except NoScriptError:
            return client.eval(self.source, len(keys_), *keys_, *args)

    def queue(self, pipe, keys_: Sequence[str], args: Sequence[Any]) -> None:
        """Add to a pipeline as EVAL (a pipeline cannot retry one NOSCRIPT command)."""
        pipe.eval(self.source, len(keys_), *keys_, *args)


APPLY_SCRIPT = _Script(_APPLY_LUA)
MATCH_SCRIPT = _Script(_MATCH_LUA)
CLEAR_SCRIPT = _Script(_CLEAR_LUA)

EventLike = Union[KVEvent, BlockEvent, Mapping[str, Any]]


def event_dict(event: EventLike) -> dict[str, Any]:
    """A contract-3 event as a dict: ``KVEvent`` / bare events via ``to_dict()``, dicts copied."""
    return dict(event) if isinstance(event, Mapping) else event.to_dict()


def encode_ops(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """The apply script's op list for ``events`` (dicts with ``type`` and ``block_hashes``)."""
    ops: list[str] = []
    mode = STORED
    for event in events:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            ops.append(CLEARED)
            continue
        want = STORED if kind == "BlockStored" else REMOVED
        assert kind in ("BlockStored", "BlockRemoved"), f"unknown block event type {kind!r}"
        if want != mode:
            ops.append(want)
            mode = want
        ops.extend(event["block_hashes"])
    return ops


def make_redis_client(url: str, socket_timeout_s: float = 1.0, connect_timeout_s: float = 0.5):
    """A sync ``redis.Redis`` for the fleet layer: short timeouts and no retries, so a
    Redis outage fails fast and callers fall back (routers) or resync later (publishers)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
                                retry=Retry(NoBackoff(), 0), retry_on_timeout=False)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _hex(block_hash: Union[str, bytes]) -> str:
    return block_hash.hex() if isinstance(block_hash, bytes) else block_hash


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
                owners = self._owners.get(_hex(h))
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


class PrefixIndex:
    """The index in Redis for one model.

    Args:
        redis_client: a ``redis.Redis`` (sync) client.
        model_id: the namespace (served model name), see ``keys``.
        stream_maxlen: about how many batches the events stream keeps.
    """

    def __init__(self, redis_client, model_id: str, stream_maxlen: int = 10_000) -> None:
        self.client = redis_client
        self.model_id = model_id
        self.stream_maxlen = stream_maxlen
        self._block_prefix = keys.block_owners_prefix(model_id)

    def match(self, block_hashes: Sequence[Union[str, bytes]]) -> dict[str, int]:
        """Longest-prefix matched blocks per replica (at most 2 round trips).

        Returns:
            replica id -> number of leading blocks of ``block_hashes`` it holds; replicas
            holding none are absent. Raises ``redis.RedisError`` when Redis fails.
        """
        if not block_hashes:
            return {}
        owner_keys = [self._block_prefix + _hex(h) for h in block_hashes]
        flat = MATCH_SCRIPT(self.client, owner_keys, ())
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def apply(self, replica_id: str, events: Sequence[EventLike], *, epoch: str = "0",
              first_seq: Optional[int] = None, pipeline=None) -> None:
        """Apply one replica's batch of events atomically and append it to the stream.

        Args:
            replica_id: whose events.
            events: ``KVEvent``s or contract-3 dicts, in order. Their seqs must be
                consecutive; ``first_seq`` (default: the first event's ``seq``) numbers them.
            epoch: the publisher's epoch (see ``keys``).
            pipeline: queue into this pipeline instead of running now.
        """
        if not events:
            return
        dicts = [event_dict(e) for e in events]
        first = dicts[0].get("seq", 0) if first_seq is None else first_seq
        for offset, d in enumerate(dicts):
            d["seq"] = first + offset
        last = first + len(dicts) - 1
        script_keys = [keys.replica_blocks_key(self.model_id, replica_id),
                       keys.replica_seq_key(self.model_id, replica_id),
                       keys.events_stream_key(self.model_id), keys.registry_key(self.model_id)]
        args = [self._block_prefix, replica_id, epoch, first, last,
                json.dumps(dicts, separators=(",", ":")), self.stream_maxlen, *encode_ops(dicts)]
        if pipeline is not None:
            APPLY_SCRIPT.queue(pipeline, script_keys, args)
        else:
            APPLY_SCRIPT(self.client, script_keys, args)

    def remove_replica(self, replica_id: str, pipeline=None) -> None:
        """Drop every index entry of ``replica_id`` (its blocks and its seq)."""
        script_keys = [keys.replica_blocks_key(self.model_id, replica_id),
                       keys.replica_seq_key(self.model_id, replica_id),
                       keys.events_stream_key(self.model_id)]
        args = [self._block_prefix, replica_id, self.stream_maxlen]
        if pipeline is not None:
            CLEAR_SCRIPT.queue(pipeline, script_keys, args)
        else:
            CLEAR_SCRIPT(self.client, script_keys, args)

    def snapshot(self, replica_ids: Sequence[str]) -> dict[str, tuple[str, int, list[str]]]:
        """Consistent per-replica state: replica -> (epoch, last_seq, block hashes).

        One MULTI/EXEC round trip; a replica with no seq yet is reported as
        ``("", -1, [])``.
        """
        pipe = self.client.pipeline(transaction=True)
        for rid in replica_ids:
            pipe.get(keys.replica_seq_key(self.model_id, rid))
            pipe.smembers(keys.replica_blocks_key(self.model_id, rid))
        rows = pipe.execute()
        result = {}
        for i, rid in enumerate(replica_ids):
            seq_text, members = rows[2 * i], rows[2 * i + 1]
            if seq_text is None:
                result[rid] = ("", -1, [])
                continue
            epoch, _, seq = _text(seq_text).rpartition(":")
            result[rid] = (epoch, int(seq), [_text(m) for m in members])
        return result

    def read_events(self, after_id: str = "0-0", count: int = 1000,
                    block_ms: Optional[int] = None) -> list[tuple[str, dict[str, Any]]]:
        """Stream entries after ``after_id``: [(stream_id, {replica, epoch, first_seq,
        last_seq, events})], for followers and external indexers (replay from an id)."""
        reply = self.client.xread({keys.events_stream_key(self.model_id): after_id}, count=count, block=block_ms)
        entries = []
        for _stream, items in reply or []:
            for entry_id, fields in items:
                f = {_text(k): _text(v) for k, v in fields.items()}
                entries.append((_text(entry_id), {
                    "replica": f["replica"], "epoch": f["epoch"], "first_seq": int(f["first_seq"]),
                    "last_seq": int(f["last_seq"]), "events": json.loads(f["events"])}))
        return entries

    def last_stream_id(self) -> str:
        """The id of the newest stream entry, ``"0-0"`` for an empty stream."""
        return self.stream_info()[0]

    def stream_info(self) -> tuple[str, int, int]:
        """(last generated id, entries ever added, entries retained); ("0-0", 0, 0) if none.

        ``added - retained`` entries were trimmed; they are always the oldest ones.
        """
        from redis.exceptions import ResponseError

        try:
            info = self.client.xinfo_stream(keys.events_stream_key(self.model_id))
        except ResponseError:  # no such key
            return "0-0", 0, 0
        return _text(info["last-generated-id"]), int(info["entries-added"]), int(info["length"])


class IndexFollower(DaemonThread):
    """A router's local mirror of the index, fed by the events stream (module docstring).

    Args:
        redis_client: a ``redis.Redis`` client whose socket timeout exceeds ``poll_block_ms``.
        model_id: the namespace.
        poll_block_ms: how long one ``poll`` waits in Redis for new entries (thread mode).
        batch_size: stream entries read per round trip.
        retry_interval_s: pause after a Redis error before the thread tries again.
    """

    def __init__(self, redis_client, model_id: str, *, poll_block_ms: int = 100, batch_size: int = 1000,
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
        registered = {_text(r) for r in self.client.smembers(keys.registry_key(self.model_id))}
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
