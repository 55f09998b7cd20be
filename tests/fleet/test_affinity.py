"""Routing-time affinity: pending ownership (expiry on an injected clock), the policy's
discounted credit, a burst landing together until the imbalance guard spills, two routers
sharing decisions through a real Redis, and the retry helpers (backoff, rate-limited log)."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from pagoda.fleet.routing.affinity import AffinityShare, PendingIndex
from pagoda.fleet.routing.policy import PrefixAwarePolicy, ReplicaState, RoutingRequest, make_policy
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.index.retry import Backoff, RateLimitedLog
from pagoda.fleet.routing.fleet_view import FleetView, IndexView
from pagoda.fleet.routing.router import Router


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


class NoIndexYet(IndexView):
    """A FleetView surface whose index is up but has not heard of any prefix yet."""

    available = True

    async def match(self, block_hashes):
        return {}


def make_router(fleet, policy="prefix_aware", n=4, **knobs) -> Router:
    replicas = ReplicaSet("static")
    replicas.set_members([(f"r{i}", {"grpc": f"h{i}:1", "http": f"h{i}:2"}) for i in range(n)])
    return Router(replicas, FakeTokenizer(), "model-x", policy, fleet, block_size=4, **knobs)


def test_pending_entries_match_like_the_index_and_expire():
    clock = Clock()
    pending = PendingIndex(clock)
    pending.record("a", ["h1", "h2", "h3"], ttl_s=5)
    clock.now += 2
    pending.record("b", ["h1", "h2"], ttl_s=5)
    assert pending.match(["h1", "h2", "h3", "h4"]) == {"a": 3, "b": 2}
    assert pending.match(["hX", "h1"]) == {}  # not a leading block: worthless, like the index
    clock.now += 3.0  # a's entries lapse exactly at record time + ttl
    assert pending.match(["h1", "h2", "h3"]) == {"b": 2}
    pending.record("b", ["h1"], ttl_s=10)  # a newer decision extends only what it names
    clock.now += 2.5
    assert pending.match(["h1", "h2"]) == {"b": 1}
    assert pending.num_entries == 1
    clock.now += 10
    assert pending.match(["h1"]) == {} and pending.num_entries == 0
    pending.record("c", ["h1"], ttl_s=5)
    pending.remove_replica("c")
    assert pending.match(["h1"]) == {}


def test_kv_events_confirm_pending_entries_and_keep_the_pending_tail(redis_server, redis_client):
    """The first chunk of a prefix is prefilled: its events (through a real follower)
    confirm those blocks, the rest stays pending, and the match spans both."""
    from pagoda.contracts.kv_events import BlockRemoved, BlockStored
    from pagoda.fleet.index.mirror import IndexFollower
    from pagoda.fleet.index.prefix_index import PrefixIndex

    clock = Clock()
    pending = PendingIndex(clock)
    hashes = [f"{i:064x}" for i in range(1, 7)]
    pending.record("a", hashes, ttl_s=10)
    follower = IndexFollower(redis_client, "m")
    follower.on_events = pending.confirm
    follower.sync()
    PrefixIndex(redis_client, "m").apply("a", [BlockStored(hashes[:2], None, [0] * 8, 4)], epoch="e", first_seq=0)
    follower.poll()
    confirmed = follower.match(hashes)
    assert confirmed == {"a": 2}
    assert pending.match(hashes) == {}  # block 0 is no longer pending: the index speaks for it
    assert pending.match(hashes, confirmed=confirmed) == {"a": 6}
    pending.confirm("a", [BlockRemoved(hashes[2:3]).to_dict()])  # evicted before anyone used it
    assert pending.match(hashes, confirmed=confirmed) == {}
    pending.confirm("a", [{"type": "AllBlocksCleared"}])
    assert pending.num_entries == 0


def test_pending_credit_is_discounted_and_policies_pick_their_signals():
    # Nobody holds the prefix yet: pending is the only witness, at a discount.
    fresh = RoutingRequest("q", [], 512, 16, matched_blocks={}, pending_blocks={"b": 32})
    combined = PrefixAwarePolicy()
    assert combined.cached_tokens(fresh, "b") == pytest.approx(0.8 * 512)
    fleet = [ReplicaState("a"), ReplicaState("b", running=1)]
    assert combined.choose(fleet, fresh).replica_id == "b"
    assert make_policy("precise").choose(fleet, fresh).replica_id == "a" and not make_policy("precise").uses_pending
    # "a" holds half of it (exact): pending elsewhere counts only beyond what the index knows.
    known = RoutingRequest("q", [], 512, 16, matched_blocks={"a": 16}, pending_blocks={"a": 16, "b": 32})
    assert combined.cached_tokens(known, "a") == 256  # pending adds nothing where exact covers it
    assert combined.cached_tokens(known, "b") == pytest.approx(0.8 * (512 - 256))
    assert combined.choose([ReplicaState("a"), ReplicaState("b")], known).replica_id == "a"
    approximate = make_policy("approximate")  # its own history only: the index is ignored
    assert approximate.cached_tokens(known, "a") == 256 and approximate.cached_tokens(known, "b") == 512
    assert make_policy("precise").cached_tokens(known, "b") == 0
    with pytest.raises(ValueError, match="pending_ttl_s"):
        make_policy("approximate", pending_ttl_s=0)


def test_burst_lands_on_one_replica_until_the_guard_spills():
    """24 same-prefix requests arrive before any KV event: with affinity they pile onto the
    first one's replica up to the imbalance guard, then spill; without, they spread."""
    async def route_burst(policy):
        # load_cost_tokens small: the guard, not the load price, is what spills.
        router = make_router(NoIndexYet(), policy, load_cost_tokens=1, imbalance_abs=6, imbalance_rel=0)
        analysis = router.analyze("You are a helpful agent. " * 20)  # 125 blocks of 4
        return [(await router.choose(analysis)) for _ in range(24)], router

    decisions, router = asyncio.run(route_burst("prefix_aware"))
    chosen = [d.replica.replica_id for d in decisions]
    first = chosen[0]
    assert chosen[:7] == [first] * 7  # the first 6 extra requests follow the first one
    assert chosen[7] != first  # the 8th would exceed min_load + 6: the guard spills it
    assert decisions[0].match_kind == "none" and decisions[1].match_kind == "pending"
    assert decisions[1].pending_blocks == 125
    loads = [r.in_flight for r in router.replicas.all()]
    assert max(loads) - min(loads) <= 7 and sum(loads) == 24
    num_pending = sum(d.match_kind == "pending" for d in decisions)
    assert num_pending >= 24 - 4  # only the first request on each replica had nothing to follow
    assert router.num_match_tokens == {"exact": 0, "pending": num_pending * 500, "shared": 0}
    assert f'pagoda:router_prefix_match_tokens{{kind="pending"}} {num_pending * 500}' in router.metric_lines()

    spread, _ = asyncio.run(route_burst("precise"))  # no affinity: load alone while the index is empty
    assert [d.replica.replica_id for d in spread[:4]] == ["r0", "r1", "r2", "r3"]


