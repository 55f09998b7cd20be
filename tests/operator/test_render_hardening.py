"""What the operator renders for a production cluster: hardened pods, a NetworkPolicy and a
PodDisruptionBudget for the replicas, Redis over TLS, the drain grace period, and replica
arguments that `pagoda serve` actually accepts."""

from __future__ import annotations

import pytest

from pagoda.serving.launch.serve_flags import make_parser, options_from_args
from pagoda_operator import naming
from pagoda_operator.reconcile import render_children, stale_children
from pagoda_operator.render_kserve import render_inference_service
from pagoda_operator.render_redis import CA_MOUNT
from pagoda_operator.spec import SpecError, parse_llmservice


def make_svc(mode: str = "Deployment", **spec):
    uri = "pvc://models/chat" if mode == "Deployment" else "s3://bucket/chat"
    base = {"image": "pagoda:1", "mode": mode, "model": {"name": "chat", "storageUri": uri}}
    base.update(spec)
    return parse_llmservice({"metadata": {"name": "chat", "namespace": "llm", "uid": "u1"}, "spec": base})


def pods(objects):
    for obj in objects:
        if obj["kind"] == "Deployment":
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


def test_every_pod_is_non_root_read_only_without_capabilities_and_has_writable_tmp():
    found = dict(pods(render_children(make_svc(), 2)))
    assert set(found) == {"chat-replicas", "chat-router"}
    for name, pod in found.items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"] == {"drop": ["ALL"]}, name
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], name
    replica = found["chat-replicas"]
    mounts = {m["mountPath"]: m["name"] for m in replica["containers"][0]["volumeMounts"]}
    assert {"/tmp", "/var/cache/pagoda", "/dev/shm"} <= set(mounts)
    env = {e["name"]: e.get("value") for e in replica["containers"][0]["env"]}
    assert env["HOME"] == env["XDG_CACHE_HOME"] == "/var/cache/pagoda"


