"""Scale-in drain: which replica goes, and when it may be removed. Pure functions.

A scale-in never just lowers `spec.replicas` (the Deployment controller would kill a
random pod with requests in flight). Instead (for multi-node replica groups the victim is
the last group's leader, `last_group_leader`, and no deletion cost is set: a
LeaderWorkerSet always removes its highest-numbered groups):
  1. start: pick the victim (`choose_victim`), give its pod the lowest
     `controller.kubernetes.io/pod-deletion-cost` (so the ReplicaSet deletes exactly
     it), set its drain flag in Redis (routers stop sending to it), and record
     `status.drain` = {replicaId, startedAt, targetReplicas} (survives operator restarts);
  2. wait: each tick, `drain_progress` says whether it is done: the victim reports no
     running and no waiting requests, its pod is gone, or `drainTimeoutSeconds` passed;
  3. finish: scale the Deployment to `targetReplicas`, then remove the replica from the
     registry and the prefix index, and clear `status.drain`.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from pagoda_operator.load import ReplicaLoad

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_DELETION_COST = "-1000000"


@dataclass(frozen=True)
class DrainState:
    replica_id: str
    started_at: float  # unix seconds
    target_replicas: int

    def to_status(self) -> dict[str, Any]:
        started = dt.datetime.fromtimestamp(self.started_at, dt.timezone.utc)
        return {"replicaId": self.replica_id,
                "startedAt": started.isoformat().replace("+00:00", "Z"),
                "targetReplicas": self.target_replicas}

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> "DrainState | None":
        if not status or not status.get("replicaId"):
            return None
        started = dt.datetime.fromisoformat(status["startedAt"].replace("Z", "+00:00"))
        return cls(replica_id=status["replicaId"], started_at=started.timestamp(),
                   target_replicas=int(status["targetReplicas"]))


def choose_victim(pods: list[str], loads: dict[str, ReplicaLoad]) -> str:
    """The replica that is cheapest to drain: fewest running, then waiting requests, then
    lowest KV usage (least cached prefix lost). Pods without a report go first (they
    are likely not serving). Ties break on the name, so the choice is deterministic.

    Args:
        pods: candidate pod names (non-empty).
        loads: their fresh load samples, by pod name.
    """
    assert pods, "a scale-in needs at least one pod"

    def cost(name: str) -> tuple:
        load = loads.get(name)
        if load is None:
            return (0, 0.0, 0.0, 0.0, name)
        return (1, load.running, load.waiting, load.kv_usage, name)

    return min(pods, key=cost)


def last_group_leader(group_set: str, groups: int) -> str:
    """The leader pod of the group a LeaderWorkerSet removes when it shrinks from `groups`: its
    leaders are a StatefulSet `group_set`, which deletes the highest ordinal first."""
    assert groups >= 1, "a scale-in needs at least one group"
    return f"{group_set}-{groups - 1}"


def drain_progress(state: DrainState, load: ReplicaLoad | None, pod_exists: bool,
                   now: float, timeout_s: float) -> str | None:
    """Whether the drain is finished.

    Returns:
        None while it must keep waiting; otherwise why it is finished: "idle" (nothing in
        flight), "gone" (the pod no longer exists) or "timeout".
    """
    if not pod_exists:
        return "gone"
    if load is not None and load.running <= 0 and load.waiting <= 0:
        return "idle"
    if now - state.started_at >= timeout_s:
        return "timeout"
    return None
