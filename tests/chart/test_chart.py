"""Helm chart, examples and operator renderers, validated offline.

- `helm lint --strict` and `helm template` (default and non-default values);
- built-in kinds: `kubernetes_validate` in strict mode (unknown fields and wrong types fail);
- LLMService: our CRD's openAPIV3Schema via jsonschema, tightened so unknown fields fail;
- ServingRuntime / InferenceService: KServe's CRD schemas (kept in tests/data/kserve with
  their licence), tightened the same way; LeaderWorkerSet: LWS's CRD (tests/data/lws).
Skips (does not fail) when helm or kubernetes-validate are absent.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from pagoda_operator import crd  # noqa: E402
from pagoda_operator.reconcile import render_children  # noqa: E402
from pagoda_operator.spec import parse_llmservice  # noqa: E402
from tests.crd_schema import KSERVE, load_yaml, lws_errors, tighten  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagoda"
EXAMPLES = REPO / "examples" / "k8s"
K8S_VERSION = "1.30.0"

NON_DEFAULT = {
    "image": {"repository": "registry.example/pagoda", "tag": "9.9.9", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {"watchNamespaces": ["team-a", "team-b"], "autoscaleIntervalSeconds": 5},
    "redis": {"auth": {"enabled": True, "password": "s3cret"},
              "tls": {"enabled": True, "existingSecret": "redis-tls"},
              "persistence": {"enabled": True, "size": "2Gi", "storageClass": "fast"}},
    "router": {"enabled": True, "replicas": 2, "policy": "least_loaded",
               "service": {"type": "LoadBalancer"}, "apiKeys": {"existingSecret": "keys"},
               "routerSecret": {"existingSecret": "router-secret"}},
    "kserve": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
    "grafanaDashboards": {"enabled": True},
    "example": {"enabled": True, "replicas": {"min": 2, "max": 5}},
}


def helm() -> str:
    path = os.environ.get("PAGODA_HELM") or str(REPO / ".tools" / "helm" / "helm")
    if not os.access(path, os.X_OK):
        path = shutil.which("helm") or ""
    if not path:
        pytest.skip("helm not installed (run .ci/install-k8s-tools.sh)")
    return path


def run_helm(*args: str) -> str:
    result = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def values_file(tmp_path: Path) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(NON_DEFAULT))
    return str(path)


def render(tmp_path: Path | None) -> list[dict]:
    args = ["template", "pagoda", str(CHART), "--namespace", "llm", "--include-crds"]
    if tmp_path is not None:
        args += ["-f", values_file(tmp_path)]
    return [d for d in yaml.safe_load_all(run_helm(*args)) if d]


def crd_validator(crd_doc: dict):
    version = crd_doc["spec"]["versions"][0]
    schema = tighten(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # metadata is the API server's
    api_version = f"{crd_doc['spec']['group']}/{version['name']}"
    return crd_doc["spec"]["names"]["kind"], api_version, jsonschema.Draft7Validator(schema)


def kserve_validators() -> dict:
    assert KSERVE.is_dir(), f"KServe CRDs missing from the repository at {KSERVE}"
    return _kserve_validators()


@functools.lru_cache(maxsize=None)
def _kserve_validators() -> dict:
    result = {}
    for name in ("serving.kserve.io_inferenceservices.yaml",
                 "serving.kserve.io_servingruntimes.yaml"):
        kind, api_version, validator = crd_validator(load_yaml(KSERVE / name))
        result[kind] = (api_version, validator)
    return result


@functools.lru_cache(maxsize=None)
def our_validator():
    _, _, validator = crd_validator(crd.make_crd())
    return validator


def validate_custom(obj: dict, validators: dict) -> None:
    api_version, validator = validators[obj["kind"]]
    assert obj["apiVersion"] == api_version, obj["apiVersion"]
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: " + "; ".join(
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def validate_builtin(obj: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(obj, K8S_VERSION, strict=True)


def validate_any(obj: dict) -> None:
    custom = {crd.KIND: (crd.API_VERSION, our_validator())}
    if obj["kind"] == crd.KIND:
        validate_custom(obj, custom)
        parse_llmservice(obj)  # the operator's own checks (cross-field rules) too
    elif obj["kind"] in ("InferenceService", "ServingRuntime"):
        validate_custom(obj, kserve_validators())
    elif obj["kind"] == "LeaderWorkerSet":
        assert lws_errors(obj) == [], lws_errors(obj)
    elif obj["kind"] == "ServiceMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"  # no schema offline
        assert set(obj["spec"]) <= {"namespaceSelector", "selector", "endpoints"}
    elif obj["kind"] == "PodMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(obj["spec"]) == {"selector", "podMetricsEndpoints"}
    elif obj["kind"] == "PrometheusRule":  # promtool checks its groups (tests/chart/test_alerts.py)
        assert obj["apiVersion"] == "monitoring.coreos.com/v1" and set(obj["spec"]) == {"groups"}
    else:
        validate_builtin(obj)


def test_chart_crd_is_generated_from_the_operator():
    on_disk = yaml.safe_load((CHART / "crds" / "llmservices.pagoda.dev.yaml").read_text())
    assert on_disk == crd.make_crd(), "regenerate: python -m pagoda_operator.crd > charts/..."


def test_crd_is_structural_without_unknown_fields():
    text = (CHART / "crds" / "llmservices.pagoda.dev.yaml").read_text()
    assert "x-kubernetes-preserve-unknown-fields" not in text
    version = crd.make_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert crd.make_crd()["spec"]["names"]["shortNames"] == ["llms"]
    validate_builtin(crd.make_crd())


def test_helm_lint_strict(tmp_path):
    run_helm("lint", "--strict", str(CHART))
    run_helm("lint", "--strict", str(CHART), "-f", values_file(tmp_path))


@pytest.mark.parametrize("values", ["default", "non-default"])
def test_rendered_objects_validate(values, tmp_path):
    objects = render(None if values == "default" else tmp_path)
    kinds = sorted(o["kind"] for o in objects)
    assert "CustomResourceDefinition" in kinds and "StatefulSet" in kinds
    if values == "non-default":
        assert {"LLMService", "ServingRuntime", "ServiceMonitor", "PrometheusRule", "Secret", "Role"} <= set(kinds)
        assert kinds.count("Role") == 3  # two watched namespaces + the router
    for obj in objects:
        validate_any(obj)


def test_operator_rbac_is_least_privilege():
    objects = render(None)
    role = next(o for o in objects if o["kind"] == "ClusterRole"
                and o["metadata"]["name"] == "pagoda-operator")
    verbs = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert "*" not in verbs and "escalate" not in verbs and "bind" not in verbs
    secrets = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path):
    for obj in yaml.safe_load_all(path.read_text()):
        if obj:
            validate_any(obj)


@pytest.mark.parametrize("mode", ["Deployment", "KServe"])
def test_operator_rendered_children_validate(mode):
    uri = "pvc://models/smollm2" if mode == "Deployment" else "s3://bucket/smollm2"
    svc = parse_llmservice({
        "metadata": {"name": "chat", "namespace": "llm", "uid": "1234"},
        "spec": {"image": "pagoda:1", "mode": mode, "model": {"name": "chat", "storageUri": uri},
                 "resources": {"limits": {"nvidia.com/gpu": 1}},
                 "redis": {"url": "redis://r:6379/0", "passwordSecretRef": {"name": "r"}}}})
    for obj in render_children(svc, 2):
        validate_any(obj)


def test_tightened_schemas_reject_typos():
    validators = kserve_validators()
    isvc = yaml.safe_load((EXAMPLES / "kserve-inferenceservice.yaml").read_text())
    isvc["spec"]["predictor"]["model"]["storageURI"] = "s3://typo"
    with pytest.raises(AssertionError, match="storageURI"):
        validate_custom(isvc, validators)
    llms = yaml.safe_load((EXAMPLES / "llmservice.yaml").read_text())
    llms["spec"]["autoscaling"]["targetWaiting"] = 3
    with pytest.raises(AssertionError, match="targetWaiting"):
        validate_custom(llms, {crd.KIND: (crd.API_VERSION, our_validator())})
    llms = yaml.safe_load((EXAMPLES / "llmservice.yaml").read_text())
    llms["spec"]["replicas"]["max"] = 0
    with pytest.raises(AssertionError, match="replicas.max"):
        validate_custom(llms, {crd.KIND: (crd.API_VERSION, our_validator())})


def pod_specs(objects: list[dict]):
    """(name, pod spec, container list) of every pod template the chart renders."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            pod = obj["spec"]["template"]["spec"]
            yield obj["metadata"]["name"], pod, pod["containers"]
        elif obj["kind"] == "ServingRuntime":
            yield obj["metadata"]["name"], obj["spec"], obj["spec"]["containers"]