def test_replicas_get_a_network_policy_that_admits_only_the_router_and_a_pdb():
    children = {obj["kind"]: obj for obj in render_children(make_svc(), 2)}
    policy = children["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == naming.selector(make_svc(), "replica")
    assert policy["policyTypes"] == ["Ingress"]
    inference, metrics = policy["ingress"]
    assert inference["from"] == [{"podSelector": {"matchLabels": naming.selector(make_svc(), "router")}}]
    assert {p["port"] for p in inference["ports"]} == {naming.HTTP_PORT, naming.GRPC_PORT}
    assert "from" not in metrics and metrics["ports"] == [{"protocol": "TCP", "port": naming.METRICS_PORT}]
    # The router's labels match the policy's peer selector.
    router = next(o for o in render_children(make_svc(), 2)
                  if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-router")
    assert naming.selector(make_svc(), "router").items() <= router["spec"]["template"]["metadata"]["labels"].items()
    pdb = children["PodDisruptionBudget"]["spec"]
    assert pdb == {"maxUnavailable": 1, "selector": {"matchLabels": naming.selector(make_svc(), "replica")}}
    # Switching to KServe removes them with the replica Deployment.
    stale = {kind for _, kind, _ in stale_children(make_svc("KServe"))}
    assert {"NetworkPolicy", "PodDisruptionBudget"} <= stale


def test_redis_tls_url_password_and_ca_reach_replicas_and_router():
    svc = make_svc(redis={"url": "rediss://redis.llm.svc:6380/0", "passwordSecretRef": {"name": "redis-auth"},
                          "caSecretRef": {"name": "redis-ca"}})
    expected = f"rediss://:$(PAGODA_REDIS_PASSWORD)@redis.llm.svc:6380/0?ssl_ca_certs={CA_MOUNT}/ca.crt"
    objects = render_children(svc, 1)
    found = dict(pods(objects))
    replica, router = found["chat-replicas"], found["chat-router"]
    env = {e["name"]: e for e in replica["containers"][0]["env"]}
    assert env["PAGODA_REDIS_URL"]["value"] == expected
    assert env["PAGODA_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "password"}
    args = router["containers"][0]["args"]
    assert args[args.index("--redis-url") + 1] == expected
    for pod in (replica, router):
        volume = next(v for v in pod["volumes"] if v["name"] == "redis-ca")
        assert volume["secret"]["secretName"] == "redis-ca"
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "redis-ca")
        assert mount == {"name": "redis-ca", "mountPath": CA_MOUNT, "readOnly": True}
    isvc = render_inference_service(make_svc("KServe", redis={"url": "rediss://r:6380/0"}))
    env = {e["name"]: e for e in isvc["spec"]["predictor"]["model"]["env"]}
    assert env["PAGODA_REDIS_URL"]["value"] == "rediss://r:6380/0"


def test_a_ca_without_tls_is_refused():
    with pytest.raises(SpecError, match="caSecretRef"):
        make_svc(redis={"url": "redis://r:6379/0", "caSecretRef": {"name": "ca"}})


@pytest.mark.parametrize("grace, expected", [(None, 50), (120, 110), (15, 5)])
def test_drain_grace_period_matches_the_pod_termination_grace(grace, expected):
    svc = make_svc(**({} if grace is None else {"terminationGracePeriodSeconds": grace}))
    deployment = next(o for o in render_children(svc, 1) if o["metadata"]["name"] == "chat-replicas")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == (grace or 60)
    args = pod["containers"][0]["args"]
    assert float(args[args.index("--grace-period") + 1]) == expected


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_replica_arguments_are_accepted_by_pagoda_serve(prefix_caching):
    svc = make_svc(engine={"enablePrefixCaching": prefix_caching, "maxModelLen": 2048,
                           "gpuMemoryUtilization": 0.8})
    container = dict(pods(render_children(svc, 1)))["chat-replicas"]["containers"][0]
    assert container["command"] == ["pagoda", "serve"]
    options = options_from_args(make_parser().parse_args(container["args"]))
    assert options.enable_prefix_caching is prefix_caching
    assert options.max_model_len == 2048
    assert options.engine_args["gpu_memory_utilization"] == "0.8"
    assert options.grace_period_s == 50


def test_kv_events_reach_the_replicas_in_vllms_format_in_every_mode():
    """spec.kvEvents -> `pagoda serve --kv-events-config` that the replica's own parser
    (vLLM's KVEventsConfig keys) accepts; a binding endpoint opens its port; KServe mode gets
    the same arguments and the pod IP for llm-d's default topic."""
    from pagoda.serving.kv_event_stream import KVEventsConfig

    svc = make_svc(kvEvents={"endpoint": "tcp://*:5557", "replayEndpoint": "tcp://*:5558"})
    container = dict(pods(render_children(svc, 1)))["chat-replicas"]["containers"][0]
    args = container["args"]
    options = options_from_args(make_parser().parse_args(args))
    config = KVEventsConfig.from_json(options.engine_args["kv_events_config"])
    assert config.is_active and config.endpoint == "tcp://*:5557" and config.replay_endpoint == "tcp://*:5558"
    assert config.topic == f"kv@$(PAGODA_POD_IP):{naming.OPENAI_PORT}@chat"
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in container["ports"]
    assert any(e["name"] == "PAGODA_POD_IP" for e in container["env"])
    connecting = make_svc(kvEvents={"endpoint": "tcp://epp.llm:5557", "topic": "kv@x@chat"})
    container = dict(pods(render_children(connecting, 1)))["chat-replicas"]["containers"][0]
    assert not any(p["name"].startswith("kv-") for p in container["ports"])
    assert KVEventsConfig.from_json(container["args"][container["args"].index("--kv-events-config") + 1]).topic \
        == "kv@x@chat"
    inference_service = render_inference_service(make_svc("KServe", kvEvents={"endpoint": "tcp://*:5557"}))
    model = inference_service["spec"]["predictor"]["model"]
    assert "--kv-events-config" in model["args"] and any(e["name"] == "PAGODA_POD_IP" for e in model["env"])
    assert "--kv-events-config" not in str(render_children(make_svc(), 1))


@pytest.mark.parametrize("kv_events, mode_spec, field", [
    ({"endpoint": "ipc:///tmp/x"}, {}, "spec.kvEvents.endpoint"),
    ({"endpoint": "tcp://*:70000"}, {}, "spec.kvEvents.endpoint"),
    ({"endpoint": "tcp://*:5557", "replayEndpoint": "tcp://*:5557"}, {}, "spec.kvEvents.replayEndpoint"),
    ({"endpoint": "tcp://*:5557", "topik": "x"}, {}, "spec.kvEvents.topik"),
    ({}, {}, "spec.kvEvents.endpoint"),
    ({"endpoint": "tcp://*:5557"}, {"mode": "KServeLLM", "kserve": {"scheduler": "llm-d"}}, "spec.kvEvents"),
])
def test_bad_kv_events_are_refused_naming_the_field(kv_events, mode_spec, field):
    mode = mode_spec.pop("mode", "Deployment")
    with pytest.raises(SpecError) as info:
        make_svc(mode, kvEvents=kv_events, **mode_spec)
    assert info.value.field == field, str(info.value)


def test_disaggregation_renders_a_prefill_and_a_decode_pool_the_router_tells_apart():
    """spec.disaggregation: `<name>-prefill` (prefillReplicas: fixed) and `<name>-decode` replace
    `<name>-replicas`; their arguments are accepted by `pagoda serve` (role, KV connector on
    the pod IP); the router reads each pod's role from its pool label; decode pods may reach
    prefill pods' KV port; the mixed Deployment becomes stale."""
    from pagoda.fleet.routing.k8s_discovery import pod_to_member
    from pagoda_operator.pools import scaled_pools
    from pagoda_operator.reconcile import stale_children

    svc = make_svc(disaggregation={"prefillReplicas": 2}, replicas={"min": 1, "max": 4})
    children = render_children(svc, 3)
    deployments = {o["metadata"]["name"]: o for o in children if o["kind"] == "Deployment"}
    assert {"chat-prefill", "chat-decode"} <= set(deployments) and "chat-replicas" not in deployments
    assert deployments["chat-prefill"]["spec"]["replicas"] == 2 and deployments["chat-decode"]["spec"]["replicas"] == 3
    assert [(pool.role, pool.deployment) for pool in scaled_pools(svc)] == [("decode", "chat-decode"),
                                                                             ("prefill", "chat-prefill")]
    for pool in ("prefill", "decode"):
        spec = deployments[f"chat-{pool}"]["spec"]
        assert spec["selector"]["matchLabels"][naming.POOL_LABEL] == pool
        labels = spec["template"]["metadata"]["labels"]
        assert labels[naming.POOL_LABEL] == pool and labels["app.kubernetes.io/component"] == "replica"
        container = spec["template"]["spec"]["containers"][0]
        options = options_from_args(make_parser().parse_args(container["args"]))
        assert options.role == pool and options.engine_args["kv_transfer_listen"] == "0.0.0.0:5600"
        assert {"name": "PAGODA_ADVERTISE_HOST", "value": "$(PAGODA_POD_IP)"} in container["env"]
        pod = {"metadata": {"name": f"{pool}-0", "labels": labels},
               "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
               "spec": {"containers": [container]}}
        assert pod_to_member(pod)[1]["role"] == pool
    [policy] = [o for o in children if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "chat-replicas"]
    assert any(rule.get("ports") == [{"protocol": "TCP", "port": 5600}] for rule in policy["spec"]["ingress"])
    assert ("apps/v1", "Deployment", "chat-replicas") in stale_children(svc)
    assert ("apps/v1", "Deployment", "chat-prefill") in stale_children(make_svc())
    for bad, field in [({"mode": "KServe", "disaggregation": {}}, "spec.disaggregation"),
                       ({"disaggregation": {"kvTransferPort": 8001}}, "spec.disaggregation.kvTransferPort"),
                       ({"disaggregation": {"prefillReplicas": 0}}, "spec.disaggregation.prefillReplicas")]:
        mode = bad.pop("mode", "Deployment")
        with pytest.raises(SpecError) as info:
            make_svc(mode, **bad)
        assert info.value.field == field, str(info.value)
