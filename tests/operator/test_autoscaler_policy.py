"""Autoscaling policy over recorded load traces, with an injected clock (no sleeps)."""

from __future__ import annotations

import pytest

from pagoda_operator.autoscaler import AutoscalerPolicy, FleetLoad
from pagoda_operator.drain import DrainState, choose_victim, drain_progress
from pagoda_operator.load import ReplicaLoad
from pagoda_operator.spec import AutoscalingSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def loads(n: int, waiting: float = 0.0, kv: float = 0.1, ttft: float = 0.0) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", waiting=waiting, running=1, kv_usage=kv, ttft_p90=ttft)
            for i in range(n)]


def replay(policy: AutoscalerPolicy, clock: Clock, trace, start: int, dt: float = 15.0):
    """Feed (waiting_per_replica, kv, ttft) samples every `dt` s; apply each decision."""
    current, history = start, []
    for waiting, kv, ttft in trace:
        decision = policy.decide(loads(current, waiting, kv, ttft), current)
        current = decision.desired
        history.append(current)
        clock.now += dt
    return history


def make(clock, **overrides) -> AutoscalerPolicy:
    spec = AutoscalingSpec(**{"scale_down_stabilization_seconds": 60, **overrides})
    return AutoscalerPolicy(spec, 1, 6, clock)


def test_burst_scales_up_fast_and_down_only_after_window():
    clock = Clock()
    policy = make(clock)
    burst = [(0, 0.1, 0)] * 2 + [(16, 0.5, 0)] * 3 + [(0, 0.1, 0)] * 10
    history = replay(policy, clock, burst, start=1)
    # 16 waiting per replica vs a target of 4: x4 at once (1 -> 4), then 4 -> 16, which
    # maxScaleUpStep (4) cuts to 8 and max clamps to 6.
    assert history[:2] == [1, 1]
    assert history[2:5] == [4, 6, 6]
    # The lull starts at sample 5 (t=75 s); while the last busy sample (t=60 s) is inside
    # the 60 s window, nothing leaves.
    assert history[5:8] == [6, 6, 6]
    # Then one replica per decision (each is drained first), down to min and no further.
    assert history[8:] == [5, 4, 3, 2, 1, 1, 1]
    assert all(1 <= n <= 6 for n in history)


def test_hysteresis_band_holds_steady_near_target():
    clock = Clock()
    policy = make(clock, tolerance=0.1, scale_down_stabilization_seconds=0)
    trace = [(4.3, 0.1, 0), (3.7, 0.1, 0), (4.35, 0.1, 0), (3.65, 0.1, 0)] * 3
    assert set(replay(policy, clock, trace, start=3)) == {3}


def test_flapping_load_does_not_flap_replicas():
    clock = Clock()
    policy = make(clock)
    trace = [(12, 0.5, 0), (0, 0.1, 0)] * 6  # alternating every 15 s, window 60 s
    history = replay(policy, clock, trace, start=2)
    downs = sum(1 for a, b in zip(history, history[1:]) if b < a)
    assert downs == 0, history


def test_kv_usage_and_ttft_slo_drive_scale_up():
    clock = Clock()
    policy = make(clock, ttft_slo_seconds=0.5)
    assert policy.decide(loads(2, 0, kv=0.95), 2).desired == 3  # 0.95/0.8 -> ceil(2.375)
    clock.now += 15
    decision = policy.decide(loads(3, 0, kv=0.5, ttft=1.5), 3)  # 3x the SLO
    assert decision.desired == 6 and "ttft_p90" in decision.reason


def test_no_reports_keep_current_and_bounds_are_enforced():
    clock = Clock()
    policy = AutoscalerPolicy(AutoscalingSpec(), 2, 4, clock)
    assert policy.decide([], 3).desired == 3
    assert policy.decide(loads(8, 50), 8).desired == 4  # above max: clamp at once
    assert policy.decide(loads(1, 0), 1).desired == 2   # below min: clamp at once


def test_scale_up_window_requires_sustained_pressure():
    clock = Clock()
    policy = make(clock, scale_up_stabilization_seconds=30)
    history = replay(policy, clock, [(0, 0.1, 0), (20, 0.9, 0), (20, 0.9, 0), (20, 0.9, 0)],
                     start=1)
    assert history == [1, 1, 5, 5]  # held while the 1 from t=0 is inside the window


def test_fleet_load_aggregates():
    fleet = FleetLoad.of([ReplicaLoad("a", 2, 1, 0.2, 0.1), ReplicaLoad("b", 4, 3, 0.6, 0.9)])
    assert (fleet.num_replicas, fleet.waiting, fleet.running) == (2, 6, 4)
    assert fleet.kv_usage == pytest.approx(0.4) and fleet.ttft_p90 == 0.9