@pytest.mark.parametrize("values", ["default", "non-default"])
def test_every_pod_is_non_root_read_only_without_capabilities(values, tmp_path):
    objects = render(None if values == "default" else tmp_path)
    found = list(pod_specs(objects))
    names = {name for name, _, _ in found}
    assert {"pagoda-operator", "pagoda-redis"} <= names
    if values == "non-default":
        assert {"pagoda-router", "pagoda"} <= names  # the router and the ServingRuntime
    for name, pod, containers in found:
        pod_context = pod.get("securityContext", {})
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in containers:
            context = {**pod_context, **container["securityContext"]}
            assert context["runAsNonRoot"] is True and context.get("runAsUser", 1) != 0, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"] == {"drop": ["ALL"]}, name
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            writable = "/data" if name.endswith("redis") else "/tmp"
            assert writable in mounts, name
            claims = [t["metadata"]["name"] for o in objects if o["metadata"]["name"] == name and "spec" in o
                      for t in o["spec"].get("volumeClaimTemplates", [])]
            assert "emptyDir" in volumes.get(mounts[writable], {}) or mounts[writable] in claims, name


def test_network_policies_admit_only_pagoda_to_redis_and_the_router_to_replicas(tmp_path):
    policies = {o["metadata"]["name"]: o["spec"] for o in render(tmp_path) if o["kind"] == "NetworkPolicy"}
    redis = policies["pagoda-redis"]
    assert redis["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    assert redis["ingress"] == [{"from": [{"namespaceSelector": {},
                                           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pagoda"}}}],
                                 "ports": [{"protocol": "TCP", "port": 6379}]}]
    replicas = policies["pagoda-router-replicas"]
    assert replicas["podSelector"]["matchLabels"] == {"serving.kserve.io/inferenceservice": "smollm2"}
    inference, metrics = replicas["ingress"]
    assert inference["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert metrics == {"ports": [{"protocol": "TCP", "port": 8002}]}
    assert not [o for o in render(None) if o["kind"] == "NetworkPolicy" and "router" in o["metadata"]["name"]]


def test_redis_tls_reaches_redis_router_operator_and_the_example(tmp_path):
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(tmp_path)}
    redis = objects[("StatefulSet", "pagoda-redis")]["spec"]["template"]["spec"]
    assert "--tls-port 6379" in redis["containers"][0]["args"][0] and "--port 0" in redis["containers"][0]["args"][0]
    assert {"name": "tls", "secret": {"secretName": "redis-tls"}} in redis["volumes"]
    router = objects[("Deployment", "pagoda-router")]["spec"]["template"]["spec"]
    url = next(a for a in router["containers"][0]["args"] if a.startswith("--redis-url="))
    assert url == ("--redis-url=rediss://:$(PAGODA_REDIS_PASSWORD)@pagoda-redis.llm.svc:6379/0"
                   "?ssl_ca_certs=/etc/pagoda/redis-tls/ca.crt")
    for pod in (router, objects[("Deployment", "pagoda-operator")]["spec"]["template"]["spec"]):
        assert {"name": "redis-ca", "secret": {"secretName": "redis-tls",
                                               "items": [{"key": "ca.crt", "path": "ca.crt"}]}} in pod["volumes"]
        assert {"name": "redis-ca", "mountPath": "/etc/pagoda/redis-tls", "readOnly": True} \
            in pod["containers"][0]["volumeMounts"]
    example = objects[("LLMService", "smollm2")]["spec"]["redis"]
    assert example["url"].startswith("rediss://")
    assert example["caSecretRef"] == {"name": "redis-tls", "key": "ca.crt"}


