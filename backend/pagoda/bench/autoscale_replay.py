"""The operator's autoscaler replayed on the routing simulator: no Kubernetes, same decisions.

A fleet of simulated replicas (``pagoda.fleet.sim.simulator.SimReplica``: the real scheduler and
block pool, modelled step times) behind the simulated router (the real policy objects, the
prefix index fed by the replicas' KV events, routing-time affinity) serves a time-varying
trace, while ``pagoda_operator.autoscaler.AutoscalerPolicy`` (the very object the
operator's timer uses) decides the replica count every ``tick_s`` from the loads the
replicas report (waiting, running, KV usage, TTFT P90 over the last ``ttft_window_s``), and
scale-ins go through ``pagoda_operator.drain``: the cheapest victim (``choose_victim``) is
flagged draining (the router sends it nothing new), removed once ``drain_progress`` says
it is idle (or timed out), and its index entries are then deleted, as the operator does
with ``forget_replica``.

A scale-up starts pods that become routable ``startup_s`` later (image pull + model load).

Traces (``make_trace``): ``ramp`` (rate rises linearly from ``base_rate`` to
``peak_rate`` over 40% of the run, holds for 30%, falls back over the last 30%) and
``burst`` (``base_rate``, then ``peak_rate`` for ``burst_s``, then ``base_rate`` again).

Reported (``ReplayResult``): scale-up lag (first SLO breach seen at a tick -> first
scale-up decision -> first new replica routable), SLO attainment (share of requests with
TTFT <= the SLO, and share of ``ttft_window_s`` windows whose P90 met it), replica-hours
(starting and draining pods count), and per scale-in the drain time and the index entries
(block-owner pairs) deleted.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.contracts import redis_keys as keys
from pagoda.fleet.routing.affinity import PendingIndex
from pagoda.fleet.index.mirror import LocalIndex
from pagoda.fleet.routing.policy import ReplicaState, RoutingRequest, make_policy
from pagoda.fleet.sim.simulator import (
    DEFAULT_STEP_MODEL, SIM_MODEL_ID, ReplicaConfig, SimReplica, SimRequest, StepTimeModel, WorkloadConfig,
)


@dataclass(frozen=True)
class ReplayConfig:
    trace: str = "ramp"
    base_rate: float = 0.5  # requests per second
    peak_rate: float = 4.0
    duration_s: float = 1200.0
    burst_s: float = 180.0
    startup_s: float = 30.0
    tick_s: float = 15.0
    ttft_slo_s: float = 2.0
    ttft_window_s: float = 30.0
    min_replicas: int = 1
    max_replicas: int = 16
    scale_down_stabilization_s: int = 120
    policy: str = "prefix_aware"
    static_replicas: Optional[int] = None  # a fixed fleet instead (the baseline)
    seed: int = 0
    workload: WorkloadConfig = field(default_factory=lambda: WorkloadConfig(num_tenants=48))


def rate_at(cfg: ReplayConfig, t: float) -> float:
    """The trace's arrival rate at time ``t`` (module docstring)."""
    d = cfg.duration_s
    if cfg.trace == "burst":
        start = 0.3 * d
        return cfg.peak_rate if start <= t < start + cfg.burst_s else cfg.base_rate
    if cfg.trace != "ramp":
        raise ValueError(f"unknown trace {cfg.trace!r}; known: ramp, burst")
    rise, hold = 0.4 * d, 0.7 * d
    if t < rise:
        return cfg.base_rate + (cfg.peak_rate - cfg.base_rate) * t / rise
    if t < hold:
        return cfg.peak_rate
    return max(cfg.base_rate, cfg.peak_rate - (cfg.peak_rate - cfg.base_rate) * (t - hold) / (d - hold))


def make_trace(cfg: ReplayConfig) -> list[SimRequest]:
    """Requests of the multi-tenant workload arriving at ``rate_at`` (thinning), seeded."""
    w = cfg.workload
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(w.system_prompt_tokens)] for _ in range(w.num_tenants)]
    weights = [1.0 / (k + 1) ** w.zipf_s for k in range(w.num_tenants)]
    peak = max(cfg.base_rate, cfg.peak_rate)
    out, now = [], 0.0
    while True:
        now += rng.expovariate(peak)
        if now >= cfg.duration_s:
            return out
        if rng.random() < rate_at(cfg, now) / peak:
            tenant = rng.choices(range(w.num_tenants), weights)[0]
            user = [rng.randrange(1000, 30000) for _ in range(rng.randint(w.min_user_tokens, w.max_user_tokens))]
            out.append(SimRequest(f"q{len(out)}", now, tenant, prompts[tenant] + user, w.output_tokens))


