"""The router counts a prefix on a KV shared tier as a cheaper target than none (issue 46).

The policy's credit (device > shared tier > nothing; only replicas mounting the tier), the
index's pseudo replica for a tier (published by any mounting replica, followed, never reaped)
with a real Redis, and a router over that index choosing a mounting replica.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pagoda.contracts import redis_keys as keys
from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.contracts.kv_events import BlockStored, KVEvent
from pagoda.fleet.index.mirror import IndexFollower
from pagoda.fleet.index.prefix_index import PrefixIndex
from pagoda.fleet.index.publisher import Publisher
from pagoda.fleet.index.registry import ReplicaRegistry
from pagoda.fleet.routing.fleet_view import FleetView
from pagoda.fleet.routing.policy import ReplicaState, RoutingRequest, make_policy
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.routing.router import Router, split_shared_tiers

MODEL = "chat"


def request(matched=None, shared=None, tokens=256, block_size=16) -> RoutingRequest:
    return RoutingRequest("q", [f"h{i}" for i in range(tokens // block_size)], tokens, block_size,
                          matched_blocks=matched or {}, shared_blocks=shared or {})


def states(*specs) -> list[ReplicaState]:
    return [ReplicaState(rid, shared_tier=tier, running=load) for rid, tier, load in specs]


@pytest.mark.parametrize("name", ["prefix_aware", "precise"])
def test_shared_tier_credit_is_discounted_and_only_for_replicas_mounting_it(name):
    policy = make_policy(name)
    req = request(matched={"a": 4}, shared={"t1": 16})  # a: 64 tokens on its device; tier t1: all 256
    assert policy.cached_tokens(req, "a", "t1") == pytest.approx(64 + 0.75 * (256 - 64))
    assert policy.cached_tokens(req, "b", "t1") == pytest.approx(0.75 * 256)
    assert policy.cached_tokens(req, "c", "t2") == 0 and policy.cached_tokens(req, "c", "") == 0
    device = request(matched={"a": 16}, shared={"t1": 16})
    assert policy.cached_tokens(device, "a", "t1") == 256  # a device copy is worth all its tokens


def test_ranking_device_then_shared_then_nothing():
    policy = make_policy("prefix_aware", load_cost_tokens=1, imbalance_abs=1000)
    # b mounts the tier holding the prefix, c mounts none, d another tier: b wins over c and d
    req = request(shared={"t1": 16})
    assert policy.choose(states(("b", "t1", 0), ("c", "", 0), ("d", "t2", 0)), req).replica_id == "b"
    # a holds it on its device: a device copy beats the shared tier
    req = request(matched={"a": 16}, shared={"t1": 16})
    assert policy.choose(states(("a", "t1", 0), ("b", "t1", 0)), req).replica_id == "a"
    # ... but not at any load: the shared-tier replica wins once a's queue costs more than the discount saves
    busy = states(("a", "t1", 70), ("b", "t1", 0))
    assert policy.choose(busy, req).replica_id == "b"  # 70 > 0.25 * 256 = 64 tokens of load price
    assert policy.choose(states(("a", "t1", 60), ("b", "t1", 0)), req).replica_id == "a"


def test_approximate_ignores_the_shared_tier_and_bad_discounts_are_refused():
    assert make_policy("approximate").cached_tokens(request(shared={"t1": 16}), "b", "t1") == 0
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="shared_discount"):
            make_policy("prefix_aware", shared_discount=bad)


def test_pseudo_ids_are_split_out_of_an_index_answer():
    pseudo = keys.shared_tier_replica_id("abc")
    assert keys.shared_tier_of(pseudo) == "abc" and keys.shared_tier_of("replica-0") == ""
    assert split_shared_tiers({"r1": 3, pseudo: 5}) == ({"r1": 3}, {"abc": 5})
    with pytest.raises(ValueError, match="shared tier id"):
        keys.shared_tier_replica_id("a:b")


class Stats:
    num_waiting = num_running = 0
    kv_cache_usage = 0.0
    block_size = 4

    def __init__(self, tier: str) -> None:
        self.kv_shared_tier_id = tier


def chain(n: int) -> list[str]:
    return [h.hex() for h in hash_prompt_blocks(list(range(4 * n)), 4, "m")]


def make_publisher(client, replica_id: str, tier: str, ttl_s: float = 5.0) -> Publisher:
    pub = Publisher("unused", MODEL, replica_id, {"grpc": f"{replica_id}:1", "http": f"{replica_id}:2"},
                    heartbeat_interval_s=ttl_s / 2, ttl_s=ttl_s, redis_client=client, block_size=4, hash_model_id="m")
    pub.submit_stats(Stats(tier))
    return pub


@pytest.mark.redis
def test_shared_blocks_are_indexed_under_the_tier_followed_and_never_reaped(redis_client):
    hashes = chain(6)
    writer = make_publisher(redis_client, "r1", "t1", ttl_s=0.2)
    other = make_publisher(redis_client, "r2", "t1")
    follower = IndexFollower(redis_client, MODEL)
    follower.poll()
    # r1 wrote the first 4 blocks to the shared tier (its device evicted them), r2 the next 2
    writer.submit_events([KVEvent(0, 0.0, BlockStored(hashes[:4], None, list(range(16)), 4, medium="SHARED"))])
    other.submit_events([KVEvent(0, 0.0, BlockStored(hashes[4:], None, list(range(16, 24)), 4, medium="SHARED"))])
    assert writer.flush() and other.flush()
    pseudo = keys.shared_tier_replica_id("t1")
    index = PrefixIndex(redis_client, MODEL)
    assert index.match(hashes) == {pseudo: 6}  # no device holds them: only the tier
    follower.poll()
    assert follower.match(hashes) == {pseudo: 6}
    late = IndexFollower(redis_client, MODEL)  # a router joining later: the snapshot has the tier
    late.poll()
    assert late.match(hashes) == {pseudo: 6}
    registry = ReplicaRegistry(redis_client, MODEL)
    assert {r.replica_id: r.extra.get("shared_tier") for r in registry.list_replicas()} == {"r1": "t1", "r2": "t1"}
    time.sleep(0.3)  # r1's heartbeat lapses: it is reaped, the tier (no heartbeat ever) is not
    assert registry.reap_expired() == ["r1"]
    assert index.match(hashes) == {pseudo: 6}
    assert pseudo not in {r.replica_id for r in registry.list_replicas()}


@pytest.mark.redis
def test_router_over_the_index_sends_a_shared_prefix_to_a_replica_mounting_the_tier(redis_server, redis_client):
    """r-a mounts no shared tier, r-b mounts t1 where the prompt's blocks are: r-b is chosen
    although r-a sorts first, and the decision says ``shared``."""
    class Tokenizer:
        def encode(self, text):
            return [int(t) for t in text.split()]

    async def scenario():
        fleet = FleetView(redis_server.client(), MODEL, "direct", timeout_s=1.0)
        replicas = ReplicaSet("registry")
        router = Router(replicas, Tokenizer(), "m", "prefix_aware", fleet, block_size=4)
        router.apply_heartbeats(await fleet.refresh())
        analysis = router.analyze(" ".join(map(str, range(24))))
        decision = await router.choose(analysis)
        fleet.stop()
        return decision, router

    make_publisher(redis_client, "r-a", "").flush()
    pub = make_publisher(redis_client, "r-b", "t1")
    pub.submit_events([KVEvent(0, 0.0, BlockStored(chain(6), None, list(range(24)), 4, medium="SHARED"))])
    pub.flush()
    decision, router = asyncio.run(scenario())
    assert decision.replica.replica_id == "r-b" and decision.match_kind == "shared"
    assert decision.shared_blocks == 6 and decision.matched_blocks == 0
    assert router.num_match_tokens["shared"] == 24
