"""Render the replicas' NetworkPolicy and PodDisruptionBudget (mode Deployment).

NetworkPolicy: replica pods accept inference traffic (HTTP 8000, gRPC 8001) only from
this LLMService's router pods; the metrics port (8002) stays open for Prometheus and the
operator's scrape fallback. Kubelet probes are not subject to NetworkPolicy. In mode
KServe the pods are KServe's, so no policy is rendered for them.

PodDisruptionBudget: at most one replica may be evicted at a time (node drains, cluster
upgrades); `maxUnavailable` rather than `minAvailable`, so a single-replica service still
lets a node drain instead of blocking it forever.

Multi-node replicas (spec.parallelism.nodes > 1, render_groups.py): both cover every pod of
every group, leaders and workers; the policy also admits the group's pods to each other on
every port (the torch.distributed store, then gloo's or NCCL's own connections, whose ports
are not fixed), and the budget's one unavailable pod takes its whole group down.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator import naming
from pagoda_operator.render_groups import group_members_selector
from pagoda_operator.spec import LLMService

COMPONENT = "replica"


def render_replica_network_policy(svc: LLMService) -> dict[str, Any]:
    """The networking.k8s.io/v1 NetworkPolicy in front of the replica pods."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.metadata(svc, naming.replicas_name(svc), COMPONENT),
        "spec": {
            "podSelector": _pods(svc),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": naming.selector(svc, "router")}}],
                 "ports": [{"protocol": "TCP", "port": naming.HTTP_PORT},
                           {"protocol": "TCP", "port": naming.GRPC_PORT}]},
                {"ports": [{"protocol": "TCP", "port": naming.METRICS_PORT}]},
                *([{"from": [{"podSelector": {"matchLabels": naming.selector(svc, COMPONENT)}}],
                    "ports": [{"protocol": "TCP", "port": svc.spec.disaggregation.kv_transfer_port}]}]
                  if svc.spec.disaggregation is not None else []),  # decode pods pull from prefill pods
                *([{"from": [{"podSelector": _pods(svc)}]}] if _is_multi_node(svc) else []),  # a group's ranks
            ],
        },
    }


def render_replica_pdb(svc: LLMService) -> dict[str, Any]:
    """The policy/v1 PodDisruptionBudget of the replica pods."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": naming.metadata(svc, naming.replicas_name(svc), COMPONENT),
        "spec": {
            "maxUnavailable": 1,
            "selector": _pods(svc),
        },
    }


def _is_multi_node(svc: LLMService) -> bool:
    return svc.spec.parallelism is not None and svc.spec.parallelism.is_multi_node


def _pods(svc: LLMService) -> dict[str, Any]:
    """The replica pods: with several nodes per replica, every pod of every group."""
    return group_members_selector(svc) if _is_multi_node(svc) else {"matchLabels": naming.selector(svc, COMPONENT)}