def test_confirmed_blocks_take_over_from_pending():
    async def scenario():
        class Index(NoIndexYet):
            owners: dict = {}

            async def match(self, block_hashes):
                return dict(self.owners)

        index = Index()
        router = make_router(index, "prefix_aware", n=2)
        analysis = router.analyze("x" * 64)
        first = await router.choose(analysis)
        router.release(first)
        index.owners = {first.replica.replica_id: len(analysis.block_hashes)}  # its KV events arrived
        second = await router.choose(analysis)
        assert second.replica is first.replica and second.match_kind == "exact" and second.pending_blocks == 0
        return router

    router = asyncio.run(scenario())
    assert router.num_match_tokens == {"exact": 64, "pending": 0, "shared": 0}


def test_two_routers_sharing_redis_agree(redis_server, redis_client):
    """Router A routes the first request of a burst; router B, fed only by the shared
    stream (no KV event exists), sends the rest of the burst to the same replica."""
    async def scenario():
        fleets = [FleetView(redis_server.client(), "shared-model", "direct", timeout_s=1.0) for _ in range(2)]
        for fleet in fleets:
            fleet.available = True
        a, b = (make_router(fleet, "prefix_aware", n=4) for fleet in fleets)
        analysis = a.analyze("Tool call fan-out from one agent. " * 60)  # ~2k tokens
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, fleets[1].share.poll, 0)  # B's position: before A's decision
        first = await a.choose(analysis)
        assert await loop.run_in_executor(None, fleets[0].share.flush) == 1
        assert await loop.run_in_executor(None, fleets[1].share.poll, 100) == 1
        assert await loop.run_in_executor(None, fleets[0].share.poll, 0) == 0  # its own entry: skipped
        # B's replicas all look idle; only the shared pending entry can make it agree.
        followers = [await b.choose(analysis) for _ in range(3)]
        for fleet in fleets:
            fleet.stop()
        return first, followers

    first, followers = asyncio.run(scenario())
    assert {d.replica.replica_id for d in followers} == {first.replica.replica_id}
    assert all(d.match_kind == "pending" for d in followers)


def test_affinity_share_survives_redis_loss(redis_server, redis_client):
    pending = PendingIndex()
    share = AffinityShare(redis_server.client(), "m", pending, router_id="x")
    share.publish("r0", ["h1"], 5.0)
    redis_server.stop()
    with pytest.raises(Exception):
        share.flush()
    redis_server.start()
    assert share.poll(0) == 0  # reads from the (new, empty) stream's end again


def test_backoff_doubles_with_jitter_caps_and_resets():
    backoff = Backoff(initial_s=0.05, max_s=2.0, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(10)]
    ceilings = [min(2.0, 0.05 * 2 ** k) for k in range(10)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings))
    assert 5 < sum(delays) < 11.2  # ten tries span 5-11 s: a 15 s outage costs ~a dozen, not 750
    backoff.reset()
    assert backoff.next_delay() <= 0.05
    with pytest.raises(ValueError):
        Backoff(initial_s=0)


def test_rate_limited_log(caplog):
    clock = Clock(0.0)
    log = RateLimitedLog(logging.getLogger("pagoda.test.ratelimit"), interval_s=30.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="pagoda.test.ratelimit"):
        sent = []
        for _ in range(60):  # one failure every 0.5 s for 30 s
            sent.append(log.warning("Redis down"))
            clock.now += 0.5
        sent.append(log.warning("Redis down"))
    assert sum(sent) == 2
    assert "59 similar messages suppressed" in caplog.records[-1].getMessage()
