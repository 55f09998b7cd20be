"""Mode KServeLLM: the LLMInferenceService render, validated against KServe's own CRD
schema (tests/data/kserve, storage version v1alpha2, tightened to reject unknown fields),
its pod labels checked against KServe's well-known scheduler config, and the children
the reconciler applies and deletes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pagoda_operator import naming
from pagoda_operator.reconcile import render_children, stale_children
from pagoda_operator.render_llmisvc import llmisvc_pod_selector, render_llm_inference_service
from pagoda_operator.render_router import render_router_deployment
from pagoda_operator.spec import SpecError, parse_llmservice
from tests.crd_schema import KSERVE, storage_version_validator  # noqa: E402

pytest.importorskip("jsonschema")


def body(**spec):
    base = {"image": "pagoda:1", "mode": "KServeLLM", "model": {"name": "chat", "storageUri": "hf://org/smollm2"},
            "replicas": {"min": 2, "max": 4}}
    base.update(spec)
    return {"metadata": {"name": "chat", "namespace": "llm", "uid": "u1"}, "spec": base}


def llmisvc_validator():
    return storage_version_validator(KSERVE / "serving.kserve.io_llminferenceservices.yaml")


def errors_of(obj: dict) -> list[str]:
    api_version, kind, validator = llmisvc_validator()
    assert (obj["apiVersion"], obj["kind"]) == (api_version, kind)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


@pytest.mark.parametrize("extra", [{}, {"kserve": {"gateway": {"name": "inference-gw", "namespace": "gw"}}}])
def test_llm_inference_service_validates_against_kserve_crd(extra):
    svc = parse_llmservice(body(**extra))
    isvc = render_llm_inference_service(svc)
    assert errors_of(isvc) == []
    spec = isvc["spec"]
    assert spec["model"] == {"uri": "hf://org/smollm2", "name": "chat"} and spec["replicas"] == 2
    [main] = spec["template"]["containers"]
    assert main["name"] == "main" and main["command"] == ["pagoda", "serve"]
    assert main["args"][main["args"].index("--model") + 1] == "/mnt/models"
    volumes = {v["name"] for v in spec["template"]["volumes"]}
    assert {m["name"] for m in main["volumeMounts"]} <= volumes  # every mount has its volume (not the model's)
    assert main["securityContext"]["readOnlyRootFilesystem"] and spec["template"]["securityContext"]["runAsNonRoot"]
    env = {e["name"] for e in main["env"]}
    assert {"PAGODA_REDIS_URL", "PAGODA_REPLICA_ID", "PAGODA_MODEL_NAME"} <= env
    assert "scheduler" not in spec["router"]  # the pagoda router picks the replica, not an EPP
    [rule] = spec["router"]["route"]["http"]["spec"]["rules"]
    assert rule["backendRefs"] == [{"kind": "Service", "name": naming.router_service_name(svc),
                                    "port": naming.ROUTER_HTTP_PORT, "weight": 1}]
    if extra:
        assert spec["router"]["gateway"] == {"refs": [{"name": "inference-gw", "namespace": "gw"}]}
        assert spec["router"]["route"]["http"]["spec"]["parentRefs"][0]["name"] == "inference-gw"


def test_the_tightened_schema_rejects_what_kserve_would():
    isvc = render_llm_inference_service(parse_llmservice(body()))
    typo = copy.deepcopy(isvc)
    typo["spec"]["model"]["storageUri"] = typo["spec"]["model"].pop("uri")
    assert any("storageUri" in e or "uri" in e for e in errors_of(typo))
    bad_replicas = copy.deepcopy(isvc)
    bad_replicas["spec"]["replicas"] = "two"
    assert errors_of(bad_replicas)


def test_router_selects_the_pods_kserve_labels_as_workload():
    """The router's --k8s-selector is the selector KServe's own InferencePool would use."""
    config = yaml.safe_load((KSERVE / "llmisvcconfig" / "config-llm-scheduler.yaml").read_text())
    pool_labels = config["spec"]["router"]["scheduler"]["pool"]["spec"]["selector"]["matchLabels"]
    svc = parse_llmservice(body())
    ours = llmisvc_pod_selector(svc)
    assert set(ours) == set(pool_labels)
    fixed = [k for k, v in pool_labels.items() if "{{" not in v]  # not a template
    assert {k: pool_labels[k] for k in fixed} == {k: ours[k] for k in fixed}
    assert ours["app.kubernetes.io/name"] == svc.name  # the template's {{ .ObjectMeta.Name }}
    router = render_router_deployment(svc)["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][1] == naming.selector_string(ours)


def test_reconciler_children_and_mode_switches():
    svc = parse_llmservice(body())
    kinds = [child["kind"] for child in render_children(svc, 2)]
    assert kinds[0] == "LLMInferenceService" and "Deployment" in kinds  # the router's
    stale = {(kind, name) for _, kind, name in stale_children(svc)}
    assert ("InferenceService", "chat") in stale and ("Deployment", naming.replicas_name(svc)) in stale
    deployment_mode = parse_llmservice(body(mode="Deployment", model={"name": "chat", "storageUri": "pvc://m/chat"}))
    assert ("LLMInferenceService", "chat") in {(k, n) for _, k, n in stale_children(deployment_mode)}
    with pytest.raises(SpecError, match="image://"):
        parse_llmservice(body(model={"name": "chat", "storageUri": "image:///m"}))


def test_llm_d_scheduler_wires_kserves_picker_to_pagodas_openai_door_and_kv_events():
    """`kserve.scheduler: llm-d`: KServe's managed InferencePool + EPP + HTTPRoute (empty
    scheduler/route: its well-known configs), the replicas serve OpenAI on the pool's target
    port and publish vLLM-format KV events to the picker's ZMQ port; no pagoda router."""
    import json

    from pagoda.serving.kv_event_stream import KVEventsConfig
    from pagoda.serving.launch.serve_flags import make_parser

    svc = parse_llmservice(body(kserve={"scheduler": "llm-d"}))
    isvc = render_llm_inference_service(svc)
    assert errors_of(isvc) == []
    assert isvc["spec"]["router"] == {"scheduler": {}, "route": {}}
    [main] = isvc["spec"]["template"]["containers"]
    config = yaml.safe_load((KSERVE / "llmisvcconfig" / "config-llm-scheduler.yaml").read_text())
    pool = config["spec"]["router"]["scheduler"]["pool"]["spec"]
    [target] = pool["targetPorts"]
    args = make_parser().parse_args(main["args"])  # `pagoda serve` accepts them
    assert args.openai_port == target["number"] == 8000 and args.http_port == 8080
    assert {p["name"]: p["containerPort"] for p in main["ports"]}["openai"] == 8000
    events = KVEventsConfig.from_json(args.kv_events_config)
    epp_service = pool["endpointPickerRef"]["name"].replace("{{ ChildName .ObjectMeta.Name `-epp-service` }}",
                                                           f"{svc.name}-epp-service")
    assert events.is_active and events.endpoint == f"tcp://{epp_service}:5557"
    zmq_port = [p for c in config["spec"]["router"]["scheduler"]["template"]["containers"]
                for p in c.get("ports", []) if p.get("name") == "zmq"]
    assert zmq_port == [{"containerPort": 5557, "name": "zmq", "protocol": "TCP"}]
    assert events.topic == "kv@$(PAGODA_POD_IP):8000@chat"  # llm-d's topic; the kubelet expands the pod IP
    assert "PAGODA_POD_IP" in {e["name"] for e in main["env"]}
    assert [c["kind"] for c in render_children(svc, 2)] == ["LLMInferenceService"]
    stale = {(kind, name) for _, kind, name in stale_children(svc)}
    assert ("Deployment", naming.router_name(svc)) in stale and ("Service", naming.router_service_name(svc)) in stale
    with pytest.raises(SpecError, match="scheduler"):
        parse_llmservice(body(kserve={"scheduler": "envoy"}))
    assert json.loads(main["args"][main["args"].index("--kv-events-config") + 1])["publisher"] == "zmq"


