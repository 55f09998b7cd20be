"""The replica pools the autoscaler sizes for one LLMService (mode Deployment). Pure.

Without `spec.disaggregation` there is one pool, the `<name>-replicas` Deployment, sized by
`spec.replicas` and `spec.autoscaling`; its state is the status' top-level `replicas`,
`observedLoad`, `lastDecision` and `drain`.

With it there are two, each with its own bounds, policy (and recommendation history),
drain bookkeeping and status, so a drain in one pool never holds the other back:
- `decode`: `<name>-decode`, sized by `spec.replicas` / `spec.autoscaling` (waiting, KV
  usage, TTFT, and inter-token latency when `itlSLOSeconds` is set); the same top-level
  status fields as before;
- `prefill`: `<name>-prefill`, sized by `spec.disaggregation.prefill` (waiting and TTFT;
  no KV target); its state is `status.prefill.{replicas,observedLoad,lastDecision,drain}`.
Each pool's pods are those of its Deployment's selector (the `pagoda.dev/pool` label).

With `spec.parallelism.nodes > 1` the one pool is LeaderWorkerSet `<name>-group`: its
`replicas` are whole groups, its pods are the groups' leaders (one per group: the worker
pods carry another component label), and a scale-in must drain the last group (its leaders
form a StatefulSet, which removes the highest ordinal; pod-deletion-cost does not apply).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda_operator import naming
from pagoda_operator.spec import AutoscalingSpec, LLMService

COMPONENT = "replica"


@dataclass(frozen=True)
class Pool:
    """One scaled Deployment and how to size it."""

    role: str  # "replicas" (not disaggregated), "decode" or "prefill": also the policy's key
    deployment: str  # the scaled object's name: a Deployment, or a LeaderWorkerSet (kind)
    selector: dict[str, str]  # its pods
    autoscaling: AutoscalingSpec
    min_replicas: int
    max_replicas: int
    status_key: str | None  # None: the status' top-level fields; else status[status_key]
    api_version: str = "apps/v1"
    kind: str = "Deployment"

    @property
    def is_group_set(self) -> bool:
        """Multi-node groups: scale-in removes the last group (StatefulSet order)."""
        return self.kind == "LeaderWorkerSet"

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)

    def get_status(self, status: dict[str, Any]) -> dict[str, Any]:
        """This pool's part of an LLMService status."""
        return dict(status.get(self.status_key) or {}) if self.status_key else dict(status)

    @property
    def event_prefix(self) -> str:
        return "" if self.role == "replicas" else f"{self.role} pool: "


def scaled_pools(svc: LLMService) -> list[Pool]:
    """The pools of `svc` in tick order (module docstring)."""
    base = naming.selector(svc, COMPONENT)
    disaggregation = svc.spec.disaggregation
    if svc.spec.parallelism is not None and svc.spec.parallelism.is_multi_node:  # spec.py: no disaggregation
        return [Pool("replicas", naming.group_set_name(svc), base, svc.spec.autoscaling, svc.spec.min_replicas,
                     svc.spec.max_replicas, None, naming.LWS_API_VERSION, "LeaderWorkerSet")]
    if disaggregation is None:
        return [Pool("replicas", naming.replicas_name(svc), base, svc.spec.autoscaling,
                     svc.spec.min_replicas, svc.spec.max_replicas, None)]
    return [Pool("decode", naming.pool_name(svc, "decode"), base | {naming.POOL_LABEL: "decode"},
                 svc.spec.autoscaling, svc.spec.min_replicas, svc.spec.max_replicas, None),
            Pool("prefill", naming.pool_name(svc, "prefill"), base | {naming.POOL_LABEL: "prefill"},
                 disaggregation.prefill_autoscaling, disaggregation.prefill_min_replicas,
                 disaggregation.prefill_max_replicas, "prefill")]


def rendered_replicas(pool: Pool, live_replicas: int | None) -> int:
    """Pod count to render for `pool`: the live count (its autoscaler's) within [min, max];
    `min` for a new Deployment or when its autoscaling is off."""
    if live_replicas is None or not pool.autoscaling.enabled:
        return pool.min_replicas
    return pool.clamp(live_replicas)
