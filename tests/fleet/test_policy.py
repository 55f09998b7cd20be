"""Routing policies: eligibility, determinism, load, the prefix/load trade-off, the guard."""

import pytest

from pagoda.fleet.routing.policy import (
    POLICIES, LeastLoadedPolicy, NoReplicaError, PrefixAwarePolicy, RandomPolicy, ReplicaState,
    RoundRobinPolicy, RoutingRequest, make_policy,
)


def replicas(n, **overrides):
    return [ReplicaState(f"r{i}", **overrides) for i in range(n)]


def request(matched=None, num_tokens=1024, block_size=16):
    return RoutingRequest("q", [], num_tokens, block_size, dict(matched or {}))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_never_unhealthy_or_draining_when_another_exists(name):
    policy = make_policy(name)
    fleet = [ReplicaState("a", healthy=False), ReplicaState("b", draining=True), ReplicaState("c", waiting=50)]
    for _ in range(20):
        assert policy.choose(fleet, request({"a": 64, "b": 64})).replica_id == "c"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_draining_only_as_last_resort_and_none_raises(name):
    policy = make_policy(name)
    fleet = [ReplicaState("a", healthy=False), ReplicaState("b", draining=True)]
    assert policy.choose(fleet, request()).replica_id == "b"
    with pytest.raises(NoReplicaError):
        policy.choose([ReplicaState("a", healthy=False)], request())
    with pytest.raises(NoReplicaError):
        policy.choose([], request())


def test_make_policy_registry_and_errors():
    assert isinstance(make_policy("prefix_aware", load_cost_tokens=10), PrefixAwarePolicy)
    with pytest.raises(ValueError, match="approximate, least_loaded, precise, prefix_aware, random, round_robin"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="bad knobs"):
        make_policy("round_robin", seed=1)
    with pytest.raises(ValueError):
        PrefixAwarePolicy(load_cost_tokens=-1)


def test_round_robin_cycles_in_id_order():
    policy = RoundRobinPolicy()
    fleet = [ReplicaState("b"), ReplicaState("a"), ReplicaState("c")]
    assert [policy.choose(fleet, request()).replica_id for _ in range(6)] == ["a", "b", "c"] * 2


def test_random_is_seeded_and_covers_all():
    picks = [RandomPolicy(seed=7).choose(replicas(4), request()).replica_id for _ in range(3)]
    assert len(set(picks)) == 1
    policy = RandomPolicy(seed=1)
    assert {policy.choose(replicas(4), request()).replica_id for _ in range(200)} == {"r0", "r1", "r2", "r3"}


def test_least_loaded_uses_max_of_heartbeat_and_in_flight():
    fleet = [ReplicaState("a", waiting=3, running=2), ReplicaState("b", in_flight=4), ReplicaState("c", running=9)]
    assert LeastLoadedPolicy().choose(fleet, request()).replica_id == "b"
    assert fleet[0].load == 5 and fleet[1].load == 4
    # once the heartbeat catches up with the in-flight count, nothing is counted twice
    assert ReplicaState("x", waiting=1, running=3, in_flight=4).load == 4


def test_ties_are_deterministic_by_replica_id():
    fleet = [ReplicaState("r2"), ReplicaState("r10"), ReplicaState("r1")]
    assert LeastLoadedPolicy().choose(fleet, request()).replica_id == "r1"
    assert PrefixAwarePolicy().choose(fleet, request()).replica_id == "r1"
    assert PrefixAwarePolicy().choose(fleet, request({"r2": 8, "r10": 8})).replica_id == "r10"


def test_prefix_beats_small_load_difference_but_not_large():
    policy = PrefixAwarePolicy(load_cost_tokens=64, imbalance_abs=100)
    req = request({"r1": 40})  # 640 cached tokens on r1 = worth 10 requests of load
    assert policy.choose([ReplicaState("r0", running=0), ReplicaState("r1", running=9)], req).replica_id == "r1"
    assert policy.choose([ReplicaState("r0", running=0), ReplicaState("r1", running=11)], req).replica_id == "r0"


def test_longer_match_wins_at_equal_load():
    policy = PrefixAwarePolicy()
    fleet = replicas(3, running=2)
    assert policy.choose(fleet, request({"r0": 3, "r1": 30, "r2": 10})).replica_id == "r1"


def test_match_beyond_prompt_is_capped():
    req = request({"r0": 100}, num_tokens=50, block_size=16)
    assert req.matched_tokens("r0") == 50 and req.matched_tokens("r9") == 0


