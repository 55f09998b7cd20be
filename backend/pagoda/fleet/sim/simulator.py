"""Discrete-event simulator of a routed fleet, built from the real engine parts.

Each simulated replica is the real ``Scheduler`` (with its real ``BlockPool``, prefix
cache, chunked prefill and preemption); only the forward pass is replaced: a step's
sampled token is a constant, and the step lasts

    t(step) = a + b * num_batched_tokens + c * sum(context tokens)

where a request's context is ``num_computed_tokens + num_new_tokens`` (the KV it attends
over). ``a, b, c`` come from ``pagoda bench routing --calibrate``, which times the real
engine (``StepTimeModel``). The router is the real one's decision path
(``pagoda.fleet.routing.decide``, shared with ``Router.choose``): prompts are
hashed with ``pagoda.contracts.block_hash.hash_prompt_blocks``; the prefix index is a
``LocalIndex`` (``pagoda.fleet.index.mirror``) fed with each replica's own block events
after every step (what the Redis index and ``IndexFollower`` hold, minus network delay),
asked only for policies with ``uses_exact``; routing-time affinity is the router's
``PendingIndex`` on the simulated clock; the policy objects are those of
``pagoda.fleet.routing.policy``.
Arrivals come from ``pagoda.fleet.sim.arrivals`` (poisson, fanout bursts, diurnal, ramp). The router's load view
mirrors production: heartbeat fields (waiting, running, KV usage) refreshed every ``heartbeat_interval_s``, plus an
exact ``in_flight`` count of its own requests.

Events are (time, order) in a heap: arrivals, step completions, heartbeats. A replica
with work starts its next step when the previous one ends. TTFT is measured from arrival
to the end of the step that samples the first token.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Optional

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagoda.fleet.routing.affinity import PendingIndex
from pagoda.fleet.routing.cost_model import DEFAULT_STEP_MODEL, StepTimeModel  # noqa: F401 - re-exported
from pagoda.fleet.routing.decide import confirms_pending, decide
from pagoda.fleet.sim.arrivals import arrivals, zipf_weights
from pagoda.fleet.index.mirror import LocalIndex
from pagoda.fleet.routing.policy import Policy, ReplicaState, RoutingRequest

SIM_MODEL_ID = "SmolLM2-135M-Instruct"
FAKE_TOKEN = 1


@dataclass(frozen=True)
class WorkloadConfig:
    """A multi-tenant shared-prefix workload.

    Each tenant has its own system prompt; a request is that prompt plus a fresh user
    turn. Tenant popularity is Zipf(``zipf_s``) so a few tenants are hot. ``arrival``
    names the process (``pagoda.fleet.sim.arrivals``): poisson, fanout (bursts of
    ``burst_size`` same-tenant requests), diurnal or ramp; ``arrival_rate`` is its mean.
    """

    num_tenants: int = 48
    system_prompt_tokens: int = 1024
    min_user_tokens: int = 32
    max_user_tokens: int = 128
    output_tokens: int = 32
    arrival_rate: float = 16.0  # requests per second, whole fleet
    num_requests: int = 800
    zipf_s: float = 0.6
    seed: int = 0
    arrival: str = "poisson"
    burst_size: int = 8


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_time: float
    tenant: int
    token_ids: list[int]
    max_tokens: int


def make_workload(cfg: WorkloadConfig) -> list[SimRequest]:
    """The same request list for the same config on every machine."""
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(cfg.system_prompt_tokens)] for _ in range(cfg.num_tenants)]
    def user_turn() -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(rng.randint(cfg.min_user_tokens, cfg.max_user_tokens))]

    requests = []
    if cfg.arrival == "poisson":  # drawn interleaved, as before the other processes existed (same lists per seed)
        weights = zipf_weights(cfg.num_tenants, cfg.zipf_s)
        now = 0.0
        for i in range(cfg.num_requests):
            now += rng.expovariate(cfg.arrival_rate)
            tenant = rng.choices(range(cfg.num_tenants), weights)[0]
            requests.append(SimRequest(f"q{i}", now, tenant, prompts[tenant] + user_turn(), cfg.output_tokens))
        return requests
    times = arrivals(cfg.arrival, cfg.num_requests, cfg.arrival_rate, cfg.num_tenants, cfg.zipf_s, rng,
                     burst_size=cfg.burst_size)
    for i, (now, tenant) in enumerate(times):
        requests.append(SimRequest(f"q{i}", now, tenant, prompts[tenant] + user_turn(), cfg.output_tokens))
    return requests


@dataclass
class ReplicaConfig:
    num_blocks: int = 1025  # 1024 usable blocks of 16 tokens: 16k tokens of KV
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048


class SimReplica:
    """A real scheduler with a modelled forward pass."""

    def __init__(self, replica_id: str, config: ReplicaConfig, step_model: StepTimeModel) -> None:
        self.replica_id = replica_id
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=config.num_blocks, max_model_len=config.max_model_len, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            model_id=SIM_MODEL_ID))
        self.step_model = step_model
        self.current: Optional[SchedulerOutput] = None
        self.busy_time = 0.0

    def add(self, request: SimRequest, now: float) -> None:
        self.scheduler.add_request(Request(request.request_id, request.token_ids,
                                           SamplingParams(max_tokens=request.max_tokens, ignore_eos=True),
                                           arrival_time=now))

    def start_step(self) -> Optional[float]:
        """Schedule a step; returns its duration, or None when there is nothing to run."""
        assert self.current is None, "a step is already running"
        if not self.scheduler.has_unfinished_requests():
            return None
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        self.current = out
        context = sum(s.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        duration = self.step_model.step_time(out.total_num_scheduled_tokens, context)
        self.busy_time += duration
        return duration

    def finish_step(self):
        out, self.current = self.current, None
        sampled = {s.request.request_id: [FAKE_TOKEN] for s in out.scheduled if s.is_sampling}
        return self.scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, sampled))


@dataclass
class SimResult:
    policy: str
    num_replicas: int
    ttfts: list[float]
    num_output_tokens: int
    makespan_s: float
    hit_rate: float
    num_preemptions: int
    num_requests: int
    busy_fraction: float
    arrival: str = "poisson"

    def percentile(self, q: float) -> float:
        values = sorted(self.ttfts)
        if not values:
            return math.nan
        return values[min(len(values) - 1, int(math.ceil(q * len(values))) - 1)]

    @property
    def throughput(self) -> float:
        """Output tokens per second of simulated time."""
        return self.num_output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0


@dataclass
class _Tracking:
    arrival: float
    replica_id: str
    first_token: Optional[float] = None
    measured: bool = True


@dataclass
class FleetSimulator:
    """N simulated replicas behind one router running ``policy``."""

    num_replicas: int
    policy: Policy
    step_model: StepTimeModel = DEFAULT_STEP_MODEL
    replica_config: ReplicaConfig = field(default_factory=ReplicaConfig)
    heartbeat_interval_s: float = 1.0
    warmup_fraction: float = 0.2  # requests arriving first are run but not measured

    def run(self, workload: list[SimRequest]) -> SimResult:
        """Replay ``workload``; returns the TTFTs of the measured requests and fleet totals."""
        cfg = self.replica_config
        replicas = {f"r{i:02d}": SimReplica(f"r{i:02d}", cfg, self.step_model) for i in range(self.num_replicas)}
        index = LocalIndex()
        clock_now = [0.0]
        pending = PendingIndex(clock=lambda: clock_now[0])
        states = {rid: ReplicaState(rid) for rid in replicas}
        tracking: dict[str, _Tracking] = {}
        heap: list = []
        order = 0

        def push(time: float, kind: str, payload) -> None:
            nonlocal order
            heapq.heappush(heap, (time, order, kind, payload))
            order += 1

        for request in workload:
            push(request.arrival_time, "arrival", request)
        push(0.0, "heartbeat", None)
        num_warmup = int(len(workload) * self.warmup_fraction)
        num_left = len(workload)
        num_output_tokens = 0
        end_time = 0.0
        while heap and num_left:
            now, _, kind, payload = heapq.heappop(heap)
            clock_now[0] = now
            if kind == "heartbeat":
                for rid, replica in replicas.items():
                    s = replica.scheduler
                    states[rid].waiting, states[rid].running = s.num_waiting, s.num_running
                    states[rid].kv_usage = s.kv_cache_usage
                push(now + self.heartbeat_interval_s, "heartbeat", None)
            elif kind == "arrival":
                rid = self._route(payload, states, index, pending)
                tracking[payload.request_id] = _Tracking(now, rid, measured=int(payload.request_id[1:]) >= num_warmup)
                replica = replicas[rid]
                replica.add(payload, now)
                if replica.current is None:
                    self._start(replica, now, push)
            else:
                replica = payload
                for update in replica.finish_step():
                    track = tracking[update.request.request_id]
                    if update.new_token_ids and track.first_token is None:
                        track.first_token = now
                    num_output_tokens += len(update.new_token_ids)
                    if update.finished:
                        states[track.replica_id].in_flight -= 1
                        num_left -= 1
                        end_time = now
                events = replica.scheduler.take_events()
                index.apply(replica.replica_id, events)
                if confirms_pending(self.policy):
                    pending.confirm(replica.replica_id, (e.event for e in events))
                self._start(replica, now, push)
        queries = sum(r.scheduler.prefix_cache_queries for r in replicas.values())
        hits = sum(r.scheduler.prefix_cache_hits for r in replicas.values())
        start = workload[0].arrival_time if workload else 0.0
        return SimResult(
            policy=self.policy.name, num_replicas=self.num_replicas,
            ttfts=[t.first_token - t.arrival for t in tracking.values() if t.measured],
            num_output_tokens=num_output_tokens, makespan_s=end_time - start,
            hit_rate=hits / queries if queries else 0.0,
            num_preemptions=sum(r.scheduler.num_preemptions_total for r in replicas.values()),
            num_requests=len(workload),
            busy_fraction=sum(r.busy_time for r in replicas.values()) / (self.num_replicas * max(end_time, 1e-9)))

    def _route(self, request: SimRequest, states: dict[str, ReplicaState], index: LocalIndex,
               pending: PendingIndex) -> str:
        block_size = self.replica_config.block_size
        hashes = [h.hex() for h in hash_prompt_blocks(request.token_ids, block_size, SIM_MODEL_ID)]
        routing = RoutingRequest(request.request_id, hashes, len(request.token_ids), block_size,
                                 index.match(hashes) if self.policy.uses_exact else {})
        chosen = decide(self.policy, list(states.values()), routing, pending)
        chosen.in_flight += 1  # the router's optimistic accounting, as the real router does
        return chosen.replica_id

    @staticmethod
    def _start(replica: SimReplica, now: float, push) -> None:
        if replica.current is not None:
            return
        duration = replica.start_step()
        if duration is not None:
            push(now + duration, "step", replica)
