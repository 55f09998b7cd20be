"""spec.parallelism: the single-node Deployment asks for `tensor * pipeline` GPUs, multi-node
replicas are a LeaderWorkerSet valid against LWS's own CRD (tests/data/lws) whose pods hold
whole pipeline stages, every rendered flag is one `pagoda serve` accepts, and bad specs are
refused naming the field."""

from __future__ import annotations

import re

import pytest

from pagoda.serving.launch.serve_flags import make_parser
from pagoda_operator import naming
from pagoda_operator.pools import scaled_pools
from pagoda_operator.reconcile import render_children, stale_children
from pagoda_operator.render_router import replica_selector
from pagoda_operator.spec import SpecError, parse_llmservice
from tests.crd_schema import lws_errors


def body(**spec):
    base = {"image": "pagoda:1", "model": {"name": "chat", "storageUri": "pvc://models/llama-70b"},
            "replicas": {"min": 1, "max": 4}}
    base.update(spec)
    return {"metadata": {"name": "chat", "namespace": "llm", "uid": "u1"}, "spec": base}


def by_kind(children: list[dict]) -> dict[str, dict]:
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels + In expressions) against pod labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's `$(VAR)` expansion of container arguments."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]


@pytest.mark.parametrize("split, tensor, pipeline", [
    ({"tensor": 4}, 4, 1), ({"tensor": 2, "pipeline": 2}, 2, 2), ({"pipeline": 3}, 1, 3)])