def test_disaggregation_renders_kserves_prefill_section():
    """spec.disaggregation in mode KServeLLM: KServe's `spec.prefill` (its own workload) runs the
    prefill pool and the main workload the decode pool; both containers are arguments `pagoda
    serve` accepts (role, KV connector), both workloads carry the pool label the router reads the
    role from, and the object validates against KServe's CRD."""
    from pagoda.fleet.routing.k8s_discovery import pod_to_member
    from pagoda.serving.launch.serve_flags import make_parser

    svc = parse_llmservice(body(disaggregation={"prefill": {"replicas": {"min": 2, "max": 4}}, "kvTransferPort": 5700}))
    isvc = render_llm_inference_service(svc)
    assert errors_of(isvc) == []
    spec = isvc["spec"]
    assert spec["replicas"] == 2 and spec["prefill"]["replicas"] == 2
    for role, workload in (("decode", spec), ("prefill", spec["prefill"])):
        assert workload["labels"] == {naming.POOL_LABEL: role}
        [main] = workload["template"]["containers"]
        args = make_parser().parse_args(main["args"])
        assert (args.role, args.kv_transfer_listen) == (role, "0.0.0.0:5700")
        assert main["args"][main["args"].index("--model") + 1] == "/mnt/models"
        assert {"name": "kv-transfer", "containerPort": 5700, "protocol": "TCP"} in main["ports"]
        assert {m["name"] for m in main["volumeMounts"]} <= {v["name"] for v in workload["template"]["volumes"]}
        pod = {"metadata": {"name": f"{role}-0", "labels": {**llmisvc_pod_selector(svc), **workload["labels"]}},
               "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
               "spec": {"containers": [main]}}
        assert pod_to_member(pod)[1]["role"] == role
    no_prefill = render_llm_inference_service(parse_llmservice(body()))["spec"]
    assert "prefill" not in no_prefill and "labels" not in no_prefill
    assert "scaling" not in spec["prefill"]  # KServe's CEL rule (not run offline): replicas xor scaling
    typo = copy.deepcopy(isvc)
    typo["spec"]["prefill"]["replicaz"] = 1
    assert any("replicaz" in e for e in errors_of(typo))
    with pytest.raises(SpecError) as info:
        parse_llmservice(body(kserve={"scheduler": "llm-d"}, disaggregation={}))
    assert info.value.field == "spec.disaggregation" and "routing sidecar" in str(info.value)