def test_router_gets_its_api_keys_and_salt_secret_from_secrets(tmp_path):
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(tmp_path)}
    env = objects[("Deployment", "pagoda-router")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "PAGODA_ROUTER_SECRET", "valueFrom": {"secretKeyRef": {"name": "router-secret",
                                                                           "key": "router-secret"}}} in env
    assert {"name": "PAGODA_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-keys"}}} in env


def test_operator_may_manage_what_it_renders():
    role = next(o for o in render(None) if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "pagoda-operator")
    granted = {(group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"]}
    children = [child for split in ({}, {"parallelism": {"tensor": 4, "nodes": 2}}) for child in render_children(
        parse_llmservice({"metadata": {"name": "c", "namespace": "n"},
                          "spec": {"image": "p:1", "model": {"name": "c", "storageUri": "pvc://m"}, **split}}), 1)]
    for child in children:  # one node (Deployment) and several (LeaderWorkerSet)
        group = child["apiVersion"].rsplit("/", 1)[0] if "/" in child["apiVersion"] else ""
        assert (group, child["kind"].lower() + "s" if not child["kind"].endswith("y")
                else child["kind"][:-1].lower() + "ies") in granted, child["kind"]


GIE = REPO / "tests" / "data" / "gie"
POOL_VALUES = {"example": {"enabled": True},
               "inferencePool": {"enabled": True, "endpointPicker": {"name": "smollm2-epp"},
                                 "allowFrom": [{"namespaceSelector": {"matchLabels": {"gateway": "yes"}}}]}}


def render_with(tmp_path: Path, values: dict) -> list[dict]:
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump(values))
    args = ["template", "pagoda", str(CHART), "--namespace", "llm", "-f", str(path)]
    return [d for d in yaml.safe_load_all(run_helm(*args)) if d]


def test_inference_pool_validates_against_gie_crd_and_selects_the_replicas_pods(tmp_path):
    objects = render_with(tmp_path, POOL_VALUES)
    [pool] = [o for o in objects if o["kind"] == "InferencePool"]
    kind, api_version, validator = crd_validator(load_yaml(GIE / "inference.networking.k8s.io_inferencepools.yaml"))
    validate_custom(pool, {kind: (api_version, validator)})
    spec = pool["spec"]
    assert pool["metadata"]["name"] == "smollm2-pool"
    # The CRD's CEL rules, which jsonschema does not run: a Service picker has a port; ports unique.
    assert spec["endpointPickerRef"] == {"name": "smollm2-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    assert len({p["number"] for p in spec["targetPorts"]}) == len(spec["targetPorts"])
    # The pool holds exactly the pods the operator renders for the example LLMService, on the
    # port their OpenAI door listens on, labelled for the picker's vLLM metric names.
    [example] = [o for o in objects if o["kind"] == "LLMService"]
    [deployment] = [c for c in render_children(parse_llmservice(example), 2) if c["kind"] == "Deployment"
                    and c["metadata"]["name"].endswith("-replicas")]
    pod = deployment["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    ports = {p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert spec["targetPorts"] == [{"number": 9000}] and 9000 in ports
    # Its NetworkPolicy opens only the target port, to the peers given, on the same pods.
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "smollm2-pool"]
    validate_builtin(policy)
    assert policy["spec"]["podSelector"] == spec["selector"]
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9000}],
                                          "from": [{"namespaceSelector": {"matchLabels": {"gateway": "yes"}}}]}]
    assert not [o for o in render(None) if o["kind"] == "InferencePool"]  # opt-in


