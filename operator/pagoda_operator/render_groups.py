"""Render multi-node replicas as a LeaderWorkerSet (spec.parallelism.nodes > 1, mode Deployment).

One replica is one group of `nodes` pods (LWS `size`); the LeaderWorkerSet's `replicas` is
the replica count the autoscaler chooses, so it scales by whole groups. Per group:
- the leader pod (`<name>-group-<i>`, component `replica`): the replica pod of mode
  Deployment (render_replicas.py) — tritonserver, the engine, ranks 0..L-1 (L = tensor *
  pipeline / nodes; with pipeline > 1, whole stages: parallelism.py) — with
  `--nodes M --node-rank 0 --leader-address $(LWS_LEADER_ADDRESS):29500`; it opens the
  group's torch.distributed store on that port. It alone serves, heartbeats to Redis
  (its `PAGODA_REPLICA_ID` is its pod name) and is selected by the router, the headless
  Service and the autoscaler;
- worker pods (`<name>-group-<i>-<j>`, component `replica-worker`): `pagoda serve
  --node-rank $(LWS_WORKER_INDEX) ...` runs ranks j*L..(j+1)*L-1 and no server; they get
  no Redis settings (they never register) and no HTTP ports or probes.
LWS settings and why:
- `startupPolicy: LeaderCreated`: workers start with their leader. (LeaderReady would never
  start them: the leader turns ready only after every rank joined and loaded its shard.)
- `restartPolicy: RecreateGroupOnPodRestart`: a rank that dies takes the whole group down
  and back, since an engine cannot lose a rank and keep serving.
- so a group is ready exactly when its leader is: the LWS counts a group in
  `readyReplicas` when all its pods are ready, and the leader's readiness already waits
  for its workers.
Scale-in removes the highest-numbered groups (the leaders form a StatefulSet), so the
autoscaler drains the last group's leader (pools.py, scaling.py), not the least loaded.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator import naming, parallelism, render_security
from pagoda_operator.render_replicas import (dshm_volume, engine_args, model_path, model_volume,
                                             render_pod_template)
from pagoda_operator.spec import LLMService

COMPONENT = "replica"
KIND = "LeaderWorkerSet"


def render_worker_container(svc: LLMService, model_dir: str | None = None) -> dict[str, Any]:
    """A worker pod's container: its ranks of the replica's engine, nothing else.

    Args:
        model_dir: where the model is in the pod (default: as in mode Deployment).
    """
    _, mounts = model_volume(svc)
    _, writable_mounts = render_security.writable_volumes()
    where = model_dir or model_path(svc)
    return {
        "name": "pagoda",
        "image": svc.spec.image,
        "imagePullPolicy": svc.spec.image_pull_policy,
        "command": ["pagoda", "serve"],
        "args": ["--model", where, *engine_args(svc.spec.engine),
                 *parallelism.serve_args(svc.spec.parallelism, node_rank="$(LWS_WORKER_INDEX)")],
        "env": render_security.writable_env(),
        "resources": parallelism.pod_resources(svc.spec.resources, svc.spec.parallelism),
        "volumeMounts": [*mounts, *writable_mounts, {"name": "dshm", "mountPath": "/dev/shm"}],
        "securityContext": render_security.container_security_context(),
    }


def render_worker_pod_spec(svc: LLMService) -> dict[str, Any]:
    volumes, _ = model_volume(svc)
    writable, _ = render_security.writable_volumes()
    return {
        "securityContext": render_security.pod_security_context(),
        "containers": [render_worker_container(svc)],
        "volumes": [*volumes, *writable, dshm_volume()],
        "terminationGracePeriodSeconds": svc.spec.termination_grace_period_seconds,
    }


def store_port() -> dict[str, Any]:
    """The leader container's port of the group's torch.distributed store."""
    return {"name": "tp-store", "containerPort": parallelism.STORE_PORT, "protocol": "TCP"}


def render_replica_group_set(svc: LLMService, groups: int) -> dict[str, Any]:
    """The leaderworkerset.x-k8s.io/v1 LeaderWorkerSet of `svc`'s replicas.

    Args:
        groups: replica groups (the autoscaler's decision, already within [min, max]).
    """
    assert svc.spec.parallelism is not None and svc.spec.parallelism.is_multi_node, "spec.py routes only these here"
    leader = render_pod_template(svc)
    leader["spec"]["containers"][0]["ports"].append(store_port())
    return {
        "apiVersion": naming.LWS_API_VERSION,
        "kind": KIND,
        "metadata": naming.metadata(svc, naming.group_set_name(svc), COMPONENT),
        "spec": {
            "replicas": groups,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": svc.spec.parallelism.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": {"metadata": {"labels": naming.labels(svc, naming.WORKER_COMPONENT)},
                                   "spec": render_worker_pod_spec(svc)},
            },
        },
    }


def group_members_selector(svc: LLMService) -> dict[str, Any]:
    """Every pod of every group (leaders and workers) as a label selector."""
    return {"matchLabels": {naming.LABEL_SERVICE: svc.name},
            "matchExpressions": [{"key": naming.LABEL_COMPONENT, "operator": "In",
                                  "values": [COMPONENT, naming.WORKER_COMPONENT]}]}
