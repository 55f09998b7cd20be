"""Render the replica Deployment and its headless Service (mode Deployment).

Pure functions of an `LLMService` (+ the replica count the autoscaler chose): no API
calls, no clock, so they are unit-tested and the handlers stay thin.

Each replica pod runs `pagoda serve` (tritonserver over our model repository) with:
- HTTP 8000 / gRPC 8001 / metrics 8002; readiness on Triton's `/v2/health/ready`,
  liveness on `/v2/health/live`, a startup probe long enough for a model load;
- `PAGODA_REPLICA_ID` = the pod name, which is the `replica_id` of its Redis heartbeat,
  so the autoscaler can map a heartbeat to the pod it drains and removes;
- the model from a read-only PVC mounted at /mnt/models (`pvc://claim/path`), or from a
  path baked into the image (`image:///path`);
- a memory-backed /dev/shm: Triton's Python backend passes tensors through shared
  memory and the container default (64 MiB) is too small;
- non-root, a read-only root filesystem, no capabilities (render_security.py), with
  emptyDirs for /tmp and the caches;
- `terminationGracePeriodSeconds` from the spec and `--grace-period` 10 s shorter:
  on SIGTERM `pagoda serve` drains in-flight requests that long, then the model unloads
  and every process exits before the kubelet would SIGKILL the pod;
- the Redis CA certificate when Redis is reached over TLS (render_redis.py);
- with `spec.kvEvents`, `--kv-events-config` (vLLM's JSON: the endpoint, llm-d's topic
  `kv@<pod-ip>:<openai port>@<model>` unless given, the replay endpoint) and a container
  port for each endpoint that binds in the pod (tcp://*:PORT);
- with `spec.disaggregation`, two Deployments, `<name>-prefill` and `<name>-decode`
  (each autoscaled on its own signal, pools.py) instead of `<name>-replicas`: pods labelled
  `pagoda.dev/pool` (the router's role for them), `--role` and `--kv-transfer-listen
  0.0.0.0:<kvTransferPort>`, `PAGODA_ADVERTISE_HOST` the pod IP (the KV handle's host).
  Both pools keep the component label, so the Service, NetworkPolicy, PDB and the router's
  discovery cover them;
- with `spec.parallelism`, `--tensor-parallel-size` (`--pipeline-parallel-size` past one stage)
  and `nvidia.com/gpu: tensor*pipeline/nodes` in the container's limits (parallelism.py); with `nodes > 1` the
  replicas are LeaderWorkerSet groups instead of this Deployment (render_groups.py reuses this container for the
  leader).
"""

from __future__ import annotations

import json

from typing import Any

from pagoda_operator import kv_tiers, naming, parallelism
from pagoda_operator import render_security
from pagoda_operator.render_redis import redis_ca_volume, redis_env, redis_url_arg
from pagoda_operator.spec import EngineSpec, LLMService

COMPONENT = "replica"
SHUTDOWN_MARGIN_SECONDS = 10  # model unload + process exit after the drain


def engine_args(engine: EngineSpec) -> list[str]:
    """`pagoda serve` flags for the engine settings (vLLM's flag names)."""
    args = [
        "--dtype", engine.dtype,
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--block-size", str(engine.block_size),
        "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--max-waiting-requests", str(engine.max_waiting_requests),
        "--max-waiting-prompt-tokens", str(engine.max_waiting_prompt_tokens),
    ]
    if engine.max_model_len:
        args += ["--max-model-len", str(engine.max_model_len)]
    return args + list(engine.extra_args)


def lora_args(svc: LLMService, model_dir: str) -> list[str]:
    """``--lora NAME=PATH`` per adapter (relative paths inside ``model_dir``, the model folder),
    and ``--allow-runtime-lora`` when the spec allows loading adapters at run time."""
    args = []
    for name, path in svc.spec.model.lora_adapters:
        where = path if path.startswith("/") else f"{model_dir}/{path}"
        args += ["--lora", f"{name}={where}"]
    if svc.spec.model.allow_runtime_lora:
        args.append("--allow-runtime-lora")
    return args


