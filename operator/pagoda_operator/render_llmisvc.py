"""Render a KServe LLMInferenceService (serving.kserve.io/v1alpha2) for `mode: KServeLLM`.

KServe steers LLM users to LLMInferenceService, its llm-d based CRD: KServe's storage
initializer fetches `spec.model.uri` into /mnt/models, KServe runs the workload pods from
`spec.template` (container `main`), and its router part wires a Gateway API HTTPRoute,
optionally through an InferencePool whose endpoint picker (llm-d's EPP, an Envoy
ext-proc gRPC service) chooses the pod for each request.

How pagoda maps onto it (the closest wiring the CRD supports; see docs/kubernetes.md):

- the replicas are the model server: `spec.template.containers[main]` is the same
  tritonserver container as mode Deployment (`pagoda serve` on /mnt/models, HTTP 8000,
  gRPC 8001, metrics 8002, publishing to the fleet's Redis);
- the pagoda router is the endpoint picker, but not as an EPP: it does not speak the
  ext-proc protocol, and the pods answer Triton's protocol on 8000, not the OpenAI API the
  InferencePool path expects. So no `router.scheduler` (no InferencePool, no EPP) is
  rendered; `router.route.http.spec` sends every path to the pagoda router's Service
  (rendered by render_router.py, as in the other modes), which picks the replica and
  serves OpenAI + Triton HTTP/gRPC; `router.gateway.refs` names the Gateway when
  `spec.kserve.gateway` is set (else KServe's configured default gateway applies);
- the router finds the pods by the labels KServe puts on an LLMInferenceService's
  workload (`llmisvc_pod_selector`, the same labels KServe's own InferencePool selects);
- replicas: `spec.replicas` = `spec.replicas.min` (KServe owns the pods; the built-in
  autoscaler runs only in mode Deployment);
- with `spec.disaggregation`: KServe's `spec.prefill` section (its own Deployment,
  `<name>-kserve-prefill`, pods labelled `llm-d.ai/role: prefill` beside the same workload
  labels) runs the prefill pool: `replicas` = `disaggregation.prefill.replicas.min`, the same
  container with `--role prefill`, and `labels` (KServe copies a workload's labels onto its
  pods) `pagoda.dev/pool: prefill`; the main workload becomes the decode pool (`--role
  decode`, `labels: pagoda.dev/pool: decode`). Both pods listen for KV pulls on
  `kvTransferPort`; the pagoda router finds both through the workload selector and reads each
  pod's role from its pool label (else from its heartbeat) to run requests in two stages.
  With `kserve.scheduler: llm-d` it is refused (spec.py): llm-d's P/D profile drives vLLM's
  NIXL connector through its routing sidecar, which pagoda's KV handle does not speak.

With `spec.parallelism`: `parallelism.tensor` = GPUs per pod (the containers' `nvidia.com/gpu`
limit and `--tensor-parallel-size`/`--pipeline-parallel-size` come from render_replicas.py; on
one node a pipeline's stages are all in the pod, so `pipeline` is not rendered: KServe reads
`pipeline` as the pods of a multi-node group). With `nodes > 1` also KServe's multi-node form:
`worker` (the worker pods' spec: `pagoda serve --node-rank $(LWS_WORKER_INDEX)` joining the
leader's store, no Redis, no ports) and the group's size, which KServe v0.20 takes from
`data / dataLocal`, else from `pipeline` (`ParallelismSpec.GetSize`):
- one pipeline stage per node (`pipeline == nodes`): `{tensor: T, pipeline: P}`, KServe's own
  meaning (tensor parallelism inside a pod, a stage per pod), and KServe merges its well-known
  `kserve-config-llm-worker-pipeline-parallel`;
- otherwise (tensor parallelism across nodes, or several stages per node):
  `{tensor: GPUs per pod, data: nodes, dataLocal: 1}`, because KServe has no field for those
  layouts; `data` here only sizes the group (pagoda has no data parallelism), and KServe merges
  `kserve-config-llm-worker-data-parallel`.
Either merged config's container `main` is replaced by ours in its command and arguments, but
its extra env, volumes and preStop hook are added (read from KServe's source, not observed on
a cluster).

With `spec.kserve.scheduler: llm-d` the other wiring is rendered instead: `router.scheduler:
{}` and `router.route: {}` take KServe's managed InferencePool, llm-d endpoint picker and
HTTPRoute (its well-known configs, tests/data/kserve/llmisvcconfig), and the replicas serve
what that picker expects on the pool's target port 8000 — OpenAI, `/health` and `/metrics`
with the `vllm:` series (pagoda serve's OpenAI door; Triton HTTP moves to 8080) — and publish
vLLM-format KV events to the picker's ZMQ port for its precise prefix scorer. No pagoda
router is rendered then. KServe's global TLS (HTTPS probes and metrics scraping) is not
supported by the door.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda_operator import kv_tiers, naming, render_security
from pagoda_operator.render_groups import render_worker_container, store_port
from pagoda_operator.render_redis import redis_ca_volume
from pagoda_operator.render_replicas import model_volume, render_replica_container
from pagoda_operator.spec import LLMService

API_VERSION = "serving.kserve.io/v1alpha2"
KIND = "LLMInferenceService"
COMPONENT = "replica"
# Labels KServe gives the workload pods of an LLMInferenceService (its well-known
# scheduler config selects the InferencePool's endpoints with exactly these).
WORKLOAD_LABELS = {"app.kubernetes.io/part-of": "llminferenceservice", "kserve.io/component": "workload"}
# scheduler llm-d: KServe's scheduler config targets port 8000 and names the picker's
# Service `<name>-epp-service`, whose ZMQ port 5557 receives KV events.
LLMD_TARGET_PORT = 8000
LLMD_TRITON_HTTP_PORT = 8080
EPP_SERVICE_SUFFIX = "-epp-service"
EPP_ZMQ_PORT = 5557


def llmisvc_pod_selector(svc: LLMService) -> dict[str, str]:
    """Labels of the workload pods KServe runs for `svc`'s LLMInferenceService."""
    return {"app.kubernetes.io/name": svc.name, **WORKLOAD_LABELS}