def test_inference_pool_needs_its_endpoint_picker_and_refuses_bad_values(tmp_path):
    values = {"inferencePool": {"enabled": True}}
    path = tmp_path / "bad.yaml"
    for bad, message in [
        (values, "inferencePool.endpointPicker.name"),
        ({"inferencePool": {"enabled": True, "endpointPicker": {"name": "e", "failureMode": "Open"}}},
         "failureMode"),
        ({"inferencePool": {"enabled": True, "targetPort": 0, "endpointPicker": {"name": "e"}}}, "targetPort"),
        ({"inferencePool": {"enabled": True, "selector": {"a": "b"}, "endpointPicker": {"name": "e"}}}, "selector"),
    ]:
        path.write_text(yaml.safe_dump(bad))
        result = subprocess.run([helm(), "template", "pagoda", str(CHART), "-f", str(path)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and message in result.stderr, (bad, result.stderr)


@pytest.mark.parametrize("scheduler", ["pagoda", "llm-d"])
def test_example_as_kserve_llm_inference_service_validates(tmp_path, scheduler):
    objects = render_with(tmp_path, {"kserve": {"enabled": True},
                                     "example": {"enabled": True, "mode": "KServeLLM", "kserveScheduler": scheduler,
                                                 "storageUri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}})
    [example] = [o for o in objects if o["kind"] == "LLMService"]
    validate_any(example)
    svc = parse_llmservice(example)
    assert (svc.spec.mode, svc.spec.kserve_scheduler) == ("KServeLLM", scheduler)
    [llmisvc] = [c for c in render_children(svc, 1) if c["kind"] == "LLMInferenceService"]
    from tests.operator.test_llmisvc import errors_of
    assert errors_of(llmisvc) == []
    assert ("scheduler" in llmisvc["spec"]["router"]) == (scheduler == "llm-d")


def test_example_kv_events_reach_the_replicas(tmp_path):
    """values example.kvEvents -> LLMService spec.kvEvents -> the replicas' --kv-events-config."""
    objects = render_with(tmp_path, {"example": {"enabled": True, "kvEvents": {"endpoint": "tcp://*:5557"}}})
    [example] = [o for o in objects if o["kind"] == "LLMService"]
    validate_any(example)
    svc = parse_llmservice(example)
    [deployment] = [c for c in render_children(svc, 1) if c["kind"] == "Deployment" and "replicas" in
                    c["metadata"]["name"]]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert json.loads(args[args.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:5557"


@pytest.mark.parametrize("mode", ["Deployment", "KServeLLM"])
def test_example_disaggregation_reaches_the_pools(tmp_path, mode):
    """values example.disaggregation -> LLMService spec.disaggregation -> a prefill pool with its
    own bounds (mode Deployment: the `<name>-prefill` Deployment; KServeLLM: the
    LLMInferenceService's prefill section); a typo in it is refused by values.schema.json."""
    disaggregation = {"kvTransferPort": 5700, "prefill": {"replicas": {"min": 2, "max": 4},
                                                          "autoscaling": {"ttftSLOSeconds": 2}}}
    example = {"enabled": True, "mode": mode, "disaggregation": disaggregation,
               "autoscaling": {"targetWaitingPerReplica": 4, "scaleDownStabilizationSeconds": 300,
                               "itlSLOSeconds": 0.08}}
    if mode == "KServeLLM":
        example["storageUri"] = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
    objects = render_with(tmp_path, {"kserve": {"enabled": mode != "Deployment"}, "example": example})
    [llms] = [o for o in objects if o["kind"] == "LLMService"]
    validate_any(llms)
    svc = parse_llmservice(llms)
    assert svc.spec.autoscaling.itl_slo_seconds == 0.08
    assert (svc.spec.disaggregation.prefill_min_replicas, svc.spec.disaggregation.prefill_max_replicas) == (2, 4)
    children = render_children(svc, 1)
    if mode == "Deployment":
        pools = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
        assert pools["smollm2-prefill"]["spec"]["replicas"] == 2 and "smollm2-decode" in pools
        for obj in children:
            validate_any(obj)
    else:
        from tests.operator.test_llmisvc import errors_of
        [llmisvc] = [c for c in children if c["kind"] == "LLMInferenceService"]
        assert errors_of(llmisvc) == [] and llmisvc["spec"]["prefill"]["replicas"] == 2
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"example": {"enabled": True, "disaggregation": {"prefil": {}}}}))
    result = subprocess.run([helm(), "template", "pagoda", str(CHART), "-f", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "prefil" in result.stderr


@pytest.mark.parametrize("mode", ["Deployment", "KServeLLM"])
def test_example_parallelism_reaches_the_replicas(tmp_path, mode):
    """values example.parallelism -> LLMService spec.parallelism -> a LeaderWorkerSet of 2-pod
    groups, one 4-GPU pipeline stage per pod (mode Deployment; KServeLLM: KServe's worker
    template and its `pipeline`), every child valid against its schema; a typo in it is refused
    by values.schema.json."""
    example = {"enabled": True, "mode": mode, "parallelism": {"tensor": 4, "pipeline": 2, "nodes": 2}}
    if mode == "KServeLLM":
        example["storageUri"] = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
    objects = render_with(tmp_path, {"kserve": {"enabled": mode != "Deployment"}, "example": example})
    [llms] = [o for o in objects if o["kind"] == "LLMService"]
    validate_any(llms)
    children = render_children(parse_llmservice(llms), 2)
    if mode == "Deployment":
        [lws] = [c for c in children if c["kind"] == "LeaderWorkerSet"]
        assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        [leader] = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
        assert leader["resources"]["limits"]["nvidia.com/gpu"] == 4 and "--pipeline-parallel-size" in leader["args"]
        for obj in children:
            validate_any(obj)
    else:
        from tests.operator.test_llmisvc import errors_of
        [llmisvc] = [c for c in children if c["kind"] == "LLMInferenceService"]
        assert errors_of(llmisvc) == [] and llmisvc["spec"]["parallelism"] == {"tensor": 4, "pipeline": 2}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"example": {"enabled": True, "parallelism": {"tensors": 2}}}))
    result = subprocess.run([helm(), "template", "pagoda", str(CHART), "-f", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "tensors" in result.stderr


def _serving_runtime(tmp_path, kv_cache):
    path = tmp_path / "kv.yaml"
    path.write_text(yaml.safe_dump({"kserve": {"enabled": True, "kvCache": kv_cache}}))
    objects = [d for d in yaml.safe_load_all(run_helm("template", "pagoda", str(CHART), "-f", str(path))) if d]
    runtime = next(o for o in objects if o["kind"] == "ServingRuntime")
    validate_any(runtime)
    return runtime["spec"]


@pytest.mark.parametrize("disk", [{"enabled": True, "bytes": 1000}, {"enabled": True, "bytes": 1000,
                                                                      "hostPath": "/var/lib/pagoda-kv"}])
def test_kv_cache_tiers_reach_the_serving_runtime_with_their_volumes(tmp_path, disk):
    spec = _serving_runtime(tmp_path, {"cpuOffloadBytes": 2**30, "disk": disk, "writeThrough": True,
                                       "shared": {"enabled": True, "claimName": "kv-shared"}})
    container = spec["containers"][0]
    assert {"--cpu-offload-bytes=1073741824", "--kv-disk-dir=/var/cache/pagoda-kv/disk", "--kv-disk-bytes=1000",
            "--kv-shared-dir=/var/cache/pagoda-kv/shared", "--kv-write-through"} <= set(container["args"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["kv-disk"] == "/var/cache/pagoda-kv/disk" and mounts["kv-shared"] == "/var/cache/pagoda-kv/shared"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kv-shared"]["persistentVolumeClaim"] == {"claimName": "kv-shared"}
    local = volumes["kv-disk"]
    assert (local["hostPath"]["path"] == disk["hostPath"]) if "hostPath" in disk else ("emptyDir" in local)


def test_kv_cache_tiers_off_by_default_and_refused_without_a_cpu_tier_or_a_claim(tmp_path):
    spec = _serving_runtime(tmp_path, {})
    assert not any(a.startswith(("--kv-", "--cpu-offload")) for a in spec["containers"][0]["args"])
    for kv_cache in ({"disk": {"enabled": True}}, {"cpuOffloadBytes": 1, "shared": {"enabled": True}}):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({"kserve": {"enabled": True, "kvCache": kv_cache}}))
        result = subprocess.run([helm(), "template", "pagoda", str(CHART), "-f", str(path)], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode != 0 and "kvCache" in result.stderr, result.stderr
