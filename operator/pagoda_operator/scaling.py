"""One autoscaler tick for one LLMService (mode Deployment): observe, decide, act, per pool.

The pools are those of pools.py: the replica Deployment, or with `spec.disaggregation` the
decode and the prefill pool, each with its own policy, status part and drain; with
`spec.parallelism.nodes > 1` the replicas' LeaderWorkerSet, whose replicas and ready count
are whole groups and whose pods here are the groups' leaders. For each pool:
  1. read its Deployment (or LeaderWorkerSet) and its live pods (its selector; not terminating);
  2. read their loads from the FleetStore (Redis heartbeats, else /metrics; with an ITL
     SLO, the inter-token latency histogram from /metrics too);
  3. if a drain is in progress (the pool's `drain` status), only advance it (drain.py):
     nothing else changes that pool until that replica is gone;
  4. otherwise ask the pool's policy (autoscaler.py): scale up at once by patching the
     Deployment, or start draining one replica for a scale-down; a drain only starts
     once the live pods match the Deployment's count (never pick a pod already going).
     The victim is the least loaded pod, or for groups the last group's leader (drain.py).
The tick returns a status patch and the events to post; the kopf timer applies them.
Scale targets are re-clamped to the pool's current [min, max] at every write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pagoda_operator import drain, naming
from pagoda_operator.autoscaler import AutoscalerPolicy, FleetLoad
from pagoda_operator.conditions import now_iso
from pagoda_operator.kube import KubeClient
from pagoda_operator.load import FleetStore
from pagoda_operator.metrics import PoolReport
from pagoda_operator.pools import Pool, scaled_pools
from pagoda_operator.spec import LLMService


@dataclass
class TickResult:
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)
    reports: list[PoolReport] = field(default_factory=list)  # per pool, for the operator's /metrics


def _observed(fleet: FleetLoad, source: str, now: float) -> dict[str, Any]:
    return {"source": source if fleet.num_replicas else "none",
            "numReplicas": fleet.num_replicas, "waiting": fleet.waiting,
            "running": fleet.running, "kvCacheUsage": round(fleet.kv_usage, 4),
            "ttftP90Seconds": round(fleet.ttft_p90, 4), "itlP90Seconds": round(fleet.itl_p90, 4),
            "sampledAt": now_iso(now)}


async def _live_pods(kube: KubeClient, svc: LLMService, pool: Pool) -> dict[str, str | None]:
    pods = await kube.list("v1", "Pod", svc.namespace, naming.selector_string(pool.selector))
    return {p["metadata"]["name"]: (p.get("status") or {}).get("podIP")
            for p in pods if not p["metadata"].get("deletionTimestamp")}


def _decision(now: float, before: int, after: int, reason: str) -> dict[str, Any]:
    return {"time": now_iso(now), "from": before, "to": after, "reason": reason}


class _PoolTick:
    """One pool's part of a tick: what it observed, and the status/events it produces."""

    def __init__(self, kube: KubeClient, fleet: FleetStore, svc: LLMService, pool: Pool,
                 clock: Callable[[], float]):
        self.kube, self.fleet, self.svc, self.pool, self.clock = kube, fleet, svc, pool, clock
        self.status: dict[str, Any] = {}
        self.events: list[tuple[str, str]] = []

    async def _scale(self, replicas: int) -> None:
        await self.kube.patch(self.pool.api_version, self.pool.kind, self.svc.namespace, self.pool.deployment,
                              {"spec": {"replicas": replicas}})

    def _record(self, reason: str, now: float, before: int, after: int, why: str, message: str) -> None:
        self.status["replicas"]["desired"] = after
        self.status["lastDecision"] = _decision(now, before, after, why)
        self.events.append((reason, self.pool.event_prefix + message))

    async def run(self, policy: AutoscalerPolicy, pool_status: dict[str, Any]) -> None:
        deployment = await self.kube.get(self.pool.api_version, self.pool.kind, self.svc.namespace,
                                         self.pool.deployment)
        if deployment is None:
            return  # not reconciled yet
        current = int(deployment["spec"].get("replicas", 0))
        ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
        pods = await _live_pods(self.kube, self.svc, self.pool)
        model = self.svc.spec.model.name
        loads = await self.fleet.read_loads(model, pods, need_itl=self.pool.autoscaling.itl_slo_seconds > 0)
        now = self.clock()
        self.status = {"replicas": {"desired": current, "ready": ready},
                       "observedLoad": _observed(FleetLoad.of(loads.values()), self.fleet.source, now)}
        state = drain.DrainState.from_status(pool_status.get("drain"))
        if state is not None:
            await self._advance_drain(state, loads, pods, current, now)
        elif self.pool.autoscaling.enabled:
            policy.reconfigure(self.pool.autoscaling, self.pool.min_replicas, self.pool.max_replicas)
            await self._decide(policy, loads, pods, current, now)

    async def _advance_drain(self, state: drain.DrainState, loads, pods, current: int, now: float) -> None:
        why = drain.drain_progress(state, loads.get(state.replica_id), state.replica_id in pods, now,
                                   self.pool.autoscaling.drain_timeout_seconds)
        if why is None:
            return
        target = self.pool.clamp(state.target_replicas)
        if target < current:
            await self._scale(target)
        await self.fleet.forget_replica(self.svc.spec.model.name, state.replica_id)
        reason = f"drained {state.replica_id} ({why})"
        self.status["drain"] = None
        self._record("ScaledDown", now, current, target, reason, f"{current} -> {target} replicas: {reason}")

    async def _decide(self, policy: AutoscalerPolicy, loads, pods, current: int, now: float) -> None:
        decision = policy.decide(loads.values(), current)
        message = f"{current} -> {decision.desired} replicas: {decision.reason}"
        if decision.is_scale_up:
            await self._scale(decision.desired)
            self._record("ScaledUp", now, current, decision.desired, decision.reason, message)
        elif decision.is_scale_down:
            if pods and len(pods) != current:
                # The Deployment has not converged (a removed pod is still listed, or new ones
                # are starting): a victim picked now could be a pod that is already going.
                return
            if not pods:  # nothing runs, so nothing to drain
                await self._scale(decision.desired)
                self._record("ScaledDown", now, current, decision.desired, decision.reason, message)
                return
            if self.pool.is_group_set:  # the LWS removes the last group: drain its leader
                victim = drain.last_group_leader(self.pool.deployment, current)
            else:
                victim = drain.choose_victim(sorted(pods), loads)
                await self.kube.patch("v1", "Pod", self.svc.namespace, victim, {"metadata": {"annotations": {
                    drain.DELETION_COST_ANNOTATION: drain.VICTIM_DELETION_COST}}})
            await self.fleet.mark_draining(self.svc.spec.model.name, victim)
            state = drain.DrainState(replica_id=victim, started_at=now, target_replicas=decision.desired)
            self.status["drain"] = state.to_status()
            self.events.append(("Draining", f"{self.pool.event_prefix}draining {victim} before {message}"))


