"""`spec.parallelism`: how many GPUs and nodes one replica spans. Schema, rules, pod settings.

A replica is one engine (one scheduler, one sampler) whose model is split over
`tensor * pipeline` ranks (`pagoda serve --tensor-parallel-size T --pipeline-parallel-size P`,
docs/parallelism.md): P pipeline stages of T tensor-parallel ranks each, spread evenly over
`nodes` pods, `tensor * pipeline / nodes` GPUs each:

- `nodes: 1` (the default): the replica pod asks for `nvidia.com/gpu: tensor * pipeline` and
  runs `pagoda serve --tensor-parallel-size T [--pipeline-parallel-size P]`; its Deployment is
  as without parallelism.
- `nodes > 1` (mode Deployment): one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) whose
  `replicas` are the replica groups and whose `size` is `nodes` (render_groups.py). The
  leader pod runs tritonserver and ranks 0..L-1 (L = tensor * pipeline / nodes); worker pod i
  runs ranks i*L..(i+1)*L-1 with `pagoda serve --nodes M --node-rank i --leader-address
  $(LWS_LEADER_ADDRESS):29500`, joining the leader's torch.distributed store.
  Mode KServeLLM renders the same split as KServe's `worker` template (render_llmisvc.py).

Stages to nodes: the engine numbers world rank r as stage r // T, tensor index r % T, and
puts ranks on nodes in order, so with `pipeline > 1` each node holds `pipeline / nodes` whole
stages and a stage's tensor-parallel all-reduces stay inside one node (NVLink); only the
stage hand-overs cross nodes. This is the layout vLLM and llm-d use (PP across nodes, TP
within a node); `pipeline: nodes` gives one stage per node. A stage cut across nodes
(tensor parallelism across nodes under PP) is refused; with `pipeline: 1` tensor parallelism
across nodes stays allowed, as before.

Without `spec.parallelism` nothing is added to the pods (no GPU request), as before.

Rules (each failure names its field, spec.py raises it as a SpecError):
- `tensor`, `pipeline` and `nodes` are integers >= 1 (schema); with `pipeline: 1`, `tensor`
  is a multiple of `nodes`; with `pipeline > 1` and `nodes > 1`, `pipeline` is a multiple
  of `nodes` (whole stages per node);
- `nodes > 1` needs mode Deployment or KServeLLM (KServe's InferenceService has no
  multi-node path pagoda's engine speaks) and no `spec.disaggregation` (pools of groups
  are not built);
- a GPU count in `spec.resources` must equal `tensor * pipeline / nodes`, and the flags
  this module renders must not also be in `spec.engine.extraArgs`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
STORE_PORT = 29500  # the leader's torch.distributed store (torch's default MASTER_PORT)
MAX_TENSOR = 1024
MAX_PIPELINE = 256
MAX_NODES = 128
RENDERED_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--nodes", "--node-rank", "--leader-address")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "GPUs and nodes of one replica. tensor: tensor-parallel ranks of each pipeline stage "
                   "(`pagoda serve --tensor-parallel-size`); pipeline: stages the layers are cut into "
                   "(`--pipeline-parallel-size`); nodes: pods the replica spans, tensor*pipeline/nodes GPUs "
                   "each, whole stages per pod when pipeline > 1 (nodes > 1: a LeaderWorkerSet group per "
                   "replica, mode Deployment; KServe's worker template, mode KServeLLM). Unset: no GPU "
                   "request is added.",
    "properties": {
        "tensor": {"type": "integer", "format": "int32", "minimum": 1, "maximum": MAX_TENSOR, "default": 1,
                   "description": "Tensor-parallel ranks (GPUs) of each pipeline stage."},
        "pipeline": {"type": "integer", "format": "int32", "minimum": 1, "maximum": MAX_PIPELINE, "default": 1,
                     "description": "Pipeline stages of one replica, each `tensor` GPUs; with nodes > 1 a "
                                    "multiple of nodes (a stage never spans nodes)."},
        "nodes": {"type": "integer", "format": "int32", "minimum": 1, "maximum": MAX_NODES, "default": 1,
                  "description": "Pods (nodes) one replica spans; tensor (pipeline > 1: pipeline) must be a "
                                 "multiple of it."},
    },
    "x-kubernetes-validations": [
        {"rule": "self.pipeline > 1 || self.tensor % self.nodes == 0",
         "message": "parallelism.tensor must be a multiple of parallelism.nodes"},
        {"rule": "self.pipeline == 1 || self.nodes == 1 || self.pipeline % self.nodes == 0",
         "message": "parallelism.pipeline must be a multiple of parallelism.nodes (whole stages per node)"},
    ],
}


@dataclass(frozen=True)
class ParallelismSpec:
    tensor: int = 1
    pipeline: int = 1
    nodes: int = 1

    @property
    def num_ranks(self) -> int:
        return self.tensor * self.pipeline

    @property
    def gpus_per_pod(self) -> int:
        return self.num_ranks // self.nodes

    @property
    def is_stage_per_node(self) -> bool:
        """Several nodes, one pipeline stage (its `tensor` ranks) on each."""
        return self.is_multi_node and self.pipeline == self.nodes

    @property
    def is_multi_node(self) -> bool:
        return self.nodes > 1


def check(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """The rules of the module docstring over a defaulted raw spec: (field, message) of the
    first broken one, or [] when they hold."""
    raw = spec.get("parallelism")
    if raw is None:
        return []
    tensor, pipeline, nodes = raw["tensor"], raw["pipeline"], raw["nodes"]
    if pipeline > 1 and pipeline % nodes:
        return [("spec.parallelism.pipeline", f"{pipeline} stages over spec.parallelism.nodes {nodes} would cut a "
                                              "stage across nodes (tensor parallelism across nodes under pipeline "
                                              "parallelism); pipeline must be a multiple of nodes")]
    if pipeline == 1 and tensor % nodes:
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
        per_pod = tensor * pipeline // nodes
        if gpus is not None and str(gpus) != str(per_pod):
            return [(f"spec.resources.{part}.{GPU_RESOURCE}",
                     f"{gpus} disagrees with spec.parallelism: tensor*pipeline/nodes = {per_pod} GPUs per pod "
                     f"(leave it out; the operator sets it)")]
    for arg in spec["engine"].get("extraArgs", []):
        if arg.split("=", 1)[0] in RENDERED_FLAGS:
            return [("spec.engine.extraArgs", f"{arg.split('=', 1)[0]} comes from spec.parallelism; remove it")]
    return []


def parse(raw: dict[str, Any] | None) -> ParallelismSpec | None:
    return None if raw is None else ParallelismSpec(tensor=raw["tensor"], pipeline=raw["pipeline"], nodes=raw["nodes"])


def pod_resources(resources: dict[str, Any], parallelism: ParallelismSpec | None) -> dict[str, Any]:
    """One pod's container resources: `resources` with `nvidia.com/gpu: tensor*pipeline/nodes` in its limits
    (the API server copies an extended resource's limit to its request)."""
    resources = copy.deepcopy(resources)
    if parallelism is not None:
        resources.setdefault("limits", {})[GPU_RESOURCE] = parallelism.gpus_per_pod
    return resources


def serve_args(parallelism: ParallelismSpec | None, node_rank: str = "0") -> list[str]:
    """`pagoda serve` flags of one pod: `--tensor-parallel-size` (and `--pipeline-parallel-size` past
    one stage), and with several nodes this pod's place in the group (LWS gives every pod
    `LWS_LEADER_ADDRESS`; the kubelet expands `$(VAR)`)."""
    if parallelism is None or parallelism.num_ranks == 1 and parallelism.nodes == 1:
        return []
    args = ["--tensor-parallel-size", str(parallelism.tensor)]
    if parallelism.pipeline > 1:
        args += ["--pipeline-parallel-size", str(parallelism.pipeline)]
    if parallelism.is_multi_node:
        args += ["--nodes", str(parallelism.nodes), "--node-rank", node_rank,
                 "--leader-address", f"$(LWS_LEADER_ADDRESS):{STORE_PORT}"]
    return args
