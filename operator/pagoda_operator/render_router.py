"""Render the cache-aware router: Deployment, Service, and the RBAC its discovery needs.

The router finds replicas with `--k8s-selector` (it lists/watches pods matching the
replicas' labels in its own namespace), so it gets a ServiceAccount bound to a Role
that may only get/list/watch pods. In mode KServe it selects the InferenceService's
pods by KServe's `serving.kserve.io/inferenceservice` label instead; in mode KServeLLM the
LLMInferenceService's workload labels (render_llmisvc.py).

The router's Service carries the LLMService's own name: it is the endpoint clients use
(HTTP/OpenAI on 8080, gRPC on 8081).

The router pod is hardened like the replicas (render_security.py: non-root, read-only
root filesystem, no capabilities, an emptyDir /tmp) and mounts the Redis CA when Redis
is reached over TLS.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator import naming, render_security
from pagoda_operator.render_redis import redis_ca_volume, redis_env, redis_url_arg
from pagoda_operator.render_replicas import model_path, model_volume
from pagoda_operator.spec import LLMService

COMPONENT = "router"


def replica_selector(svc: LLMService) -> dict[str, str]:
    """Labels of the pods the router sends requests to."""
    if svc.spec.mode == "KServe":
        return {naming.KSERVE_ISVC_LABEL: svc.name}
    if svc.spec.mode == "KServeLLM":
        from pagoda_operator.render_llmisvc import llmisvc_pod_selector

        return llmisvc_pod_selector(svc)
    return naming.selector(svc, "replica")


def api_keys_env(svc: LLMService) -> list[dict[str, Any]]:
    """``PAGODA_API_KEYS`` from the Secret in ``spec.routing.apiKeysSecretRef`` (never the keys),
    and ``PAGODA_ROUTER_SECRET`` from ``spec.routing.routerSecretRef`` when set (tenants exist
    only with keys, so the salt secret only matters then)."""
    routing = svc.spec.routing
    if not routing.api_keys_secret_name:
        return []
    env = [{"name": "PAGODA_API_KEYS", "valueFrom": {"secretKeyRef": {
        "name": routing.api_keys_secret_name, "key": routing.api_keys_secret_key}}}]
    if routing.router_secret_name:  # the salts' HMAC key (pagoda.fleet.gate.auth), shared by every router pod
        env.append({"name": "PAGODA_ROUTER_SECRET", "valueFrom": {"secretKeyRef": {
            "name": routing.router_secret_name, "key": routing.router_secret_key}}})
    return env


def render_router_deployment(svc: LLMService) -> dict[str, Any]:
    """The router Deployment (`pagoda router`).

    It mounts the same model folder as the replicas: the router tokenizes prompts with
    the model's own tokenizer to hash their blocks exactly as the engine does.
    """
    volumes, mounts = model_volume(svc)
    ca_volumes, ca_mounts = redis_ca_volume(svc)
    container = {
        "name": "router",
        "image": svc.spec.image,
        "imagePullPolicy": svc.spec.image_pull_policy,
        "command": ["pagoda", "router"],
        "args": [
            "--k8s-selector", naming.selector_string(replica_selector(svc)),
            "--redis-url", redis_url_arg(svc),
            "--policy", svc.spec.routing.policy,
            "--model-dir", model_path(svc),
            *[arg for name, _ in svc.spec.model.lora_adapters for arg in ("--lora", name)],
            *(["--allow-runtime-lora"] if svc.spec.model.allow_runtime_lora else []),
        ],
        "env": [
            {"name": "PAGODA_NAMESPACE",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "PAGODA_MODEL_NAME", "value": svc.spec.model.name},
            *redis_env(svc),
            {"name": "TMPDIR", "value": "/tmp"},
            *api_keys_env(svc),
        ],
        "ports": [
            {"name": "http", "containerPort": naming.ROUTER_HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": naming.ROUTER_GRPC_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "securityContext": render_security.container_security_context(),
        "volumeMounts": [*mounts, *ca_mounts, {"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.metadata(svc, naming.router_name(svc), COMPONENT),
        "spec": {
            "replicas": svc.spec.routing.replicas,
            "selector": {"matchLabels": naming.selector(svc, COMPONENT)},
            "template": {
                "metadata": {"labels": naming.labels(svc, COMPONENT)},
                "spec": {
                    "serviceAccountName": naming.router_name(svc),
                    "securityContext": render_security.pod_security_context(),
                    "containers": [container],
                    "volumes": [*volumes, *ca_volumes,
                                {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
                },
            },
        },
    }


def render_router_service(svc: LLMService) -> dict[str, Any]:
    """The client-facing Service, named after the LLMService."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(svc, naming.router_service_name(svc), COMPONENT),
        "spec": {
            "type": svc.spec.routing.service_type,
            "selector": naming.selector(svc, COMPONENT),
            "ports": [
                {"name": "http", "port": naming.ROUTER_HTTP_PORT, "targetPort": "http"},
                {"name": "grpc", "port": naming.ROUTER_GRPC_PORT, "targetPort": "grpc"},
            ],
        },
    }


def render_router_service_account(svc: LLMService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": naming.metadata(svc, naming.router_name(svc), COMPONENT),
    }


def render_router_role(svc: LLMService) -> dict[str, Any]:
    """Least privilege for replica discovery: read pods in this namespace."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": naming.metadata(svc, naming.router_name(svc), COMPONENT),
        "rules": [{"apiGroups": [""], "resources": ["pods"],
                   "verbs": ["get", "list", "watch"]}],
    }


def render_router_role_binding(svc: LLMService) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": naming.metadata(svc, naming.router_name(svc), COMPONENT),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": naming.router_name(svc)},
        "subjects": [{"kind": "ServiceAccount", "name": naming.router_name(svc),
                      "namespace": svc.namespace}],
    }