def _main_container(svc: LLMService, pool: str | None = None) -> dict[str, Any]:
    container = render_replica_container(svc, pool)
    container["name"] = "main"  # KServe merges its template into the container named main
    args = list(container["args"])
    args[args.index("--model") + 1] = naming.MODEL_MOUNT  # the storage initializer's output
    container["args"] = args
    if svc.spec.kserve_scheduler == "llm-d":
        _serve_for_llm_d(container, svc)
    # KServe mounts the model itself (the storage initializer's volume); the other mounts
    # (writable emptyDirs, Redis CA, /dev/shm) stay ours, as in mode Deployment.
    _, model_mounts = model_volume(svc)
    model_names = {m["name"] for m in model_mounts}
    container["volumeMounts"] = [m for m in container.get("volumeMounts", []) if m["name"] not in model_names]
    return container


def _serve_for_llm_d(container: dict[str, Any], svc: LLMService) -> None:
    """What KServe's managed scheduler expects of the model server (its well-known configs):
    OpenAI and ``/health`` and the ``vllm:`` metrics on port 8000 (the pool's target port:
    pagoda's OpenAI door moves there, Triton HTTP to 8080), and KV events for the endpoint
    picker's precise prefix scorer, published (connecting) to its ZMQ port 5557 with
    llm-d's topic ``kv@<pod-ip>:<port>@<model>``."""
    args = container["args"]
    args[args.index("--http-port") + 1] = str(LLMD_TRITON_HTTP_PORT)
    args[args.index("--openai-port") + 1] = str(LLMD_TARGET_PORT)
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://{svc.name}{EPP_SERVICE_SUFFIX}:{EPP_ZMQ_PORT}",
              "topic": f"kv@$(PAGODA_POD_IP):{LLMD_TARGET_PORT}@{svc.spec.model.name}"}
    args += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    ports = {"http": LLMD_TRITON_HTTP_PORT, "openai": LLMD_TARGET_PORT}
    container["ports"] = [{**p, "containerPort": ports.get(p["name"], p["containerPort"])} for p in container["ports"]]


