"""spec.kvCache: the replicas' CPU, disk and shared KV tiers. The Deployment's pods and the
LLMInferenceService's template carry the flags `pagoda serve` accepts and the volumes they name
(valid against Kubernetes' and KServe's schemas), and bad combinations are refused naming the field."""

from __future__ import annotations

import pytest

from pagoda.serving.launch.serve_flags import make_parser
from pagoda_operator import kv_tiers
from pagoda_operator.reconcile import render_children
from pagoda_operator.render_llmisvc import render_llm_inference_service
from pagoda_operator.spec import SpecError, parse_llmservice

KV = {"cpuOffloadBytes": 1 << 30, "writeThrough": True, "disk": {"bytes": 8 << 30, "hostPath": "/var/lib/pagoda-kv"},
      "shared": {"claimName": "kv-shared"}}


def body(mode="Deployment", **spec):
    uri = "pvc://models/smollm2" if mode == "Deployment" else "hf://org/smollm2"
    base = {"image": "pagoda:1", "mode": mode, "model": {"name": "chat", "storageUri": uri},
            "replicas": {"min": 1, "max": 2}}
    base.update(spec)
    return {"metadata": {"name": "chat", "namespace": "llm", "uid": "u1"}, "spec": base}


def check_pod(pod: dict) -> dict:
    """The tiers' flags parse as `pagoda serve`'s, and their directories are mounted volumes."""
    [container] = pod["containers"]
    args = make_parser().parse_args(container["args"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert args.cpu_offload_bytes == 1 << 30 and args.kv_disk_bytes == 8 << 30 and args.kv_write_through == "true"
    assert volumes[mounts[args.kv_disk_dir]]["hostPath"] == {"path": "/var/lib/pagoda-kv", "type": "DirectoryOrCreate"}
    assert volumes[mounts[args.kv_shared_dir]]["persistentVolumeClaim"] == {"claimName": "kv-shared"}
    return volumes


def test_deployment_pods_get_the_tiers_flags_and_volumes():
    svc = parse_llmservice(body(kvCache=KV))
    children = {f"{c['kind']}/{c['metadata']['name']}": c for c in render_children(svc, 2)}
    deployment = children["Deployment/chat-replicas"]
    check_pod(deployment["spec"]["template"]["spec"])
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    plain = parse_llmservice(body(kvCache={"cpuOffloadBytes": 1 << 20, "disk": {"bytes": 1 << 30}}))
    pod = next(c for c in render_children(plain, 1) if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert {"name": "kv-disk", "emptyDir": {"sizeLimit": "10Gi"}} in pod["volumes"]  # the default emptyDir
    assert "--kv-shared-dir" not in pod["containers"][0]["args"]
    none = next(c for c in render_children(parse_llmservice(body()), 1) if c["kind"] == "Deployment")
    assert not {"--cpu-offload-bytes", "--kv-disk-dir"} & set(none["spec"]["template"]["spec"]["containers"][0]["args"])


def test_llm_inference_service_template_gets_them_and_stays_valid_for_kserve():
    from tests.operator.test_llmisvc import errors_of

    isvc = render_llm_inference_service(parse_llmservice(body("KServeLLM", kvCache=KV)))
    assert errors_of(isvc) == []
    check_pod(isvc["spec"]["template"])
    assert "kvCacheOffloading" not in isvc["spec"]  # KServe's field configures vLLM's command (kv_tiers docstring)


@pytest.mark.parametrize("spec, field, match", [
    (dict(kvCache={"disk": {"bytes": 1}}), "spec.kvCache.cpuOffloadBytes", "CPU tier"),
    (dict(kvCache=KV, engine={"enablePrefixCaching": False}), "spec.engine.enablePrefixCaching", "prefix"),
    (dict(kvCache=KV, parallelism={"tensor": 2}), "spec.kvCache", "tensor or pipeline"),
    (dict(kvCache=KV, engine={"extraArgs": ["--kv-disk-dir=/x"]}), "spec.engine.extraArgs", "kvCache"),
    (dict(kvCache={"shared": {}}), "spec.kvCache.shared.claimName", "required"),
    (dict(kvCache={"cpuOffloadBytes": 1, "disk": {"bytes": 1, "hostPath": "relative"}}),
     "spec.kvCache.disk.hostPath", "match"),
])
def test_bad_kv_cache_specs_are_refused_naming_the_field(spec, field, match):
    with pytest.raises(SpecError, match=match) as info:
        parse_llmservice(body(**spec))
    assert info.value.field == field


def test_mode_kserve_is_refused_for_the_charts_values():
    with pytest.raises(SpecError, match="kserve.kvCache") as info:
        parse_llmservice(body("KServe", kvCache=KV))
    assert info.value.field == "spec.kvCache"
    assert kv_tiers.serve_args(None) == [] and kv_tiers.volumes(None) == ([], [])