@dataclass
class ReplayResult:
    cfg: ReplayConfig
    ttfts: list[float]
    replica_seconds: float
    max_replicas_seen: int
    first_breach_s: Optional[float]
    first_scale_up_s: Optional[float]
    first_ready_s: Optional[float]
    window_p90s: list[float]
    drains: list[tuple[float, int]]  # (drain seconds, index entries deleted) per scale-in
    decisions: list[tuple[float, int, int, str]]  # (t, from, to, reason)

    def attainment(self) -> float:
        return sum(t <= self.cfg.ttft_slo_s for t in self.ttfts) / len(self.ttfts) if self.ttfts else math.nan

    def window_attainment(self) -> float:
        if not self.window_p90s:
            return math.nan
        return sum(p <= self.cfg.ttft_slo_s for p in self.window_p90s) / len(self.window_p90s)

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600.0

    def p90(self) -> float:
        return _p90(self.ttfts)


def _p90(values) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(0.9 * len(ordered))) - 1)] if ordered else 0.0


class _Pod:
    def __init__(self, replica_id: str, replica: SimReplica, ready_at: float) -> None:
        self.replica_id = replica_id
        self.replica = replica
        self.ready_at = ready_at
        self.state = ReplicaState(replica_id)
        self.ttfts: deque = deque()  # (time of first token, ttft)

    def load(self, now: float, window_s: float):
        from pagoda_operator.load import ReplicaLoad

        while self.ttfts and self.ttfts[0][0] < now - window_s:
            self.ttfts.popleft()
        s = self.replica.scheduler
        ttfts = [t for _, t in self.ttfts]
        return ReplicaLoad(self.replica_id, waiting=s.num_waiting, running=s.num_running, kv_usage=s.kv_cache_usage,
                           ttft_p90=_p90(ttfts), ts=now,  # the heartbeat's fields, as a replica publishes them
                           ttft_buckets=keys.decode_ttft_buckets(keys.encode_ttft_buckets(ttfts)))