def test_one_node_asks_for_tensor_times_pipeline_gpus_and_passes_the_sizes(split, tensor, pipeline):
    svc = parse_llmservice(body(parallelism=split, resources={"limits": {"memory": "64Gi"}}))
    children = by_kind(render_children(svc, 2))
    pod = children["Deployment/chat-replicas"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"] == {"limits": {"memory": "64Gi", "nvidia.com/gpu": tensor * pipeline}}
    args = make_parser().parse_args(container["args"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size or 1, args.nodes) == (tensor, pipeline, 1)
    assert "LeaderWorkerSet/chat-group" not in children
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(children["Deployment/chat-replicas"], "1.30.0", strict=True)
    no_split = parse_llmservice(body())  # without spec.parallelism: no GPU request, as before
    deployment = by_kind(render_children(no_split, 1))["Deployment/chat-replicas"]
    [plain] = deployment["spec"]["template"]["spec"]["containers"]
    assert "resources" not in plain and "--tensor-parallel-size" not in plain["args"]


def test_several_nodes_render_a_leader_worker_set_valid_against_its_crd():
    svc = parse_llmservice(body(parallelism={"tensor": 16, "nodes": 2}))
    children = by_kind(render_children(svc, 3))
    lws = children["LeaderWorkerSet/chat-group"]
    assert lws_errors(lws) == []
    assert "Deployment/chat-replicas" not in children
    spec, template = lws["spec"], lws["spec"]["leaderWorkerTemplate"]
    assert spec["replicas"] == 3 and template["size"] == 2  # replicas are groups of 2 pods
    assert spec["startupPolicy"] == "LeaderCreated" and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    # As the kubelet expands the env LWS injects into group 0's pods (worker 1):
    lws_env = {"LWS_LEADER_ADDRESS": "chat-group-0.chat-group.llm", "LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"}
    lead, work = (make_parser().parse_args(expand(c["args"], lws_env)) for c in (leader, worker))
    assert (lead.tensor_parallel_size, lead.nodes, lead.node_rank) == (16, 2, 0)
    assert (work.tensor_parallel_size, work.nodes, work.node_rank) == (16, 2, 1)
    assert lead.leader_address == work.leader_address == "chat-group-0.chat-group.llm:29500"
    assert {"name": "tp-store", "containerPort": 29500, "protocol": "TCP"} in leader["ports"]
    # Only the leader serves and registers: workers get no Redis settings, no ports, no probes.
    leader_env, worker_env = {e["name"] for e in leader["env"]}, {e["name"] for e in worker["env"]}
    assert {"PAGODA_REDIS_URL", "PAGODA_REPLICA_ID"} <= leader_env
    assert not {"PAGODA_REDIS_URL", "PAGODA_REPLICA_ID", "PAGODA_MODEL_NAME"} & worker_env
    assert not {"ports", "readinessProbe", "livenessProbe"} & set(worker)
    # Router, headless Service and autoscaler select leaders only; the policy and budget cover all.
    leader_labels = template["leaderTemplate"]["metadata"]["labels"]
    worker_labels = template["workerTemplate"]["metadata"]["labels"]
    for selector in ({"matchLabels": replica_selector(svc)},
                     {"matchLabels": children["Service/chat-replicas"]["spec"]["selector"]},
                     {"matchLabels": scaled_pools(svc)[0].selector}):
        assert matches(selector, leader_labels) and not matches(selector, worker_labels)
    policy, budget = children["NetworkPolicy/chat-replicas"]["spec"], children["PodDisruptionBudget/chat-replicas"]
    for selector in (policy["podSelector"], budget["spec"]["selector"]):
        assert matches(selector, leader_labels) and matches(selector, worker_labels)
    assert {"from": [{"podSelector": policy["podSelector"]}]} in policy["ingress"]  # ranks reach each other
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for name in ("NetworkPolicy/chat-replicas", "PodDisruptionBudget/chat-replicas", "Service/chat-replicas"):
        kubernetes_validate.validate(children[name], "1.30.0", strict=True)


@pytest.mark.parametrize("tensor, pipeline, nodes", [(8, 2, 2), (4, 4, 2), (2, 3, 3)])
def test_pipeline_stages_map_to_nodes_whole(tensor, pipeline, nodes):
    """Across nodes, each pod runs `tensor * pipeline / nodes` ranks (its GPU limit) with the sizes
    the engine accepts, and, as the engine places rank r (stage r // tensor) on node r // L, every
    stage's tensor-parallel ranks are on one node: only stage hand-overs cross nodes."""
    from pagoda.engine.config import EngineConfig

    svc = parse_llmservice(body(parallelism={"tensor": tensor, "pipeline": pipeline, "nodes": nodes}))
    lws = by_kind(render_children(svc, 1))["LeaderWorkerSet/chat-group"]
    assert lws_errors(lws) == [] and lws["spec"]["leaderWorkerTemplate"]["size"] == nodes
    template = lws["spec"]["leaderWorkerTemplate"]
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    node_of_rank = {}
    for node_rank in range(nodes):
        container = leader if node_rank == 0 else worker
        env = {"LWS_LEADER_ADDRESS": "chat-group-0.chat-group.llm", "LWS_WORKER_INDEX": str(node_rank)}
        args = make_parser().parse_args(expand(container["args"], env))
        assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.nodes, args.node_rank) == (
            tensor, pipeline, nodes, node_rank)
        per_node = container["resources"]["limits"]["nvidia.com/gpu"]
        assert per_node * nodes == tensor * pipeline
        node_of_rank |= {rank: node_rank for rank in range(node_rank * per_node, (node_rank + 1) * per_node)}
        EngineConfig(tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, tensor_parallel_nodes=nodes,
                     tensor_parallel_leader=args.leader_address)
    stages = {stage: {node_of_rank[rank] for rank in range(stage * tensor, (stage + 1) * tensor)}
              for stage in range(pipeline)}
    assert all(len(on) == 1 for on in stages.values()), stages
    assert sorted(node_of_rank) == list(range(tensor * pipeline))


def test_switching_between_one_and_several_nodes_deletes_the_other_workload():
    stale_multi = {(kind, name) for _, kind, name in stale_children(parse_llmservice(body(
        parallelism={"tensor": 4, "nodes": 2})))}
    stale_single = {(kind, name) for _, kind, name in stale_children(parse_llmservice(body(
        parallelism={"tensor": 4})))}
    assert ("Deployment", "chat-replicas") in stale_multi and ("LeaderWorkerSet", "chat-group") not in stale_multi
    assert ("LeaderWorkerSet", "chat-group") in stale_single and ("Deployment", "chat-replicas") not in stale_single
    [pool] = scaled_pools(parse_llmservice(body(parallelism={"tensor": 4, "nodes": 2})))
    assert (pool.kind, pool.deployment, pool.is_group_set) == ("LeaderWorkerSet", naming.group_set_name(
        parse_llmservice(body())), True)


@pytest.mark.parametrize("spec, field", [
    ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
    ({"parallelism": {"tensor": 6, "nodes": 4}}, "spec.parallelism.tensor"),
    ({"parallelism": {"tensor": 2, "gpus": 2}}, "spec.parallelism.gpus"),
    ({"parallelism": {"tensor": "2"}}, "spec.parallelism.tensor"),
    ({"parallelism": {"tensor": 4, "nodes": 2}, "mode": "KServe",
      "model": {"name": "chat", "storageUri": "s3://b/m"}}, "spec.parallelism.nodes"),
    ({"parallelism": {"tensor": 4, "nodes": 2}, "disaggregation": {}}, "spec.parallelism.nodes"),
    ({"parallelism": {"tensor": 4}, "resources": {"limits": {"nvidia.com/gpu": 2}}},
     "spec.resources.limits.nvidia.com/gpu"),
    ({"parallelism": {"tensor": 2}, "engine": {"extraArgs": ["--tensor-parallel-size=4"]}}, "spec.engine.extraArgs"),
    ({"parallelism": {"pipeline": 0}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"pipeline": 2.5}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"tensor": 8, "pipeline": 2, "nodes": 4}}, "spec.parallelism.pipeline"),  # a stage over 2 nodes
    ({"parallelism": {"tensor": 4, "pipeline": 3, "nodes": 2}}, "spec.parallelism.pipeline"),
    ({"parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"limits": {"nvidia.com/gpu": 2}}},
     "spec.resources.limits.nvidia.com/gpu"),
    ({"parallelism": {"pipeline": 2}, "engine": {"extraArgs": ["--pipeline-parallel-size", "2"]}},
     "spec.engine.extraArgs"),
])
def test_bad_parallelism_is_refused_naming_the_field(spec, field):
    with pytest.raises(SpecError) as error:
        parse_llmservice(body(**spec))
    assert error.value.field == field, str(error.value)
