"""Names and labels of everything the operator creates for one LLMService.

One place decides them, so renderers, handlers, the autoscaler and the tests agree.
For an LLMService `x`: replicas run in Deployment `x-replicas` behind headless Service
`x-replicas`; the router runs in Deployment `x-router` behind Service `x` (the name
clients use); the router's ServiceAccount/Role/RoleBinding are `x-router`; in mode
KServe the InferenceService is `x`. With `spec.parallelism.nodes > 1` the replicas are the
groups of LeaderWorkerSet `x-group` (LWS makes a headless Service of the same name, so it
must not be `x-replicas`, ours); leader pods keep the `replica` component and worker pods
get `replica-worker`, so the router, the Service and the autoscaler see only leaders.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator import crd
from pagoda_operator.spec import LLMService

HTTP_PORT = 8000
GRPC_PORT = 8001
METRICS_PORT = 8002
OPENAI_PORT = 9000  # pagoda serve's own OpenAI door (--openai-port)
ROUTER_HTTP_PORT = 8080
ROUTER_GRPC_PORT = 8081
MODEL_MOUNT = "/mnt/models"
LABEL_SERVICE = "pagoda.dev/llmservice"
LABEL_COMPONENT = "app.kubernetes.io/component"
KSERVE_ISVC_LABEL = "serving.kserve.io/inferenceservice"
# On replica pods, for llm-d / GIE endpoint pickers: the engine type selects which metric
# names the picker reads (pagoda exports vLLM's), inferenceServing is llm-d's pool label.
LLM_D_LABELS = {"llm-d.ai/engine-type": "vllm", "llm-d.ai/inferenceServing": "true"}


def replicas_name(svc: LLMService) -> str:
    return f"{svc.name}-replicas"


WORKER_COMPONENT = "replica-worker"  # the non-leader pods of a multi-node replica group
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def group_set_name(svc: LLMService) -> str:
    """The LeaderWorkerSet of multi-node replicas (spec.parallelism.nodes > 1)."""
    return f"{svc.name}-group"


POOL_LABEL = "pagoda.dev/pool"  # disaggregated serving: prefill | decode (spec.disaggregation)


def pool_name(svc: LLMService, pool: str) -> str:
    """The Deployment of a disaggregated pool (``prefill`` or ``decode``)."""
    return f"{svc.name}-{pool}"


def router_name(svc: LLMService) -> str:
    return f"{svc.name}-router"


def router_service_name(svc: LLMService) -> str:
    return svc.name


def labels(svc: LLMService, component: str) -> dict[str, str]:
    """Labels on every child object and pod."""
    return {
        "app.kubernetes.io/name": "pagoda",
        "app.kubernetes.io/instance": svc.name,
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": "pagoda-operator",
        LABEL_SERVICE: svc.name,
    }


def selector(svc: LLMService, component: str) -> dict[str, str]:
    """The immutable subset of `labels` used in Deployment/Service selectors."""
    return {LABEL_SERVICE: svc.name, LABEL_COMPONENT: component}


def selector_string(match: dict[str, str]) -> str:
    """`{"a": "b", "c": "d"}` -> `a=b,c=d` (kubectl / label-selector syntax)."""
    return ",".join(f"{key}={value}" for key, value in sorted(match.items()))


def owner_references(svc: LLMService) -> list[dict[str, Any]]:
    """Owner reference making `svc` the controller of a child (garbage-collected with it)."""
    if not svc.uid:
        return []
    return [{
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "name": svc.name,
        "uid": svc.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }]


def metadata(svc: LLMService, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": svc.namespace,
        "labels": labels(svc, component),
    }
    owners = owner_references(svc)
    if owners:
        meta["ownerReferences"] = owners
    return meta
