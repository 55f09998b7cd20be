"""Reconcile one LLMService: render its children and apply them (create/update/resume).

Idempotent: every child is rendered from the spec and `KubeClient.apply`d, which only
writes when the live object differs. Each scaled workload (the replicas' Deployment, their
LeaderWorkerSet with `spec.parallelism.nodes > 1` (render_groups.py), or with
`spec.disaggregation` the decode and the prefill pool: pools.py) keeps its live replica
count (its autoscaler owns it) clamped into its pool's [min, max]. Children of the other mode are deleted
when the mode changes (Deployment, KServe, KServeLLM). All children carry an owner reference to
the LLMService, so Kubernetes garbage-collects them when it is deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda_operator import naming
from pagoda_operator.kube import KubeClient, KubeError
from pagoda_operator.pools import rendered_replicas, scaled_pools
from pagoda_operator.render_groups import render_replica_group_set
from pagoda_operator.render_kserve import render_inference_service
from pagoda_operator.render_llmisvc import API_VERSION as LLMISVC_API_VERSION
from pagoda_operator.render_llmisvc import KIND as LLMISVC_KIND
from pagoda_operator.render_llmisvc import render_llm_inference_service
from pagoda_operator.render_policies import render_replica_network_policy, render_replica_pdb
from pagoda_operator.render_replicas import render_replica_deployment, render_replica_service
from pagoda_operator.render_router import (render_router_deployment, render_router_role,
                                           render_router_role_binding, render_router_service,
                                           render_router_service_account)
from pagoda_operator.spec import LLMService


@dataclass(frozen=True)
class ReconcileResult:
    actions: dict[str, str]  # "Kind/name" -> created | patched | unchanged | deleted
    desired_replicas: int
    ready_replicas: int | None
    prefill: dict[str, int] | None = None  # spec.disaggregation: the prefill pool's {desired[, ready]}


def render_children(svc: LLMService, replicas: int, prefill_replicas: int | None = None) -> list[dict[str, Any]]:
    """Everything the operator owns for `svc`, in apply order (RBAC before workloads).

    Args:
        replicas: pods of the replica (or decode) Deployment.
        prefill_replicas: pods of the prefill pool (spec.disaggregation); None: its minimum.
    """
    router = [render_router_service_account(svc), render_router_role(svc),
              render_router_role_binding(svc), render_router_deployment(svc),
              render_router_service(svc)]
    if svc.spec.mode == "KServe":
        return [render_inference_service(svc), *router]
    if svc.spec.mode == "KServeLLM":
        return [render_llm_inference_service(svc), *([] if svc.spec.kserve_scheduler == "llm-d" else router)]
    if svc.spec.parallelism is not None and svc.spec.parallelism.is_multi_node:
        pools = [render_replica_group_set(svc, replicas)]
    elif svc.spec.disaggregation is not None:
        prefill = svc.spec.disaggregation.prefill_min_replicas if prefill_replicas is None else prefill_replicas
        pools = [render_replica_deployment(svc, replicas, "decode"),
                 render_replica_deployment(svc, prefill, "prefill")]
    else:
        pools = [render_replica_deployment(svc, replicas)]
    return [*pools, render_replica_service(svc), render_replica_network_policy(svc), render_replica_pdb(svc), *router]


def stale_children(svc: LLMService) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the other modes' children."""
    deployment = [("apps/v1", "Deployment", naming.replicas_name(svc)),
                  ("v1", "Service", naming.replicas_name(svc)),
                  ("networking.k8s.io/v1", "NetworkPolicy", naming.replicas_name(svc)),
                  ("policy/v1", "PodDisruptionBudget", naming.replicas_name(svc))]
    isvc = [("serving.kserve.io/v1beta1", "InferenceService", svc.name)]
    llmisvc = [(LLMISVC_API_VERSION, LLMISVC_KIND, svc.name)]
    if svc.spec.mode == "KServeLLM" and svc.spec.kserve_scheduler == "llm-d":  # KServe's picker replaces our router
        router = [("v1", "ServiceAccount", naming.router_name(svc)),
                  ("rbac.authorization.k8s.io/v1", "Role", naming.router_name(svc)),
                  ("rbac.authorization.k8s.io/v1", "RoleBinding", naming.router_name(svc)),
                  ("apps/v1", "Deployment", naming.router_name(svc)),
                  ("v1", "Service", naming.router_service_name(svc))]
        return deployment + isvc + router
    pools = [("apps/v1", "Deployment", naming.pool_name(svc, pool)) for pool in ("prefill", "decode")]
    groups = [(naming.LWS_API_VERSION, "LeaderWorkerSet", naming.group_set_name(svc))]
    if svc.spec.mode == "Deployment":  # all but one shape of replica workloads are stale
        mixed = [("apps/v1", "Deployment", naming.replicas_name(svc))]
        if svc.spec.parallelism is not None and svc.spec.parallelism.is_multi_node:
            return isvc + llmisvc + mixed + pools
        return isvc + llmisvc + groups + (mixed if svc.spec.disaggregation is not None else pools)
    return {"KServe": deployment + llmisvc + pools + groups,
            "KServeLLM": deployment + isvc + pools + groups}[svc.spec.mode]


async def _live_counts(kube: KubeClient, svc: LLMService) -> list[tuple[int, int | None]]:
    """(replicas to render, ready pods or None) per scaled pool (pools.py order); mode Deployment."""
    counts = []
    for pool in scaled_pools(svc):
        live = await kube.get(pool.api_version, pool.kind, svc.namespace, pool.deployment)
        replicas = rendered_replicas(pool, (live or {}).get("spec", {}).get("replicas"))
        ready = None if live is None else int((live.get("status") or {}).get("readyReplicas") or 0)
        counts.append((replicas, ready))
    return counts


async def reconcile(kube: KubeClient, svc: LLMService) -> ReconcileResult:
    """Apply all children of `svc`. Raises KubeError on API failures (kopf retries)."""
    actions: dict[str, str] = {}
    counts = await _live_counts(kube, svc) if svc.spec.mode == "Deployment" else [(svc.spec.min_replicas, None)]
    (replicas, ready), prefill = counts[0], (counts[1] if len(counts) > 1 else None)
    for child in render_children(svc, replicas, prefill[0] if prefill else None):
        actions[f"{child['kind']}/{child['metadata']['name']}"] = await kube.apply(child)
    for api_version, kind, name in stale_children(svc):
        if kind in ("Deployment", "LeaderWorkerSet") and await kube.get(api_version, kind, svc.namespace, name) is None:
            continue  # the usual case: read, not a DELETE on every reconcile (a restart writes nothing)
        try:
            if await kube.delete(api_version, kind, svc.namespace, name):
                actions[f"{kind}/{name}"] = "deleted"
        except KubeError as error:
            if error.status not in (404, 405):  # 404: KServe's CRD is not even installed
                raise
    prefill_status = None
    if prefill is not None:
        prefill_status = {"desired": prefill[0]} | ({"ready": prefill[1]} if prefill[1] is not None else {})
    return ReconcileResult(actions=actions, desired_replicas=replicas, ready_replicas=ready, prefill=prefill_status)
