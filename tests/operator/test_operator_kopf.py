"""The operator under kopf against an emulated API server (kmock): reconcile + autoscale."""

from __future__ import annotations

import pytest

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from operator_harness import (DEPLOYMENTS, LLMS, NS, PODS, FakeClock,  # noqa: E402
                              FakeDeploymentController, FakeFleet, FakeLeaderWorkerSetController, Operator,
                              wait_for)

from pagoda_operator import crd  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def llmservice(name: str, **spec) -> dict:
    body = {"image": "pagoda:0.1", "model": {"name": "smollm2", "storageUri": "pvc://models/smollm2"}}
    body.update(spec)
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": NS}, "spec": body}


def children(cluster, name: str) -> dict[str, dict | None]:
    paths = {
        "Deployment/replicas": f"{DEPLOYMENTS}/{name}-replicas",
        "Deployment/router": f"{DEPLOYMENTS}/{name}-router",
        "Service/replicas": f"/api/v1/namespaces/{NS}/services/{name}-replicas",
        "Service/router": f"/api/v1/namespaces/{NS}/services/{name}",
        "ServiceAccount": f"/api/v1/namespaces/{NS}/serviceaccounts/{name}-router",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/{name}-router",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/{name}-router",
    }
    return {kind: cluster.get(path) for kind, path in paths.items()}


def condition(body: dict, type_: str) -> dict | None:
    for item in (body.get("status") or {}).get("conditions", []):
        if item["type"] == type_:
            return item
    return None


def test_create_renders_children_with_owner_refs_then_updates(cluster):
    with Operator(cluster):
        owner = cluster.create(LLMS, llmservice("chat", replicas={"min": 2, "max": 4}))
        found = wait_for(lambda: all(children(cluster, "chat").values()) and
                         children(cluster, "chat"), what="children")
        for kind, child in found.items():
            refs = child["metadata"].get("ownerReferences", [])
            assert refs == [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "chat",
                             "uid": owner["metadata"]["uid"], "controller": True,
                             "blockOwnerDeletion": True}], kind
        assert found["Deployment/replicas"]["spec"]["replicas"] == 2
        body = wait_for(lambda: condition(cluster.get(f"{LLMS}/chat"), "SpecValid")
                        and cluster.get(f"{LLMS}/chat"), what="status")
        assert condition(body, "SpecValid")["status"] == "True"
        assert body["status"]["replicas"]["desired"] == 2

        cluster.patch(f"{LLMS}/chat", {"spec": {"image": "pagoda:0.2",
                                                "replicas": {"min": 3, "max": 5}}})

        def updated():
            dep = cluster.get(f"{DEPLOYMENTS}/chat-replicas")
            router = cluster.get(f"{DEPLOYMENTS}/chat-router")
            image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
            router_image = router["spec"]["template"]["spec"]["containers"][0]["image"]
            return (image, router_image, dep["spec"]["replicas"]) == ("pagoda:0.2", "pagoda:0.2", 3)
        wait_for(updated, what="image and replicas update")
        assert cluster.events("Reconciled")


def test_invalid_spec_sets_condition_naming_the_field(cluster):
    with Operator(cluster):
        cluster.create(LLMS, llmservice("bad-bounds", replicas={"min": 3, "max": 2}))
        cluster.create(LLMS, llmservice("bad-field", engine={"maxNumSeq": 8}))
        for name, field in (("bad-bounds", "spec.replicas.min"),
                            ("bad-field", "spec.engine.maxNumSeq")):
            cond = wait_for(lambda: condition(cluster.get(f"{LLMS}/{name}"), "SpecValid"),
                            what=f"{name} condition")
            assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
            assert field in cond["message"]
            assert cluster.get(f"{DEPLOYMENTS}/{name}-replicas") is None
        assert {e["reason"] for e in cluster.events()} >= {"InvalidSpec"}


def test_restart_resumes_without_writes(cluster):
    with Operator(cluster):
        cluster.create(LLMS, llmservice("steady"))
        wait_for(lambda: all(children(cluster, "steady").values()), what="children")
        wait_for(lambda: condition(cluster.get(f"{LLMS}/steady"), "SpecValid"), what="status")
    before = cluster.count_writes("steady-")
    reconciles = cluster.status_patches("steady", "conditions")
    with Operator(cluster):
        # The resume handler writes status (conditions) after applying the children.
        wait_for(lambda: cluster.status_patches("steady", "conditions") > reconciles,
                 what="resume handler")
    assert cluster.count_writes("steady-") == before


