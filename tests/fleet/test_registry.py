"""The replica registry in a real Redis, and the operator reading what replicas publish."""

import asyncio

import pytest

from pagoda.contracts.kv_events import BlockStored, KVEvent
from pagoda.contracts import redis_keys as keys
from pagoda.fleet.index.mirror import IndexFollower
from pagoda.fleet.index.prefix_index import PrefixIndex
from pagoda.fleet.index.publisher import Publisher
from pagoda.fleet.index.registry import ReplicaRegistry, parse_heartbeat

from .conftest import count_round_trips

pytestmark = pytest.mark.redis
MODEL = "chat"


class Stats:
    num_waiting, num_running, kv_cache_usage, num_blocks = 1, 4, 0.5, 64
    prefix_cache_queries, prefix_cache_hits = 0, 0


def publish(client, replica_id, hashes=(), now=100.0):
    pub = Publisher("unused", MODEL, replica_id, {"grpc": f"{replica_id}:8001"}, clock=lambda: now,
                    redis_client=client, block_size=16)
    pub.submit_stats(Stats())
    if hashes:
        pub.submit_events([KVEvent(0, 0.0, BlockStored(list(hashes), None, [], 16))])
    assert pub.flush()
    return pub


def test_list_replicas_is_two_round_trips_and_sorted(redis_client):
    for rid in ("b", "a", "c"):
        publish(redis_client, rid)
    registry = ReplicaRegistry(count_round_trips(redis_client), MODEL)
    replicas = registry.list_replicas()
    assert [r.replica_id for r in replicas] == ["a", "b", "c"] and redis_client.round_trips == 2
    assert replicas[0].endpoints == {"grpc": "a:8001"} and replicas[0].running == 4
    assert ReplicaRegistry(redis_client, "other-model").list_replicas() == []


def test_draining_flag_round_trip(redis_client):
    publish(redis_client, "a")
    registry = ReplicaRegistry(redis_client, MODEL)
    registry.set_draining("a", True, now=5.0)
    assert registry.list_replicas()[0].draining
    assert redis_client.get(keys.drain_key(MODEL, "a")) == b"5.0"
    registry.set_draining("a", False)
    assert not registry.list_replicas()[0].draining


def test_remove_replica_drops_everything_including_index(redis_client):
    publish(redis_client, "a", ["h1", "h2"])
    publish(redis_client, "b", ["h1"])
    follower = IndexFollower(redis_client, MODEL)
    follower.sync()
    registry = ReplicaRegistry(redis_client, MODEL)
    registry.set_draining("a", True)
    registry.remove_replica("a")
    assert [r.replica_id for r in registry.list_replicas()] == ["b"]
    assert PrefixIndex(redis_client, MODEL).match(["h1", "h2"]) == {"b": 1}
    leftover = [k.decode() for k in redis_client.keys(f"{keys.namespace(MODEL)}:*") if b":a" in k]
    assert leftover == []
    follower.poll()
    assert follower.match(["h1", "h2"]) == {"b": 1}


def test_reap_expired_is_idempotent_and_spares_a_replica_that_came_back(redis_client):
    publish(redis_client, "dead", ["h1", "h2"])
    publish(redis_client, "alive", ["h1"])
    redis_client.delete(keys.heartbeat_key(MODEL, "dead"))  # its TTL lapsed
    registry = ReplicaRegistry(redis_client, MODEL)
    real_pipeline = redis_client.pipeline

    def pipeline(*args, **kwargs):  # the replica heartbeats again after the check, before EXEC
        pipe = real_pipeline(*args, **kwargs)
        multi = pipe.multi

        def multi_then_come_back():
            multi()
            real_pipeline().hset(keys.heartbeat_key(MODEL, "dead"), "ts", "1").execute()
        pipe.multi = multi_then_come_back
        return pipe

    redis_client.pipeline = pipeline
    assert registry.reap_expired() == []  # it came back between the check and the removal: WATCH aborts
    redis_client.pipeline = real_pipeline
    assert PrefixIndex(redis_client, MODEL).match(["h1", "h2"]) == {"alive": 1, "dead": 2}
    redis_client.delete(keys.heartbeat_key(MODEL, "dead"))
    assert registry.reap_expired() == ["dead"]
    assert registry.reap_expired() == []  # idempotent: nothing left to reap
    assert PrefixIndex(redis_client, MODEL).match(["h1", "h2"]) == {"alive": 1}
    assert not redis_client.sismember(keys.registry_key(MODEL), "dead")


def test_parse_heartbeat_tolerates_garbage():
    info = parse_heartbeat("x", {b"waiting": b"nan", b"running": b"2.0", b"endpoints": b"{bad", b"new": b"1"}, True)
    assert (info.waiting, info.running, info.endpoints, info.draining, info.extra) == (0, 2, {}, True, {"new": "1"})


def test_operator_reads_heartbeats_drains_and_forgets(redis_server, redis_client):
    """The operator's RedisFleetStore (redis.asyncio) against what a publisher writes."""
    redis_asyncio = pytest.importorskip("redis.asyncio")
    from pagoda_operator.load import RedisFleetStore

    publish(redis_client, "pod-a", ["h1", "h2"], now=100.0)
    publish(redis_client, "pod-b", ["h1"], now=100.0)

    async def scenario():
        client = redis_asyncio.from_url(redis_server.url)
        store = RedisFleetStore(client, max_age_s=30, clock=lambda: 110.0)
        loads = await store.read_loads(MODEL, {"pod-a": None, "pod-b": None, "pod-z": None})
        await store.mark_draining(MODEL, "pod-a")
        await store.forget_replica(MODEL, "pod-a")
        await client.aclose()
        return loads

    loads = asyncio.run(scenario())
    assert sorted(loads) == ["pod-a", "pod-b"]
    assert (loads["pod-a"].waiting, loads["pod-a"].running, loads["pod-a"].kv_usage, loads["pod-a"].ts) == \
        (1.0, 4.0, 0.5, 100.0)
    assert [r.replica_id for r in ReplicaRegistry(redis_client, MODEL).list_replicas()] == ["pod-b"]
    assert PrefixIndex(redis_client, MODEL).match(["h1", "h2"]) == {"pod-b": 1}