def _volumes(svc: LLMService) -> list[dict[str, Any]]:
    ca_volumes, _ = redis_ca_volume(svc)
    writable, _ = render_security.writable_volumes()
    return [*ca_volumes, *writable, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
            *kv_tiers.volumes(svc.spec.kv_cache)[0]]


def _route(svc: LLMService) -> dict[str, Any]:
    rule = {
        "name": "pagoda-router",
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"kind": "Service", "name": naming.router_service_name(svc),
                         "port": naming.ROUTER_HTTP_PORT, "weight": 1}],
        "timeouts": {"request": "0s", "backendRequest": "0s"},  # streams last as long as they last
    }
    spec: dict[str, Any] = {"rules": [rule]}
    gateway = svc.spec.kserve_gateway
    if gateway:
        spec["parentRefs"] = [{"group": "gateway.networking.k8s.io", "kind": "Gateway", **gateway}]
    return {"http": {"spec": spec}}


def _template(svc: LLMService, pool: str | None) -> dict[str, Any]:
    """A workload's pod spec (KServe's `template`): the replica container as `main`."""
    return {
        "securityContext": render_security.pod_security_context(),
        "containers": [_main_container(svc, pool)],
        "volumes": _volumes(svc),
        "terminationGracePeriodSeconds": svc.spec.termination_grace_period_seconds,
    }


def _parallelism(spec: dict[str, Any], svc: LLMService) -> None:
    """KServe's `parallelism` (GPUs of one pod as `tensor`) and, across nodes, its `worker` pod
    spec: KServe then runs a LeaderWorkerSet of `pipeline` (one stage per node) or `data /
    dataLocal` = `nodes` pods per replica (its only multi-node sizes; module docstring)."""
    split = svc.spec.parallelism
    spec["parallelism"] = {"tensor": split.gpus_per_pod}
    if not split.is_multi_node:
        return
    spec["parallelism"] |= {"pipeline": split.pipeline} if split.is_stage_per_node else {"data": split.nodes,
                                                                                          "dataLocal": 1}
    spec["template"]["containers"][0]["ports"].append(store_port())
    worker = render_worker_container(svc, naming.MODEL_MOUNT)
    worker["name"] = "main"
    model_mounts = {m["name"] for m in model_volume(svc)[1]}
    worker["volumeMounts"] = [m for m in worker["volumeMounts"] if m["name"] not in model_mounts]
    spec["worker"] = {"securityContext": render_security.pod_security_context(), "containers": [worker],
                      "volumes": _volumes(svc),
                      "terminationGracePeriodSeconds": svc.spec.termination_grace_period_seconds}


def render_llm_inference_service(svc: LLMService) -> dict[str, Any]:
    """The serving.kserve.io/v1alpha2 LLMInferenceService for `svc` (module docstring)."""
    disaggregation = svc.spec.disaggregation
    if svc.spec.kserve_scheduler == "llm-d":  # KServe's managed InferencePool, EPP and HTTPRoute
        router: dict[str, Any] = {"scheduler": {}, "route": {}}
    else:
        router = {"route": _route(svc)}
    if svc.spec.kserve_gateway:
        router["gateway"] = {"refs": [dict(svc.spec.kserve_gateway)]}
    spec: dict[str, Any] = {
        "model": {"uri": svc.spec.model.storage_uri, "name": svc.spec.model.name},
        "replicas": svc.spec.min_replicas,
        "template": _template(svc, "decode" if disaggregation else None),
        "router": router,
    }
    if svc.spec.parallelism is not None:
        _parallelism(spec, svc)
    if disaggregation is not None:
        spec["labels"] = {naming.POOL_LABEL: "decode"}
        spec["prefill"] = {"replicas": disaggregation.prefill_min_replicas,
                           "labels": {naming.POOL_LABEL: "prefill"},
                           "template": _template(svc, "prefill")}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": naming.metadata(svc, svc.name, COMPONENT),
            "spec": spec}