def test_fleet_ttft_p90_is_one_quantile_over_all_replicas_requests():
    """Nine replicas with 10 fast requests each and one with 2 cold 6 s prefills: the worst
    replica's P90 (6 s) is over a 4 s SLO, the fleet's (all 92 requests) is not; without
    buckets (an older replica) its own P90 still counts."""
    from pagoda.contracts import redis_keys as keys

    fast = [ReplicaLoad(f"r{i}", ttft_p90=0.3, ttft_buckets=keys.decode_ttft_buckets(
        keys.encode_ttft_buckets([0.3] * 10))) for i in range(9)]
    cold = ReplicaLoad("cold", ttft_p90=6.0,
                       ttft_buckets=keys.decode_ttft_buckets(keys.encode_ttft_buckets([6.0, 6.0])))
    fleet = FleetLoad.of(fast + [cold])
    assert 0.25 < fleet.ttft_p90 <= 0.5
    spec = AutoscalingSpec(ttft_slo_seconds=4.0)
    policy = AutoscalerPolicy(spec, 1, 16, clock=lambda: 0.0)
    assert policy.decide(fast + [cold], current=10).desired <= 10  # was ceil(10 * 6 / 4) = 15
    slow_fleet = [ReplicaLoad(x.replica_id, ttft_p90=6.0, ttft_buckets=cold.ttft_buckets) for x in fast] + [cold]
    assert FleetLoad.of(slow_fleet).ttft_p90 > 4.0
    assert FleetLoad.of(fast + [ReplicaLoad("old", ttft_p90=5.0)]).ttft_p90 == 5.0


def test_drain_victim_and_progress():
    reports = {"a": ReplicaLoad("a", running=3), "b": ReplicaLoad("b", running=1),
               "c": ReplicaLoad("c", running=1, kv_usage=0.5)}
    assert choose_victim(["a", "b", "c"], reports) == "b"
    assert choose_victim(["a", "b", "z"], reports) == "z"  # silent pod first
    state = DrainState("b", started_at=100.0, target_replicas=2)
    assert DrainState.from_status(state.to_status()) == state
    assert drain_progress(state, reports["b"], True, now=150, timeout_s=600) is None
    assert drain_progress(state, ReplicaLoad("b"), True, now=150, timeout_s=600) == "idle"
    assert drain_progress(state, reports["b"], False, now=150, timeout_s=600) == "gone"
    assert drain_progress(state, reports["b"], True, now=700, timeout_s=600) == "timeout"


def test_prefill_pool_scales_on_queue_and_ttft_not_on_kv_usage():
    """The prefill pool's policy (spec.PREFILL_AUTOSCALING: target 2 waiting, no KV target): a
    full KV cache (finished prompts waiting to be pulled) is no reason to grow, its queue and
    its TTFT are; the decode defaults would have grown on that KV usage."""
    from pagoda_operator.spec import PREFILL_AUTOSCALING, parse_spec

    clock = Clock()
    prefill = AutoscalerPolicy(PREFILL_AUTOSCALING, 1, 8, clock)
    assert prefill.decide(loads(2, waiting=0, kv=0.99), 2).desired == 1  # idle: its full cache holds nothing
    assert AutoscalerPolicy(AutoscalingSpec(), 1, 8, clock).decide(loads(2, waiting=0, kv=0.99), 2).desired == 3
    decision = prefill.decide(loads(2, waiting=6, kv=0.99), 2)  # 6 waiting per pod vs 2: x3
    assert decision.desired == 6 and decision.reason.startswith("waiting")
    spec = parse_spec({"image": "p", "model": {"name": "m", "storageUri": "pvc://c"},
                       "disaggregation": {"prefill": {"replicas": {"min": 1, "max": 8},
                                                      "autoscaling": {"ttftSLOSeconds": 0.5}}}})
    ttft = AutoscalerPolicy(spec.disaggregation.prefill_autoscaling, 1, 8, clock)
    decision = ttft.decide(loads(2, waiting=0, kv=0.99, ttft=1.5), 2)  # 3x the TTFT SLO
    assert decision.desired == 6 and "ttft_p90" in decision.reason


def test_itl_slo_scales_the_decode_pool_on_the_fleet_p90_of_inter_token_latency():
    """Inter-token latency: one quantile over every replica's recent tokens (their histogram
    buckets summed, as for TTFT), against itlSLOSeconds."""
    from pagoda.serving.metrics import ITL_BUCKETS

    def itl_load(name: str, gaps: list[float]) -> ReplicaLoad:
        buckets = {b: float(sum(g <= b for g in gaps)) for b in [*ITL_BUCKETS, float("inf")]}
        return ReplicaLoad(name, running=4, kv_usage=0.8, itl_buckets=buckets)  # KV on target

    smooth = [itl_load(f"r{i}", [0.02] * 100) for i in range(3)]
    stalled = [itl_load(f"r{i}", [0.02] * 50 + [0.3] * 50) for i in range(3)]  # a prefill burst stalls them
    assert FleetLoad.of(smooth).itl_p90 <= 0.025 and 0.2 < FleetLoad.of(stalled).itl_p90 <= 0.3
    clock = Clock()
    policy = AutoscalerPolicy(AutoscalingSpec(itl_slo_seconds=0.1), 1, 8, clock)
    assert policy.decide(smooth, 3).desired == 3
    decision = policy.decide(stalled, 3)
    assert decision.desired > 3 and "itl_p90" in decision.reason
    assert AutoscalerPolicy(AutoscalingSpec(), 1, 8, clock).decide(stalled, 3).desired == 3  # SLO 0: off