def test_imbalance_guard_sets_overloaded_replica_aside():
    policy = PrefixAwarePolicy(load_cost_tokens=0, imbalance_abs=4, imbalance_rel=1.0)
    req = request({"r0": 64})
    assert policy.choose([ReplicaState("r0", running=4), ReplicaState("r1")], req).replica_id == "r0"
    assert policy.choose([ReplicaState("r0", running=5), ReplicaState("r1")], req).replica_id == "r1"
    # the relative margin grows with fleet-wide load
    fleet = [ReplicaState("r0", running=25), ReplicaState("r1", running=10)]
    assert policy.choose(fleet, req).replica_id == "r1"
    fleet[1].running = 20
    assert policy.choose(fleet, req).replica_id == "r0"


def test_burst_does_not_herd_onto_the_cached_replica():
    """32 requests sharing a prefix cached on r0 arrive before any heartbeat: the router
    bumps in_flight after each choice; the burst fills r0 up to the guard, then spreads."""
    policy = PrefixAwarePolicy(load_cost_tokens=16, imbalance_abs=4, imbalance_rel=1.0)
    fleet = replicas(4)
    counts = {r.replica_id: 0 for r in fleet}
    for _ in range(32):
        chosen = policy.choose(fleet, request({"r0": 60}))
        chosen.in_flight += 1
        counts[chosen.replica_id] += 1
    assert counts["r0"] == max(counts.values())
    assert counts["r0"] < 32 and all(c > 0 for c in counts.values())
    min_load = min(r.load for r in fleet)
    assert max(r.load for r in fleet) <= min_load + max(4, 1.0 * min_load) + 1  # guard margin + the last pick


def test_without_index_prefix_aware_is_least_loaded():
    fleet = [ReplicaState("a", running=3), ReplicaState("b", running=1), ReplicaState("c", running=2)]
    assert PrefixAwarePolicy().choose(fleet, request()).replica_id == "b"


def test_a_replica_with_a_waiting_queue_pays_for_it():
    """Same prefix credit and load: the replica whose heartbeat reports 2 requests waiting
    for a batch (not just running) loses when the other has none waiting; with the price
    off they tie on load and the one holding more of the prompt wins."""
    queued = ReplicaState("a", waiting=2, running=2)
    busy = ReplicaState("b", waiting=0, running=4)
    request = RoutingRequest("q", ["h"] * 20, 320, 16, matched_blocks={"a": 20, "b": 17})
    assert PrefixAwarePolicy().choose([queued, busy], request).replica_id == "b"
    assert PrefixAwarePolicy(waiting_cost_tokens=0).choose([queued, busy], request).replica_id == "a"
    with pytest.raises(ValueError, match="waiting_cost_tokens"):
        PrefixAwarePolicy(waiting_cost_tokens=-1)


# ------------------------------------------------------------------ capabilities and the shared path
CAPABILITIES = {"random": (False, False), "round_robin": (False, False), "least_loaded": (False, False),
                "prefix_aware": (True, True), "precise": (True, False), "approximate": (False, True)}


def test_policies_declare_capabilities_with_one_default():
    from pagoda.fleet.routing.policy import Policy

    assert (Policy.uses_exact, Policy.uses_pending, Policy.pending_ttl_s) == (False, False, 0.0)
    assert {name: (make_policy(name).uses_exact, make_policy(name).uses_pending) for name in POLICIES} == CAPABILITIES
    for factory in POLICIES.values():
        assert Policy in factory.__mro__  # subclassed explicitly: the defaults are inherited
    for plain in (RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy):  # they inherit the defaults
        assert "uses_exact" not in vars(plain) and "uses_pending" not in vars(plain)


def test_decide_shows_pending_past_the_index_only_to_policies_that_read_it():
    """The router's and the simulator's one path: a policy reading the index sees a replica's
    pending tail past its confirmed blocks; ``approximate`` (its own history only) does not."""
    from pagoda.fleet.routing.affinity import PendingIndex
    from pagoda.fleet.routing.decide import confirms_pending, decide

    hashes = ["h0", "h1", "h2", "h3"]
    shown = {}
    for name in ("prefix_aware", "approximate", "precise"):
        pending = PendingIndex(clock=lambda: 0.0)
        pending.record("a", hashes[2:], ttl_s=5)  # blocks 0-1 were confirmed by KV events
        routing = RoutingRequest("q", hashes, 64, 16, {"a": 2})
        chosen = decide(make_policy(name), replicas(2), routing, pending)
        shown[name] = routing.pending_blocks
        recorded = pending.match(hashes, now=1.0)
        assert (recorded.get(chosen.replica_id) == 4) == make_policy(name).uses_pending, name
    assert shown == {"prefix_aware": {"a": 4}, "approximate": {}, "precise": {}}
    assert [confirms_pending(make_policy(n)) for n in ("prefix_aware", "precise", "approximate")] == [True, True, False]
