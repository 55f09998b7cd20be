"""The replica registry as routers and the operator read it: live replicas and their load.

A replica is *live* while its heartbeat hash exists; the publisher renews it with a TTL,
so a dead replica drops out by itself (no reaper needed for correctness). The registry
SET remembers every id that published, which lets ``reap_expired`` find the dead ones
and delete their index entries (memory hygiene; every router runs it every few seconds,
see ``pagoda.fleet.routing.fleet_view.FleetView``). Draining is a separate key the operator
(or anyone) sets; a draining replica is still live, but routers send it nothing new.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from pagoda.contracts import redis_keys as keys
from pagoda.fleet.index.prefix_index import PrefixIndex

if TYPE_CHECKING:
    import redis


@dataclass
class ReplicaInfo:
    replica_id: str
    endpoints: dict[str, str]
    waiting: int
    running: int
    kv_usage: float
    prefix_hit_rate: float
    block_size: int
    num_blocks: int
    ts: float
    draining: bool
    hash_model_id: str = ""  # the engine's model_id: seeds the block hashes routers compute
    ttft_p90: float = 0.0
    epoch: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # heartbeat fields not named above


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(text: str, kind=float, default=0):
    try:
        value = kind(float(text)) if kind is int else kind(text)
    except (TypeError, ValueError):
        return default
    return value if math.isfinite(value) else default


def parse_heartbeat(replica_id: str, raw: Mapping[Any, Any], draining: bool) -> ReplicaInfo:
    """A heartbeat hash (bytes or str) as a ``ReplicaInfo``; bad numbers read as 0."""
    f = {_text(k): _text(v) for k, v in raw.items()}
    try:
        endpoints = json.loads(f.get("endpoints", "{}"))
    except ValueError:
        endpoints = {}
    known = {"waiting", "running", "kv_usage", "prefix_hit_rate", "block_size", "num_blocks", "ts",
             "endpoints", "hash_model_id", "ttft_p90", "epoch"}
    return ReplicaInfo(
        replica_id=replica_id,
        endpoints={str(k): str(v) for k, v in endpoints.items()} if isinstance(endpoints, dict) else {},
        waiting=_number(f.get("waiting"), int), running=_number(f.get("running"), int),
        kv_usage=_number(f.get("kv_usage")), prefix_hit_rate=_number(f.get("prefix_hit_rate")),
        block_size=_number(f.get("block_size"), int), num_blocks=_number(f.get("num_blocks"), int),
        ts=_number(f.get("ts")), draining=draining, hash_model_id=f.get("hash_model_id", ""),
        ttft_p90=_number(f.get("ttft_p90")), epoch=f.get("epoch", ""),
        extra={k: v for k, v in f.items() if k not in known},
    )


class ReplicaRegistry:
    """Args:
    redis_client: a ``redis.Redis`` client.
    model_id: the namespace (served model name).
    """

    def __init__(self, redis_client: "redis.Redis", model_id: str) -> None:
        self.client = redis_client
        self.model_id = model_id
        self.index = PrefixIndex(redis_client, model_id)

    def list_replicas(self) -> list[ReplicaInfo]:
        """Live replicas (heartbeat present), sorted by id. Two round trips.

        Raises ``redis.RedisError`` when Redis fails.
        """
        ids = sorted(_text(r) for r in self.client.smembers(keys.registry_key(self.model_id)))
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(keys.heartbeat_key(self.model_id, rid))
            pipe.exists(keys.drain_key(self.model_id, rid))
        rows = pipe.execute()
        replicas = []
        for i, rid in enumerate(ids):
            heartbeat, draining = rows[2 * i], rows[2 * i + 1]
            if heartbeat:
                replicas.append(parse_heartbeat(rid, heartbeat, bool(draining)))
        return replicas

    def set_draining(self, replica_id: str, draining: bool, now: float = 0.0) -> None:
        """Set or clear the drain flag (its value records ``now``, as the operator writes it)."""
        key = keys.drain_key(self.model_id, replica_id)
        if draining:
            self.client.set(key, repr(float(now)))
        else:
            self.client.delete(key)

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica: registry entry, heartbeat, drain flag and index entries (atomic)."""
        pipe = self.client.pipeline(transaction=True)
        self.index.remove_replica(replica_id, pipeline=pipe)
        pipe.delete(keys.heartbeat_key(self.model_id, replica_id), keys.drain_key(self.model_id, replica_id))
        pipe.srem(keys.registry_key(self.model_id), replica_id)
        pipe.execute()

    def reap_expired(self) -> list[str]:
        """``remove_replica`` every registered replica whose heartbeat expired; returns them.

        Safe to run from every router at once, and idempotent: each removal is a
        transaction that WATCHes the replica's heartbeat and seq keys, so a replica that
        heartbeats or publishes between the check and the removal (it came back) is left
        alone, and a replica already removed is no longer registered. Raises
        ``redis.RedisError`` when Redis fails.
        """
        from redis.exceptions import WatchError

        ids = sorted(_text(r) for r in self.client.smembers(keys.registry_key(self.model_id)))
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for rid in ids:
            pipe.exists(keys.heartbeat_key(self.model_id, rid))
        dead = [rid for rid, alive in zip(ids, pipe.execute()) if not alive]
        reaped = []
        for rid in dead:
            watched = (keys.heartbeat_key(self.model_id, rid), keys.replica_seq_key(self.model_id, rid))
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*watched)
                    if pipe.exists(watched[0]):
                        continue  # it heartbeated since the first read
                    pipe.multi()
                    self.index.remove_replica(rid, pipeline=pipe)
                    pipe.delete(keys.heartbeat_key(self.model_id, rid), keys.drain_key(self.model_id, rid))
                    pipe.srem(keys.registry_key(self.model_id), rid)
                    pipe.execute()
                except WatchError:
                    continue
            reaped.append(rid)
        return reaped
