"""One autoscaler tick for one LLMService (mode Deployment): observe, decide, act.

Order of a tick:
  1. read the replica Deployment and its live pods (not terminating);
  2. read their loads from the FleetStore (Redis heartbeats, else /metrics);
  3. if a drain is in progress (status.drain), only advance it (drain.py): nothing else
     changes the fleet until that replica is gone;
  4. otherwise ask the policy (autoscaler.py): scale up at once by patching the
     Deployment, or start draining one replica for a scale-down; a drain only starts
     once the live pods match the Deployment's count (never pick a pod already going).
The tick returns a status patch and the events to post; the kopf timer applies them.
Scale targets are re-clamped to the current spec's [min, max] at every write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pagoda_operator import drain, naming
from pagoda_operator.autoscaler import AutoscalerPolicy, FleetLoad
from pagoda_operator.conditions import now_iso
from pagoda_operator.kube import KubeClient
from pagoda_operator.load import FleetStore
from pagoda_operator.spec import LLMService


@dataclass
class TickResult:
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)


def _observed(fleet: FleetLoad, source: str, now: float) -> dict[str, Any]:
    return {"source": source if fleet.num_replicas else "none",
            "numReplicas": fleet.num_replicas, "waiting": fleet.waiting,
            "running": fleet.running, "kvCacheUsage": round(fleet.kv_usage, 4),
            "ttftP90Seconds": round(fleet.ttft_p90, 4), "sampledAt": now_iso(now)}


async def _live_pods(kube: KubeClient, svc: LLMService) -> dict[str, str | None]:
    selector = naming.selector(svc, "replica")
    if svc.spec.disaggregation is not None:  # the decode pool's load sizes the decode pool
        selector[naming.POOL_LABEL] = "decode"
    pods = await kube.list("v1", "Pod", svc.namespace, naming.selector_string(selector))
    return {p["metadata"]["name"]: (p.get("status") or {}).get("podIP")
            for p in pods if not p["metadata"].get("deletionTimestamp")}


async def _scale(kube: KubeClient, svc: LLMService, replicas: int) -> None:
    await kube.patch("apps/v1", "Deployment", svc.namespace, naming.scaled_deployment_name(svc),
                     {"spec": {"replicas": replicas}})


def _decision(now: float, before: int, after: int, reason: str) -> dict[str, Any]:
    return {"time": now_iso(now), "from": before, "to": after, "reason": reason}


async def autoscale_tick(*, kube: KubeClient, fleet: FleetStore, policy: AutoscalerPolicy,
                         svc: LLMService, status: dict[str, Any],
                         clock: Callable[[], float]) -> TickResult:
    """Run one tick. Returns the status patch and events; raises KubeError on API errors."""
    result = TickResult()
    deployment = await kube.get("apps/v1", "Deployment", svc.namespace,
                                naming.scaled_deployment_name(svc))
    if deployment is None:
        return result  # not reconciled yet
    current = int(deployment["spec"].get("replicas", 0))
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    pods = await _live_pods(kube, svc)
    model = svc.spec.model.name
    loads = await fleet.read_loads(model, pods)
    now = clock()
    result.status = {"replicas": {"desired": current, "ready": ready},
                     "observedLoad": _observed(FleetLoad.of(loads.values()), fleet.source, now)}
    bounds = (svc.spec.min_replicas, svc.spec.max_replicas)

    state = drain.DrainState.from_status(status.get("drain"))
    if state is not None:
        why = drain.drain_progress(state, loads.get(state.replica_id),
                                   state.replica_id in pods, now,
                                   svc.spec.autoscaling.drain_timeout_seconds)
        if why is None:
            return result
        target = min(max(state.target_replicas, bounds[0]), bounds[1])
        if target < current:
            await _scale(kube, svc, target)
        await fleet.forget_replica(model, state.replica_id)
        reason = f"drained {state.replica_id} ({why})"
        result.status.update(drain=None, lastDecision=_decision(now, current, target, reason))
        result.status["replicas"]["desired"] = target
        result.events.append(("ScaledDown", f"{current} -> {target} replicas: {reason}"))
        return result

    if not svc.spec.autoscaling.enabled:
        return result
    policy.reconfigure(svc.spec.autoscaling, *bounds)
    decision = policy.decide(loads.values(), current)
    if decision.is_scale_up:
        await _scale(kube, svc, decision.desired)
        result.status["replicas"]["desired"] = decision.desired
        result.status["lastDecision"] = _decision(now, current, decision.desired, decision.reason)
        result.events.append(("ScaledUp", f"{current} -> {decision.desired} replicas: "
                                          f"{decision.reason}"))
    elif decision.is_scale_down:
        if pods and len(pods) != current:
            # The Deployment has not converged (a removed pod is still listed, or new ones
            # are starting): a victim picked now could be a pod that is already going.
            return result
        if not pods:  # nothing runs, so nothing to drain
            await _scale(kube, svc, decision.desired)
            result.status["replicas"]["desired"] = decision.desired
            result.status["lastDecision"] = _decision(now, current, decision.desired,
                                                      decision.reason)
            result.events.append(("ScaledDown", f"{current} -> {decision.desired} replicas: "
                                                f"{decision.reason}"))
            return result
        victim = drain.choose_victim(sorted(pods), loads)
        await kube.patch("v1", "Pod", svc.namespace, victim, {"metadata": {"annotations": {
            drain.DELETION_COST_ANNOTATION: drain.VICTIM_DELETION_COST}}})
        await fleet.mark_draining(model, victim)
        state = drain.DrainState(replica_id=victim, started_at=now,
                                 target_replicas=decision.desired)
        result.status["drain"] = state.to_status()
        result.events.append(("Draining", f"draining {victim} before {current} -> "
                                          f"{decision.desired} replicas: {decision.reason}"))
    return result