def _report(pool: Pool, tick: _PoolTick, pool_status: dict[str, Any]) -> PoolReport:
    """What the tick did to the pool; a drain goes on until a tick writes ``drain: None``."""
    replicas = tick.status.get("replicas") or {}
    drain_status = tick.status["drain"] if "drain" in tick.status else pool_status.get("drain")
    return PoolReport(pool.role, replicas.get("desired"), replicas.get("ready"), bool(drain_status),
                      [reason for reason, _ in tick.events])


async def autoscale_tick(*, kube: KubeClient, fleet: FleetStore, policies: dict[str, AutoscalerPolicy],
                         svc: LLMService, status: dict[str, Any],
                         clock: Callable[[], float]) -> TickResult:
    """Run one tick over every pool of `svc`.

    Args:
        policies: the LLMService's policies by pool role (pools.Pool.role); a missing one is made.
        status: the LLMService's current status (each pool reads its drain state from its part).
    Returns:
        The status patch (a pool with `status_key` under that key) and the events to post.
    Raises:
        KubeError on API errors.
    """
    result = TickResult()
    for pool in scaled_pools(svc):
        policy = policies.get(pool.role)
        if policy is None:
            policy = policies[pool.role] = AutoscalerPolicy(pool.autoscaling, pool.min_replicas,
                                                            pool.max_replicas, clock=clock)
        tick = _PoolTick(kube, fleet, svc, pool, clock)
        await tick.run(policy, pool.get_status(status))
        result.reports.append(_report(pool, tick, pool.get_status(status)))
        if tick.status:
            if pool.status_key:
                result.status[pool.status_key] = tick.status
            else:
                result.status.update(tick.status)
        result.events += tick.events
    if svc.spec.disaggregation is None and status.get("prefill"):
        result.status["prefill"] = None  # the prefill pool is gone with spec.disaggregation
    return result
