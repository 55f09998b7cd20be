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

Shared tiers. A KV shared tier's blocks are indexed under a pseudo replica id
(``keys.shared_tier_replica_id``) by ``apply_shared``: set adds without a sequence, because
every replica mounting the tier writes to it; ``match`` answers for it like for a replica,
and the router credits its leading blocks to the replicas that mount it.

Mirrors (``pagoda.fleet.index.mirror``): ``LocalIndex`` is the same index in memory and
``IndexFollower`` keeps one in a router, fed by the event stream this module writes.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

from pagoda.contracts.kv_events import BlockEvent, KVEvent
from pagoda.contracts import redis_keys as keys

if TYPE_CHECKING:
    import redis

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

# KEYS: blocks_key, seq_key, stream_key, shared_tiers_key. ARGV: block_prefix, pseudo_id, stream_maxlen,
# events_json, then the block hashes stored. Set adds only: idempotent, so any number of replicas
# mounting the tier may apply in any order without a sequence (followers apply SHARED_EPOCH entries as
# they come).
_SHARED_LUA = """
for i = 5, #ARGV do
  redis.call('SADD', ARGV[1] .. ARGV[i], ARGV[2])
  redis.call('SADD', KEYS[1], ARGV[i])
end
redis.call('SET', KEYS[2], 'shared:0')
redis.call('SADD', KEYS[4], ARGV[2])
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'replica', ARGV[2], 'epoch', 'shared',
                  'first_seq', '-1', 'last_seq', '-1', 'events', ARGV[4])
"""
SHARED_EPOCH = "shared"


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
SHARED_SCRIPT = _Script(_SHARED_LUA)

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


def as_text(value: Any) -> str:
    """A Redis reply value as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_hex(block_hash: Union[str, bytes]) -> str:
    """A block hash as hex text (the index's key form)."""
    return block_hash.hex() if isinstance(block_hash, bytes) else block_hash


class PrefixIndex:
    """The index in Redis for one model.

    Args:
        redis_client: a ``redis.Redis`` (sync) client.
        model_id: the namespace (served model name), see ``keys``.
        stream_maxlen: about how many batches the events stream keeps.
    """

    def __init__(self, redis_client: "redis.Redis", model_id: str, stream_maxlen: int = 10_000) -> None:
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
        owner_keys = [self._block_prefix + as_hex(h) for h in block_hashes]
        flat = MATCH_SCRIPT(self.client, owner_keys, ())
        return {as_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

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

    def apply_shared(self, tier_id: str, block_hashes: Sequence[Union[str, bytes]], pipeline=None) -> None:
        """Record blocks written to the KV shared tier ``tier_id`` under its pseudo replica id
        (``keys.shared_tier_replica_id``), and append them to the stream (epoch ``SHARED_EPOCH``).

        Idempotent and order-free (set adds), so every replica mounting the tier publishes its
        own writes without coordinating sequence numbers.
        """
        if not block_hashes:
            return
        pseudo = keys.shared_tier_replica_id(tier_id)
        hashes = [as_hex(h) for h in block_hashes]
        events = json.dumps([{"type": "BlockStored", "block_hashes": hashes, "medium": "SHARED"}],
                            separators=(",", ":"))
        script_keys = [keys.replica_blocks_key(self.model_id, pseudo), keys.replica_seq_key(self.model_id, pseudo),
                       keys.events_stream_key(self.model_id), keys.shared_tiers_key(self.model_id)]
        args = [self._block_prefix, pseudo, self.stream_maxlen, events, *hashes]
        if pipeline is not None:
            SHARED_SCRIPT.queue(pipeline, script_keys, args)
        else:
            SHARED_SCRIPT(self.client, script_keys, args)

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
            epoch, _, seq = as_text(seq_text).rpartition(":")
            result[rid] = (epoch, int(seq), [as_text(m) for m in members])
        return result

    def read_events(self, after_id: str = "0-0", count: int = 1000,
                    block_ms: Optional[int] = None) -> list[tuple[str, dict[str, Any]]]:
        """Stream entries after ``after_id``: [(stream_id, {replica, epoch, first_seq,
        last_seq, events})], for followers and external indexers (replay from an id)."""
        reply = self.client.xread({keys.events_stream_key(self.model_id): after_id}, count=count, block=block_ms)
        entries = []
        for _stream, items in reply or []:
            for entry_id, fields in items:
                f = {as_text(k): as_text(v) for k, v in fields.items()}
                entries.append((as_text(entry_id), {
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
        return as_text(info["last-generated-id"]), int(info["entries-added"]), int(info["length"])