@pytest.mark.parametrize("split, kserve_parallelism", [
    ({"tensor": 8}, {"tensor": 8}),
    ({"tensor": 4, "pipeline": 2}, {"tensor": 8}),  # one pod holds both stages: no KServe `pipeline`
    ({"tensor": 8, "nodes": 2}, {"tensor": 4, "data": 2, "dataLocal": 1}),
    ({"tensor": 4, "pipeline": 2, "nodes": 2}, {"tensor": 4, "pipeline": 2}),  # a stage per pod: KServe's PP
    ({"tensor": 2, "pipeline": 4, "nodes": 2}, {"tensor": 4, "data": 2, "dataLocal": 1}),
])
def test_parallelism_renders_kserves_parallelism_and_worker_template(split, kserve_parallelism):
    """spec.parallelism in mode KServeLLM: `parallelism.tensor` = GPUs per pod; across nodes also
    KServe's `worker` pod spec (its LeaderWorkerSet group = pipeline, or data/dataLocal, = nodes
    pods), whose `main` container joins the leader's store and never registers in Redis."""
    isvc = render_llm_inference_service(parse_llmservice(body(parallelism=split)))
    assert errors_of(isvc) == []
    spec = isvc["spec"]
    assert spec["parallelism"] == kserve_parallelism
    [main] = spec["template"]["containers"]
    nodes, pipeline = split.get("nodes", 1), split.get("pipeline", 1)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == split["tensor"] * pipeline // nodes
    assert main["args"][main["args"].index("--tensor-parallel-size") + 1] == str(split["tensor"])
    assert ("--pipeline-parallel-size" in main["args"]) == (pipeline > 1)
    if pipeline > 1:
        assert main["args"][main["args"].index("--pipeline-parallel-size") + 1] == str(pipeline)
    if nodes == 1:
        assert "worker" not in spec
        return
    # KServe's group size (ParallelismSpec.GetSize: data / dataLocal, else pipeline) is the pod count
    size = kserve_parallelism["data"] // kserve_parallelism["dataLocal"] if "data" in kserve_parallelism \
        else kserve_parallelism["pipeline"]
    assert size == nodes
    [worker] = spec["worker"]["containers"]
    assert worker["name"] == "main" and worker["args"][worker["args"].index("--model") + 1] == "/mnt/models"
    assert worker["args"][worker["args"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert not {"PAGODA_REDIS_URL", "PAGODA_REPLICA_ID"} & {e["name"] for e in worker["env"]}
    assert {m["name"] for m in worker["volumeMounts"]} <= {v["name"] for v in spec["worker"]["volumes"]}
    assert 29500 in [p["containerPort"] for p in main["ports"]]