def test_kserve_mode_renders_inference_service(cluster):
    with Operator(cluster):
        owner = cluster.create(LLMS, llmservice(
            "kchat", mode="KServe", model={"name": "smollm2", "storageUri": "hf://org/model"}))
        isvc_path = f"/apis/serving.kserve.io/v1beta1/namespaces/{NS}/inferenceservices/kchat"
        isvc = wait_for(lambda: cluster.get(isvc_path), what="InferenceService")
        assert isvc["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        assert isvc["spec"]["predictor"]["model"]["runtime"] == "pagoda"
        router = wait_for(lambda: cluster.get(f"{DEPLOYMENTS}/kchat-router"), what="router")
        assert "serving.kserve.io/inferenceservice=kchat" in \
            router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert cluster.get(f"{DEPLOYMENTS}/kchat-replicas") is None


def test_autoscaler_scales_up_then_down_after_window_draining_first(cluster):
    fleet, clock = FakeFleet(), FakeClock()
    busy = {"waiting": 20.0, "running": 8.0, "kv_usage": 0.9, "ts": 0.0}
    controller = FakeDeploymentController(cluster, fleet, "auto-replicas",
                                          on_new_pod=lambda name: fleet.set_load(name, **busy))
    spec = dict(replicas={"min": 1, "max": 3},
                autoscaling={"scaleDownStabilizationSeconds": 60, "drainTimeoutSeconds": 600})
    with Operator(cluster, fleet=fleet, clock=clock, interval=0.1) as operator:
        cluster.create(LLMS, llmservice("auto", **spec))
        step = controller.step
        # Synthetic load far above target: scale up, fast, but never above max.
        wait_for(lambda: controller.replica_history[-1:] == [3], step=step,
                 what=lambda: f"scale up: {controller.replica_history} {cluster.events()}")
        for _ in range(10):
            step()
        assert max(controller.replica_history) == 3
        assert cluster.events("ScaledUp")

        # Load drops. Inside the scale-down window nothing is removed.
        for name in list(fleet.loads):
            fleet.set_load(name, waiting=0.0, running=2.0, kv_usage=0.05)
        clock.advance(30)
        for _ in range(20):
            step()
        assert controller.replica_history[-1] == 3 and not fleet.draining

        # After the window: one replica is drained (not yet removed while it has work).
        clock.advance(40)
        victim = wait_for(lambda: fleet.draining and fleet.draining[0], step=step,
                          what="drain start")
        for _ in range(10):
            step()
        assert controller.replica_history[-1] == 3, "removed before its requests finished"
        status = cluster.get(f"{LLMS}/auto")["status"]
        assert status["drain"]["replicaId"] == victim

        # Its in-flight requests finish: it is removed, and it is the one removed.
        fleet.set_load(victim, waiting=0.0, running=0.0, kv_usage=0.05)
        wait_for(lambda: controller.replica_history[-1] == 2, step=step, what="scale down")
        assert controller.removed[0] == {"name": victim, "draining": True, "running": 0.0}
        wait_for(lambda: victim in fleet.forgotten, step=step, what="index cleanup")

        # Keep going: every removal drained first, and never below min.
        for name in list(fleet.loads):
            fleet.set_load(name, waiting=0.0, running=0.0, kv_usage=0.05)
        clock.advance(120)
        wait_for(lambda: controller.replica_history[-1] == 1, step=step, timeout=20,
                 what="scale down to min")
        clock.advance(600)
        for _ in range(20):
            step()
        assert controller.replica_history[-1] == 1
        assert all(1 <= n <= 3 for n in controller.replica_history)
        assert all(r["draining"] and r["running"] == 0.0 for r in controller.removed), \
            (controller.removed, [e["message"] for e in cluster.events()], fleet.draining)
        assert {"Draining", "ScaledDown"} <= {e["reason"] for e in cluster.events()}
        status = cluster.get(f"{LLMS}/auto")["status"]
        assert status["lastDecision"]["to"] == 1 and status["observedLoad"]["source"] == "redis"
        # The operator's /metrics (pagoda_operator.metrics) counts the same decisions as its events.
        pool = 'namespace="default",llmservice="auto",pool="replicas"'
        series = operator_series(operator.memo.metrics.render())
        scaled_up = series[f'pagoda_operator_scaling_events_total{{{pool},direction="up"}}']
        assert scaled_up == len(cluster.events("ScaledUp")) >= 1
        assert series[f'pagoda_operator_scaling_events_total{{{pool},direction="down"}}'] == \
            len(cluster.events("ScaledDown")) == 2
        assert series[f"pagoda_operator_drains_total{{{pool}}}"] == len(cluster.events("Draining")) == 2
        assert series[f'pagoda_operator_replicas{{{pool},state="desired"}}'] == 1
        assert series[f"pagoda_operator_draining{{{pool}}}"] == 0
        assert series['pagoda_operator_autoscale_ticks_total{namespace="default",llmservice="auto",outcome="ok"}'] > 10


def operator_series(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_prefill_and_decode_pools_scale_independently_each_on_its_own_signal(cluster):
    """spec.disaggregation under kopf: the prefill pool grows on its queue and TTFT while the
    decode pool (KV usage on target) stays; then the decode pool grows on inter-token latency
    while the idle prefill pool drains one pod and removes exactly it once idle. Each pool has
    its own status (status.prefill for the prefill pool) and its own drain."""
    fleet, clock = FakeFleet(), FakeClock()
    profile = {"pd-prefill": {"waiting": 6.0, "running": 2.0, "kv_usage": 0.99, "ttft_p90": 3.0},
               "pd-decode": {"waiting": 0.0, "running": 4.0, "kv_usage": 0.8}}
    controllers = [FakeDeploymentController(cluster, fleet, name, on_new_pod=lambda pod, name=name:
                                            fleet.set_load(pod, **profile[name])) for name in profile]
    prefill, decode = controllers

    def step():
        for controller in controllers:
            controller.step()

    def set_pool(name: str, **load: float) -> None:
        profile[name] = load
        for pod in [p for p in list(fleet.loads) if p.startswith(name)]:
            fleet.set_load(pod, **load)

    spec = dict(replicas={"min": 1, "max": 3},
                autoscaling={"itlSLOSeconds": 0.1, "scaleDownStabilizationSeconds": 600},
                disaggregation={"prefill": {"replicas": {"min": 1, "max": 3},
                                            "autoscaling": {"ttftSLOSeconds": 1.0,
                                                           "scaleDownStabilizationSeconds": 60}}})
    with Operator(cluster, fleet=fleet, clock=clock, interval=0.1):
        cluster.create(LLMS, llmservice("pd", **spec))
        # Prefill pressure (6 waiting per pod vs 2, TTFT 3x its SLO): only the prefill pool grows.
        wait_for(lambda: prefill.replica_history[-1:] == [3], step=step,
                 what=lambda: f"prefill scale-up: {prefill.replica_history} {decode.replica_history}")
        for _ in range(10):
            step()
        assert decode.replica_history == [1] and max(prefill.replica_history) == 3
        status = wait_for(lambda: (cluster.get(f"{LLMS}/pd")["status"].get("prefill") or {}).get("lastDecision")
                          and cluster.get(f"{LLMS}/pd")["status"], step=step, what="status.prefill")
        assert status["prefill"]["lastDecision"]["to"] == 3 and status["prefill"]["replicas"]["desired"] == 3
        assert status["prefill"]["observedLoad"]["ttftP90Seconds"] == 3.0
        assert status["replicas"]["desired"] == 1 and "lastDecision" not in status  # the decode pool's
        assert any(e["message"].startswith("prefill pool: 1 -> 3") for e in cluster.events("ScaledUp"))

        # The reverse: decode streams stall (ITL P90 3x its SLO) and prefill goes quiet.
        set_pool("pd-prefill", waiting=0.0, running=1.0, kv_usage=0.99, ttft_p90=0.2)
        set_pool("pd-decode", waiting=0.0, running=4.0, kv_usage=0.8, itl_p90=0.3)
        wait_for(lambda: decode.replica_history[-1:] == [3], step=step,
                 what=lambda: f"decode scale-up: {decode.replica_history} {cluster.events()}")
        assert prefill.replica_history[-1] == 3 and not fleet.draining  # inside its scale-down window
        assert any(p.startswith("pd-decode") for p in fleet.itl_reads)
        assert not any(p.startswith("pd-prefill") for p in fleet.itl_reads)  # no ITL SLO: no scrape

        # After the prefill pool's window: it drains one of its own pods, removed only once idle.
        clock.advance(70)
        victim = wait_for(lambda: fleet.draining and fleet.draining[0], step=step, what="prefill drain")
        assert victim.startswith("pd-prefill")
        for _ in range(10):
            step()
        assert prefill.replica_history[-1] == 3
        status = cluster.get(f"{LLMS}/pd")["status"]
        assert status["prefill"]["drain"]["replicaId"] == victim and not status.get("drain")
        fleet.set_load(victim, waiting=0.0, running=0.0, kv_usage=0.99)
        wait_for(lambda: prefill.replica_history[-1] == 2, step=step, what="prefill scale-down")
        assert prefill.removed[0] == {"name": victim, "draining": True, "running": 0.0}
        wait_for(lambda: victim in fleet.forgotten, step=step, what="index cleanup")
        assert decode.replica_history[-1] == 3 and not decode.removed
        assert all(name.startswith("pd-prefill") for name in fleet.draining)


def test_multi_node_replicas_scale_by_whole_groups_and_drain_the_last_group(cluster):
    """spec.parallelism.nodes = 2 under kopf: the replicas are a LeaderWorkerSet's groups. Load
    grows it from 1 to 2 groups (4 pods); only leaders are read for load (workers never report);
    a scale-in drains the last group's leader — not the least loaded one, because the
    LeaderWorkerSet removes the highest-numbered group — and removes that whole group only
    once its leader is idle."""
    fleet, clock = FakeFleet(), FakeClock()
    groups = FakeLeaderWorkerSetController(cluster, fleet, "big-group", on_new_leader=lambda leader: fleet.set_load(
        leader, waiting=20.0, running=8.0, kv_usage=0.9))  # far above target: one more group
    step, history = groups.step, groups.replica_history
    with Operator(cluster, fleet=fleet, clock=clock, interval=0.1):
        cluster.create(LLMS, llmservice("big", parallelism={"tensor": 4, "nodes": 2}, replicas={"min": 1, "max": 2},
                                        autoscaling={"scaleDownStabilizationSeconds": 60}))
        wait_for(lambda: history[-1:] == [2], step=step, what=lambda: f"groups: {history} {cluster.events()}")
        for _ in range(5):
            step()
        pods = {p["metadata"]["name"] for p in cluster.items(PODS, "pagoda.dev/llmservice=big")}
        assert pods == {"big-group-0", "big-group-0-1", "big-group-1", "big-group-1-1"}
        assert fleet.read_pods <= {"big-group-0", "big-group-1"}, fleet.read_pods  # leaders only
        assert cluster.get(f"{DEPLOYMENTS}/big-replicas") is None
        status = wait_for(lambda: (cluster.get(f"{LLMS}/big")["status"].get("replicas") or {}).get("ready") == 2
                          and cluster.get(f"{LLMS}/big")["status"], step=step, what="ready groups")
        assert status["replicas"]["desired"] == 2

        # Load drops; group 0 is idle and group 1 still busy: the last group is drained anyway.
        fleet.set_load("big-group-0", waiting=0.0, running=0.0, kv_usage=0.05)
        fleet.set_load("big-group-1", waiting=0.0, running=1.0, kv_usage=0.05)
        clock.advance(70)
        victim = wait_for(lambda: fleet.draining and fleet.draining[0], step=step, what="group drain")
        assert victim == "big-group-1"
        for _ in range(10):
            step()
        assert history[-1] == 2 and not groups.removed, "removed before it was idle"
        fleet.set_load("big-group-1", waiting=0.0, running=0.0, kv_usage=0.05)
        wait_for(lambda: history[-1] == 1, step=step, what="group scale-down")
        assert sorted(r["name"] for r in groups.removed) == ["big-group-1", "big-group-1-1"]
        assert all(r["draining"] for r in groups.removed)
        wait_for(lambda: victim in fleet.forgotten, step=step, what="index cleanup")
        scaled_down = cluster.events("ScaledDown")
        assert any(e["message"].startswith("2 -> 1 replicas: drained big-group-1") for e in scaled_down)