def model_path(svc: LLMService) -> str:
    """Where the weights are inside the replica container."""
    uri = svc.spec.model.storage_uri
    if svc.spec.model.scheme == "image":
        return uri[len("image://"):]
    claim_and_path = uri[len("pvc://"):]
    sub_path = claim_and_path.split("/", 1)[1] if "/" in claim_and_path else ""
    return f"{naming.MODEL_MOUNT}/{sub_path}".rstrip("/")


def model_volume(svc: LLMService) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) that put the model at ``model_path(svc)`` (none for image models)."""
    if svc.spec.model.scheme != "pvc":
        return [], []
    claim = svc.spec.model.storage_uri[len("pvc://"):].split("/", 1)[0]
    volumes = [{"name": "model",
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}]
    mounts = [{"name": "model", "mountPath": naming.MODEL_MOUNT, "readOnly": True}]
    return volumes, mounts


def grace_period_seconds(svc: LLMService) -> int:
    """`pagoda serve --grace-period`: the pod's termination grace minus the shutdown margin."""
    return max(1, svc.spec.termination_grace_period_seconds - SHUTDOWN_MARGIN_SECONDS)


def replica_env(svc: LLMService) -> list[dict[str, Any]]:
    return [
        {"name": "PAGODA_REPLICA_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PAGODA_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PAGODA_MODEL_NAME", "value": svc.spec.model.name},
        *redis_env(svc),
        {"name": "PAGODA_REDIS_URL", "value": redis_url_arg(svc)},
        *render_security.writable_env(),
    ]


def render_replica_container(svc: LLMService, pool: str | None = None) -> dict[str, Any]:
    """The tritonserver container of one replica (``pool``: its disaggregated pool's role)."""
    _, mounts = model_volume(svc)
    _, ca_mounts = redis_ca_volume(svc)
    _, writable_mounts = render_security.writable_volumes()
    container: dict[str, Any] = {
        "name": "pagoda",
        "image": svc.spec.image,
        "imagePullPolicy": svc.spec.image_pull_policy,
        "command": ["pagoda", "serve"],
        "args": [
            "--model", model_path(svc),
            "--http-port", str(naming.HTTP_PORT),
            "--grpc-port", str(naming.GRPC_PORT),
            "--metrics-port", str(naming.METRICS_PORT),
            "--openai-port", str(naming.OPENAI_PORT),
            "--grace-period", str(grace_period_seconds(svc)),
            *engine_args(svc.spec.engine),
            *parallelism.serve_args(svc.spec.parallelism),
            *lora_args(svc, model_path(svc)),
            *kv_tiers.serve_args(svc.spec.kv_cache),
        ],
        "env": replica_env(svc),
        "ports": [
            {"name": "http", "containerPort": naming.HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": naming.GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": naming.METRICS_PORT, "protocol": "TCP"},
            {"name": "openai", "containerPort": naming.OPENAI_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 6},
        "startupProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                         "periodSeconds": 10, "failureThreshold": 90},
        "volumeMounts": [*mounts, *ca_mounts, *writable_mounts, {"name": "dshm", "mountPath": "/dev/shm"},
                         *kv_tiers.volumes(svc.spec.kv_cache)[1]],
        "securityContext": render_security.container_security_context(),
    }
    resources = parallelism.pod_resources(svc.spec.resources, svc.spec.parallelism)
    if resources:
        container["resources"] = resources
    _kv_events(container, svc)
    if pool is not None:
        _disaggregated(container, svc, pool)
    return container


def _disaggregated(container: dict[str, Any], svc: LLMService, pool: str) -> None:
    """A pool's role and KV connector (reachable at the pod IP, which the KV handle names)."""
    port = svc.spec.disaggregation.kv_transfer_port
    container["args"] += ["--role", pool, "--kv-transfer-listen", f"0.0.0.0:{port}"]
    container["env"].append({"name": "PAGODA_ADVERTISE_HOST", "value": "$(PAGODA_POD_IP)"})
    container["ports"].append({"name": "kv-transfer", "containerPort": port, "protocol": "TCP"})


def kv_events_args(svc: LLMService) -> list[str]:
    """`spec.kvEvents` as `pagoda serve --kv-events-config` (vLLM's JSON); [] when unset. The
    default topic reads `PAGODA_POD_IP` (the pod's env)."""
    events = svc.spec.kv_events
    if events is None:
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events.endpoint,
              "topic": events.topic or f"kv@$(PAGODA_POD_IP):{naming.OPENAI_PORT}@{svc.spec.model.name}"}
    if events.replay_endpoint:
        config["replay_endpoint"] = events.replay_endpoint
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def _kv_events(container: dict[str, Any], svc: LLMService) -> None:
    """The KV-event arguments, and a container port for each endpoint that binds in the pod."""
    events = svc.spec.kv_events
    if events is None:
        return
    container["args"] += kv_events_args(svc)
    for name, endpoint in (("kv-events", events.endpoint), ("kv-replay", events.replay_endpoint)):
        host, _, port = (endpoint or "").removeprefix("tcp://").rpartition(":")
        if host in ("*", "0.0.0.0"):
            container["ports"].append({"name": name, "containerPort": int(port), "protocol": "TCP"})


