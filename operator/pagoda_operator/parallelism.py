"""`spec.parallelism`: how many GPUs and nodes one replica spans. Schema, rules, pod settings.

A replica is one engine (one scheduler, one sampler) whose model is split over `tensor`
ranks (`pagoda serve --tensor-parallel-size`, docs/parallelism.md), spread evenly over
`nodes` pods, `tensor / nodes` GPUs each:

- `nodes: 1` (the default): the replica pod asks for `nvidia.com/gpu: tensor` and runs
  `pagoda serve --tensor-parallel-size tensor`; its Deployment is as without parallelism.
- `nodes > 1` (mode Deployment): one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) whose
  `replicas` are the replica groups and whose `size` is `nodes` (render_groups.py). The
  leader pod runs tritonserver and ranks 0..L-1 (L = tensor / nodes); worker pod i runs
  ranks i*L..(i+1)*L-1 with `pagoda serve --nodes M --node-rank i --leader-address
  $(LWS_LEADER_ADDRESS):29500`, joining the leader's torch.distributed store.
  Mode KServeLLM renders the same split as KServe's `worker` template (render_llmisvc.py).

Without `spec.parallelism` nothing is added to the pods (no GPU request), as before.

Rules (each failure names its field, spec.py raises it as a SpecError):
- `tensor` and `nodes` are integers >= 1 (schema) and `tensor` is a multiple of `nodes`;
- `nodes > 1` needs mode Deployment or KServeLLM (KServe's InferenceService has no
  multi-node path pagoda's engine speaks) and no `spec.disaggregation` (pools of groups
  are not built);
- a GPU count in `spec.resources` must equal `tensor / nodes`, and
  `--tensor-parallel-size` must not also be in `spec.engine.extraArgs`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
STORE_PORT = 29500  # the leader's torch.distributed store (torch's default MASTER_PORT)
MAX_TENSOR = 1024
MAX_NODES = 128

SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "GPUs and nodes of one replica. tensor: tensor-parallel ranks of the replica's engine "
                   "(`pagoda serve --tensor-parallel-size`); nodes: pods the replica spans, tensor/nodes GPUs "
                   "each (nodes > 1: a LeaderWorkerSet group per replica, mode Deployment; KServe's worker "
                   "template, mode KServeLLM). Unset: no GPU request is added.",
    "properties": {
        "tensor": {"type": "integer", "format": "int32", "minimum": 1, "maximum": MAX_TENSOR, "default": 1,
                   "description": "Tensor-parallel ranks (GPUs) of one replica."},
        "nodes": {"type": "integer", "format": "int32", "minimum": 1, "maximum": MAX_NODES, "default": 1,
                  "description": "Pods (nodes) one replica spans; tensor must be a multiple of it."},
    },
    "x-kubernetes-validations": [{"rule": "self.tensor % self.nodes == 0",
                                  "message": "parallelism.tensor must be a multiple of parallelism.nodes"}],
}


@dataclass(frozen=True)
class ParallelismSpec:
    tensor: int = 1
    nodes: int = 1

    @property
    def gpus_per_pod(self) -> int:
        return self.tensor // self.nodes

    @property
    def is_multi_node(self) -> bool:
        return self.nodes > 1


def check(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """The rules of the module docstring over a defaulted raw spec: (field, message) of the
    first broken one, or [] when they hold."""
    raw = spec.get("parallelism")
    if raw is None:
        return []
    tensor, nodes = raw["tensor"], raw["nodes"]
    if tensor % nodes:
        return [("spec.parallelism.tensor", f"{tensor} is not a multiple of spec.parallelism.nodes {nodes} "
                                            "(each node holds tensor/nodes ranks)")]
    if nodes > 1 and spec["mode"] == "KServe":
        return [("spec.parallelism.nodes", "nodes > 1 needs mode Deployment (a LeaderWorkerSet per replica) or "
                                           "KServeLLM (KServe's worker template); KServe's InferenceService runs "
                                           "multi-node vLLM over Ray, which pagoda's engine does not speak")]
    if nodes > 1 and "disaggregation" in spec:
        return [("spec.parallelism.nodes", "nodes > 1 cannot be combined with spec.disaggregation yet "
                                           "(prefill and decode pools of multi-node groups are not built)")]
    for part in ("limits", "requests"):
        gpus = spec.get("resources", {}).get(part, {}).get(GPU_RESOURCE)
        if gpus is not None and str(gpus) != str(tensor // nodes):
            return [(f"spec.resources.{part}.{GPU_RESOURCE}",
                     f"{gpus} disagrees with spec.parallelism: tensor/nodes = {tensor // nodes} GPUs per pod "
                     f"(leave it out; the operator sets it)")]
    for arg in spec["engine"].get("extraArgs", []):
        if arg.split("=", 1)[0] in ("--tensor-parallel-size", "--nodes", "--node-rank", "--leader-address"):
            return [("spec.engine.extraArgs", f"{arg.split('=', 1)[0]} comes from spec.parallelism; remove it")]
    return []


def parse(raw: dict[str, Any] | None) -> ParallelismSpec | None:
    return None if raw is None else ParallelismSpec(tensor=raw["tensor"], nodes=raw["nodes"])


def pod_resources(resources: dict[str, Any], parallelism: ParallelismSpec | None) -> dict[str, Any]:
    """One pod's container resources: `resources` with `nvidia.com/gpu: tensor/nodes` in its limits
    (the API server copies an extended resource's limit to its request)."""
    resources = copy.deepcopy(resources)
    if parallelism is not None:
        resources.setdefault("limits", {})[GPU_RESOURCE] = parallelism.gpus_per_pod
    return resources


def serve_args(parallelism: ParallelismSpec | None, node_rank: str = "0") -> list[str]:
    """`pagoda serve` flags of one pod: `--tensor-parallel-size`, and with several nodes this pod's
    place in the group (LWS gives every pod `LWS_LEADER_ADDRESS`; the kubelet expands `$(VAR)`)."""
    if parallelism is None or parallelism.tensor == 1 and parallelism.nodes == 1:
        return []
    args = ["--tensor-parallel-size", str(parallelism.tensor)]
    if parallelism.is_multi_node:
        args += ["--nodes", str(parallelism.nodes), "--node-rank", node_rank,
                 "--leader-address", f"$(LWS_LEADER_ADDRESS):{STORE_PORT}"]
    return args
