"""Disaggregated prefill/decode in the fleet simulator: goodput against SLOs, colocated vs split.

The same parts as ``simulator.FleetSimulator`` (each replica the real ``Scheduler`` with a
modelled step time, the router's real decision path), with roles and a KV transfer:

- **colocated** (``num_prefill == 0``): every replica takes whole requests;
- **disaggregated**: a request first runs on a prefill replica with ``max_tokens`` 1
  (chosen by the policy among the prefill replicas), then its prompt's full blocks travel
  to a decode replica chosen among the decode replicas (``TransferModel``: latency plus
  bytes over bandwidth, only the blocks the decode replica lacks, entered in its prefix
  cache as ``engine.kv_transfer``'s receiver does), and the request runs there whole,
  hitting them: it computes its last partial block and samples every output token. By
  default the client's first token is the decode replica's, so TTFT includes the transfer:
  pagoda's router protocol for a request that does not stream. A streaming request gets the
  prefill replica's first token early (``fleet/api/first_token.py``, as DistServe and
  TensorRT-LLM do); ``first_token_at_prefill=True`` models that.

Per request: TTFT (arrival to first token), TPOT (mean time between its later tokens) and
its longest inter-token gap (a stall: a prefill run in the same step as its decode).
``Slo`` says which requests are good; *attainment* is their share of the measured requests
and *goodput* the highest arrival rate with attainment >= 90% (DistServe's figure).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Optional

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.fleet.index.mirror import LocalIndex
from pagoda.fleet.routing.affinity import PendingIndex
from pagoda.fleet.routing.cost_model import TransferModel  # noqa: F401 - re-exported
from pagoda.fleet.routing.decide import confirms_pending, decide
from pagoda.fleet.routing.policy import Policy, ReplicaState, RoutingRequest
from pagoda.fleet.sim.simulator import (DEFAULT_STEP_MODEL, SIM_MODEL_ID, ReplicaConfig, SimReplica, SimRequest,
                                        StepTimeModel)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    max_itl_s: float = float("inf")  # the longest gap between two of the request's tokens (stalls)


@dataclass
class _Track:
    arrival: float
    max_tokens: int
    measured: bool
    first_token: Optional[float] = None
    finished: Optional[float] = None
    decode_id: Optional[str] = None
    last_token: Optional[float] = None
    max_itl: float = 0.0

    def token(self, now: float) -> None:
        if self.last_token is not None:
            self.max_itl = max(self.max_itl, now - self.last_token)
        self.last_token = now

    def good(self, slo: Slo) -> bool:
        if self.first_token is None or self.finished is None:
            return False
        tpot = (self.finished - self.first_token) / max(1, self.max_tokens - 1)
        return self.first_token - self.arrival <= slo.ttft_s and tpot <= slo.tpot_s and self.max_itl <= slo.max_itl_s


@dataclass
class DisaggResult:
    num_prefill: int
    num_decode: int
    tracks: list[_Track]

    def attainment(self, slo: Slo) -> float:
        measured = [t for t in self.tracks if t.measured]
        return sum(t.good(slo) for t in measured) / len(measured) if measured else 0.0


@dataclass
class DisaggSimulator:
    """``num_prefill`` prefill + ``num_decode`` decode replicas (``num_prefill`` 0: colocated)."""

    num_prefill: int
    num_decode: int
    policy: Policy
    step_model: StepTimeModel = DEFAULT_STEP_MODEL
    replica_config: ReplicaConfig = field(default_factory=ReplicaConfig)
    transfer: TransferModel = field(default_factory=TransferModel)
    heartbeat_interval_s: float = 1.0
    warmup_fraction: float = 0.2
    first_token_at_prefill: bool = False

    def run(self, workload: list[SimRequest]) -> DisaggResult:
        cfg = self.replica_config
        names = [f"p{i:02d}" for i in range(self.num_prefill)] + [f"d{i:02d}" for i in range(self.num_decode)]
        self._replicas = {name: SimReplica(name, cfg, self.step_model) for name in names}
        self._states = {name: ReplicaState(name) for name in names}
        self._index, self._now = LocalIndex(), [0.0]
        self._pending = PendingIndex(clock=lambda: self._now[0])
        self._heap, self._order = [], 0
        num_warmup = int(len(workload) * self.warmup_fraction)
        self._tracks = {r.request_id: _Track(r.arrival_time, r.max_tokens, i >= num_warmup)
                        for i, r in enumerate(workload)}
        self._requests = {r.request_id: r for r in workload}
        for request in workload:
            self._push(request.arrival_time, "arrival", request)
        self._push(0.0, "heartbeat", None)
        num_left = len(workload)
        while self._heap and num_left:
            now, _, kind, payload = heapq.heappop(self._heap)
            self._now[0] = now
            if kind == "heartbeat":
                self._heartbeat(now)
            elif kind == "arrival":
                stage = "p" if self.num_prefill else "d"
                self._admit(payload, stage, now)
            elif kind == "transferred":
                self._admit(payload, "d", now, transferred=True)
            else:
                num_left -= self._finish_step(payload, now)
        return DisaggResult(self.num_prefill, self.num_decode, list(self._tracks.values()))

    def _push(self, time: float, kind: str, payload) -> None:
        heapq.heappush(self._heap, (time, self._order, kind, payload))
        self._order += 1

    def _heartbeat(self, now: float) -> None:
        for name, replica in self._replicas.items():
            s = replica.scheduler
            state = self._states[name]
            state.waiting, state.running, state.kv_usage = s.num_waiting, s.num_running, s.kv_cache_usage
        self._push(now + self.heartbeat_interval_s, "heartbeat", None)

    def _admit(self, request: SimRequest, stage: str, now: float, transferred: bool = False) -> None:
        """Route ``request`` to a replica of ``stage`` ("p" or "d") and queue it there."""
        block_size = self.replica_config.block_size
        hashes = hash_prompt_blocks(request.token_ids, block_size, SIM_MODEL_ID)
        states = [s for name, s in self._states.items() if name.startswith(stage)]
        routing = RoutingRequest(request.request_id, [h.hex() for h in hashes], len(request.token_ids), block_size,
                                 self._index.match([h.hex() for h in hashes]) if self.policy.uses_exact else {})
        chosen = decide(self.policy, states, routing, self._pending)
        chosen.in_flight += 1
        replica = self._replicas[chosen.replica_id]
        if transferred:
            self._receive(replica, request, hashes)
        if stage == "p":
            request = replace(request, request_id=request.request_id + "/p", max_tokens=1)
        else:
            self._tracks[request.request_id].decode_id = chosen.replica_id
        replica.add(request, now)
        if replica.current is None:
            self._start(replica, now)

    def _receive(self, replica: SimReplica, request: SimRequest, hashes: list) -> None:
        """The decode replica enters the blocks it lacks in its prefix cache, as the connector's receiver."""
        pool = replica.scheduler.block_pool
        size = self.replica_config.block_size
        missing = [i for i, h in enumerate(hashes) if pool.get_cached_block(h) is None]
        if not missing or len(missing) > pool.num_free_blocks:
            return
        blocks = pool.get_new_blocks(len(missing))
        by_index = dict(zip(missing, blocks))
        run: list[int] = []
        for i in missing + [None]:
            if run and (i is None or i != run[-1] + 1):
                parent = hashes[run[0] - 1] if run[0] > 0 else None
                pool.cache_received_blocks([by_index[j] for j in run], [hashes[j] for j in run],
                                           [request.token_ids[j * size:(j + 1) * size] for j in run], parent)
                run = []
            if i is not None:
                run.append(i)
        pool.free_blocks(reversed(blocks))

    def _finish_step(self, replica: SimReplica, now: float) -> int:
        """Apply a finished step; returns how many requests ended for good."""
        done = 0
        for update in replica.finish_step():
            rid = update.request.request_id
            if rid.endswith("/p"):  # the prefill stage: its KV goes to a decode replica
                if update.finished:
                    self._states[replica.replica_id].in_flight -= 1
                    request = self._requests[rid[:-2]]
                    track = self._tracks[request.request_id]
                    if self.first_token_at_prefill and track.first_token is None:
                        track.first_token = now
                    blocks = len(request.token_ids) // self.replica_config.block_size
                    self._push(now + self.transfer.seconds(blocks), "transferred", request)
                continue
            track = self._tracks[rid]
            if update.new_token_ids:
                track.token(now)
                if track.first_token is None:
                    track.first_token = now
            if update.finished:
                track.finished = now
                self._states[replica.replica_id].in_flight -= 1
                done += 1
        events = replica.scheduler.take_events()
        self._index.apply(replica.replica_id, events)
        if confirms_pending(self.policy):
            self._pending.confirm(replica.replica_id, (e.event for e in events))
        self._start(replica, now)
        return done

    def _start(self, replica: SimReplica, now: float) -> None:
        if replica.current is None:
            duration = replica.start_step()
            if duration is not None:
                self._push(now + duration, "step", replica)


def goodput(attainments: dict[float, float], target: float = 0.9) -> float:
    """The highest rate whose attainment is >= ``target`` (0 when none is)."""
    good = [rate for rate, value in attainments.items() if value >= target]
    return max(good) if good else 0.0