def render_pod_template(svc: LLMService, pool: str | None = None) -> dict[str, Any]:
    """One replica pod's template (a Deployment's, or a LeaderWorkerSet group's leader)."""
    volumes, _ = model_volume(svc)
    ca_volumes, _ = redis_ca_volume(svc)
    writable, _ = render_security.writable_volumes()
    pod_labels = naming.labels(svc, COMPONENT) | {"pagoda.dev/model": svc.spec.model.name} | naming.LLM_D_LABELS
    if pool is not None:
        pod_labels[naming.POOL_LABEL] = pool
    return {
        "metadata": {
            "labels": pod_labels,
            "annotations": {"prometheus.io/scrape": "true",
                            "prometheus.io/port": str(naming.METRICS_PORT),
                            "prometheus.io/path": "/metrics"},
        },
        "spec": {
            "securityContext": render_security.pod_security_context(),
            "containers": [render_replica_container(svc, pool)],
            "volumes": [*volumes, *ca_volumes, *writable, dshm_volume(), *kv_tiers.volumes(svc.spec.kv_cache)[0]],
            "terminationGracePeriodSeconds": svc.spec.termination_grace_period_seconds,
        },
    }


def dshm_volume() -> dict[str, Any]:
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}


def render_replica_deployment(svc: LLMService, replicas: int, pool: str | None = None) -> dict[str, Any]:
    """The replica Deployment, or one pool's with ``spec.disaggregation``.

    Args:
        svc: the parsed LLMService.
        replicas: pod count (the autoscaler's decision, already within [min, max]).
        pool: ``prefill`` or ``decode`` (disaggregated): the Deployment ``<name>-<pool>``, its
            selector and pods labelled ``pagoda.dev/pool`` (the router reads the role from it).
    Returns:
        An apps/v1 Deployment.
    """
    selector = naming.selector(svc, COMPONENT)
    if pool is not None:
        selector[naming.POOL_LABEL] = pool
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.metadata(svc, naming.pool_name(svc, pool) if pool else naming.replicas_name(svc), COMPONENT),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": render_pod_template(svc, pool),
        },
    }


def render_replica_service(svc: LLMService) -> dict[str, Any]:
    """Headless Service: one DNS record per ready replica (discovery, metrics scraping)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(svc, naming.replicas_name(svc), COMPONENT),
        "spec": {
            "clusterIP": "None",
            "selector": naming.selector(svc, COMPONENT),
            "ports": [
                {"name": "http", "port": naming.HTTP_PORT, "targetPort": "http"},
                {"name": "grpc", "port": naming.GRPC_PORT, "targetPort": "grpc"},
                {"name": "metrics", "port": naming.METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }
