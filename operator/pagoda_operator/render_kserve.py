"""Render a KServe InferenceService for `mode: KServe`.

KServe then owns the replica pods: its storage initializer fetches
`spec.model.storageUri` into /mnt/models and the chart's ServingRuntime (`pagoda`,
model format `pagoda`) runs `pagoda serve` over it. We ask for a raw Deployment
(annotation `serving.kserve.io/deploymentMode: RawDeployment`, no Knative) and pass
replica bounds as minReplicas/maxReplicas; KServe's own HPA scales within them, so the
built-in autoscaler does not run in this mode. The router (render_router.py) still
fronts the pods, selected by KServe's inferenceservice label. `spec.parallelism` (one node
only here) adds `--tensor-parallel-size`, `--pipeline-parallel-size` past one stage, and the
pod's `nvidia.com/gpu` limit (tensor * pipeline).
"""

from __future__ import annotations

from typing import Any

from pagoda_operator import naming, parallelism
from pagoda_operator.render_redis import redis_env, redis_url_arg
from pagoda_operator.render_replicas import engine_args, kv_events_args, lora_args
from pagoda_operator.spec import LLMService

COMPONENT = "replica"
MODEL_FORMAT = "pagoda"


def render_inference_service(svc: LLMService) -> dict[str, Any]:
    """The serving.kserve.io/v1beta1 InferenceService for `svc`."""
    meta = naming.metadata(svc, svc.name, COMPONENT)
    meta["annotations"] = {"serving.kserve.io/deploymentMode": "RawDeployment"}
    model: dict[str, Any] = {
        "modelFormat": {"name": MODEL_FORMAT},
        "runtime": svc.spec.kserve_runtime,
        "storageUri": svc.spec.model.storage_uri,
        "args": (engine_args(svc.spec.engine) + parallelism.serve_args(svc.spec.parallelism)
                 + lora_args(svc, naming.MODEL_MOUNT) + kv_events_args(svc)),
        "env": [
            {"name": "PAGODA_REPLICA_ID",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PAGODA_MODEL_NAME", "value": svc.spec.model.name},
            *redis_env(svc),
            {"name": "PAGODA_REDIS_URL", "value": redis_url_arg(svc)},
            *([{"name": "PAGODA_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
              if svc.spec.kv_events else []),
        ],
    }
    resources = parallelism.pod_resources(svc.spec.resources, svc.spec.parallelism)  # one node: spec.py
    if resources:
        model["resources"] = resources
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": meta,
        "spec": {
            "predictor": {
                "minReplicas": svc.spec.min_replicas,
                "maxReplicas": svc.spec.max_replicas,
                "model": model,
            },
        },
    }