class AutoscaleReplay:
    """One replay of ``cfg`` (module docstring); ``run`` returns a ``ReplayResult``."""

    def __init__(self, cfg: ReplayConfig, step_model: StepTimeModel = DEFAULT_STEP_MODEL,
                 replica_config: Optional[ReplicaConfig] = None) -> None:
        from pagoda_operator.autoscaler import AutoscalerPolicy
        from pagoda_operator.spec import AutoscalingSpec

        self.cfg = cfg
        self.step_model = step_model
        self.replica_config = replica_config or ReplicaConfig()
        self.now = 0.0
        spec = AutoscalingSpec(ttft_slo_seconds=cfg.ttft_slo_s,
                               scale_down_stabilization_seconds=cfg.scale_down_stabilization_s)
        self.autoscaler = AutoscalerPolicy(spec, cfg.min_replicas, cfg.max_replicas, clock=lambda: self.now)
        self.policy = make_policy(cfg.policy)
        self.index = LocalIndex()
        self.pending = PendingIndex(clock=lambda: self.now)
        self.pods: dict[str, _Pod] = {}
        self.num_created = 0
        self.heap: list = []
        self.order = 0
        self.drain: Optional[tuple] = None  # (DrainState, started)

    def _push(self, t: float, kind: str, payload=None) -> None:
        heapq.heappush(self.heap, (t, self.order, kind, payload))
        self.order += 1

    def _add_pod(self, ready_at: float) -> None:
        rid = f"pod-{self.num_created:02d}"
        self.num_created += 1
        self.pods[rid] = _Pod(rid, SimReplica(rid, self.replica_config, self.step_model), ready_at)
        self._push(ready_at, "ready", rid)

    def run(self) -> ReplayResult:
        cfg = self.cfg
        for _ in range(cfg.static_replicas or cfg.min_replicas):
            self._add_pod(0.0)
        trace = make_trace(cfg)
        for request in trace:
            self._push(request.arrival_time, "arrival", request)
        self._push(0.0, "heartbeat")
        if cfg.static_replicas is None:
            self._push(cfg.tick_s, "tick")
        self._push(cfg.ttft_window_s, "window")
        self.result = ReplayResult(cfg, [], 0.0, len(self.pods), None, None, None, [], [], [])
        self.tracking: dict[str, tuple[float, str, list]] = {}
        self.window_ttfts: list[float] = []
        num_left, last = len(trace), 0.0
        self.num_lost = 0  # requests still on a pod whose drain timed out
        while self.heap and num_left > self.num_lost and last < 3 * cfg.duration_s:
            t, _, kind, payload = heapq.heappop(self.heap)
            self.result.replica_seconds += len(self.pods) * (t - last)
            self.now = last = t
            if kind == "arrival":
                self._route(payload)
            elif kind == "step":
                num_left -= self._finish_step(payload)
            elif kind == "heartbeat":
                for pod in self.pods.values():
                    s = pod.replica.scheduler
                    pod.state.waiting, pod.state.running, pod.state.kv_usage = s.num_waiting, s.num_running, \
                        s.kv_cache_usage
                self._push(t + 1.0, "heartbeat")
            elif kind == "tick":
                self._tick()
                self._push(t + cfg.tick_s, "tick")
            elif kind == "window":
                if self.window_ttfts:
                    self.result.window_p90s.append(_p90(self.window_ttfts))
                self.window_ttfts = []
                self._push(t + cfg.ttft_window_s, "window")
        return self.result

    # ------------------------------------------------------------ router side
    def _routable(self) -> list[ReplicaState]:
        return [p.state for p in self.pods.values() if p.ready_at <= self.now]

    def _route(self, request: SimRequest) -> None:
        block_size = self.replica_config.block_size
        hashes = [h.hex() for h in hash_prompt_blocks(request.token_ids, block_size, SIM_MODEL_ID)]
        routing = RoutingRequest(request.request_id, hashes, len(request.token_ids), block_size,
                                 self.index.match(hashes))
        if self.policy.uses_pending:
            routing.pending_blocks = self.pending.match(hashes, confirmed=routing.matched_blocks)
        chosen = self.policy.choose(self._routable(), routing)
        chosen.in_flight += 1
        if self.policy.uses_pending:
            self.pending.record(chosen.replica_id, hashes, self.policy.pending_ttl_s)
        pod = self.pods[chosen.replica_id]
        pod.replica.add(request, self.now)
        self.tracking[request.request_id] = (self.now, pod.replica_id, [None])
        if pod.replica.current is None:
            self._start(pod)

    def _start(self, pod: _Pod) -> None:
        duration = pod.replica.start_step()
        if duration is not None:
            self._push(self.now + duration, "step", pod.replica_id)

    def _finish_step(self, replica_id: str) -> int:
        pod = self.pods.get(replica_id)
        if pod is None:  # removed after a drain timeout
            return 0
        finished = 0
        for update in pod.replica.finish_step():
            arrival, _, first = self.tracking[update.request.request_id]
            if update.new_token_ids and first[0] is None:
                first[0] = self.now
                ttft = self.now - arrival
                self.result.ttfts.append(ttft)
                self.window_ttfts.append(ttft)
                pod.ttfts.append((self.now, ttft))
            if update.finished:
                pod.state.in_flight -= 1
                finished += 1
        events = pod.replica.scheduler.take_events()
        self.index.apply(replica_id, events)
        self.pending.confirm(replica_id, (e.event for e in events))
        self._start(pod)
        return finished

    # ------------------------------------------------------------ operator side
    def _tick(self) -> None:
        from pagoda_operator import drain
        from pagoda_operator.autoscaler import fleet_ttft_p90

        cfg, now = self.cfg, self.now
        live = {rid: p for rid, p in self.pods.items() if p.ready_at <= now}
        loads = {rid: p.load(now, cfg.ttft_window_s) for rid, p in live.items()}
        if self.result.first_breach_s is None and fleet_ttft_p90(list(loads.values())) > cfg.ttft_slo_s:
            self.result.first_breach_s = now
        current = len(self.pods)
        if self.drain is not None:
            state = self.drain
            why = drain.drain_progress(state, loads.get(state.replica_id), True, now, 600)
            if why is not None:
                self._remove(state.replica_id, now - state.started_at)
                self.drain = None
            return
        decision = self.autoscaler.decide(loads.values(), current)
        if decision.is_scale_up:
            self.result.decisions.append((now, current, decision.desired, decision.reason))
            if self.result.first_scale_up_s is None:
                self.result.first_scale_up_s = now
                self.result.first_ready_s = now + cfg.startup_s
            for _ in range(decision.desired - current):
                self._add_pod(now + cfg.startup_s)
            self.result.max_replicas_seen = max(self.result.max_replicas_seen, len(self.pods))
        elif decision.is_scale_down and len(live) == current:
            self.result.decisions.append((now, current, decision.desired, decision.reason))
            victim = drain.choose_victim(sorted(live), loads)
            self.pods[victim].state.draining = True
            self.drain = drain.DrainState(replica_id=victim, started_at=now, target_replicas=decision.desired)

    def _remove(self, replica_id: str, drain_s: float) -> None:
        """The drained pod goes; its index entries are deleted (the operator's forget_replica)."""
        num_entries = len(self.index.get_blocks(replica_id))
        self.index.remove_replica(replica_id)
        self.pending.remove_replica(replica_id)
        self.result.drains.append((drain_s, num_entries))
        self.num_lost += self.pods.pop(replica_id).state.in_flight
