"""The `LLMService` CustomResourceDefinition (group pagoda.dev, version v1alpha1).

This module is the single source of the CRD: the operator validates specs against
`SPEC_SCHEMA` (see `spec.py`), and `charts/pagoda/crds/llmservices.pagoda.dev.yaml` is
generated from `make_crd()` (`python -m pagoda_operator.crd > ...`; a test keeps them equal).

Invariants of the schema:
- the schema is structural and every object lists its properties (no
  `x-kubernetes-preserve-unknown-fields`), so the API server rejects or prunes unknown
  fields; `spec.py` applies the same rule and names the unknown field;
- every field that has a sensible default declares it, so a stored object is complete;
- cross-field rules the API server can check (replicas.min <= replicas.max) are CEL
  `x-kubernetes-validations`; the operator re-checks them (`spec.py`) and names the field.

The spec schema is here, built from `schema_nodes.py`'s helpers; `spec.parallelism`'s part
is in `parallelism.py` beside its rules, and the status schema (written only by the
operator) in `crd_status.py`.
"""

from __future__ import annotations

import sys
from typing import Any

from pagoda_operator import kv_tiers, parallelism
from pagoda_operator.crd_status import STATUS_SCHEMA
from pagoda_operator.schema_nodes import boolean, integer, number, obj, string

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
KIND = "LLMService"
PLURAL = "llmservices"
SINGULAR = "llmservice"
SHORT_NAMES = ["llms"]
API_VERSION = f"{GROUP}/{VERSION}"

ROUTING_POLICIES = ["prefix_aware", "precise", "approximate", "least_loaded", "round_robin"]
MODES = ["Deployment", "KServe", "KServeLLM"]
DEFAULT_REDIS_URL = "redis://pagoda-redis:6379/0"
DEFAULT_KSERVE_RUNTIME = "pagoda"
KSERVE_SCHEDULERS = ("pagoda", "llm-d")

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_SCHEMES = r"^(pvc|image|s3|gs|hf|https?)://.+$"


_QUANTITY_MAP = {
    "type": "object",
    "description": "Resource name (cpu, memory, nvidia.com/gpu, ...) to quantity.",
    "additionalProperties": {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        # Kubernetes' quantity: a signed decimal, then a binary (Ki..Ei) or decimal (n..E) suffix or an exponent.
        "pattern": (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"),
    },
}

def _scaling_knobs() -> dict[str, Any]:
    """Hysteresis, stabilization windows, step and drain timeout: the same for every autoscaled pool."""
    return {
        "tolerance": number("Hysteresis: ratios within 1 +/- tolerance do not scale.",
                          minimum=0, maximum=0.9, default=0.1),
        "scaleUpStabilizationSeconds": integer("Window whose lowest recommendation bounds a scale-up.",
                                            minimum=0, maximum=3600, default=0),
        "scaleDownStabilizationSeconds": integer("Window whose highest recommendation bounds a scale-down.",
                                              minimum=0, maximum=86400, default=300),
        "maxScaleUpStep": integer("Most replicas added in one decision.", minimum=1, maximum=1000, default=4),
        "drainTimeoutSeconds": integer("Longest wait for a draining replica's in-flight requests before it is "
                                    "removed anyway.", minimum=0, maximum=86400, default=600),
    }


SPEC_SCHEMA: dict[str, Any] = obj(
    {
        "mode": string("Deployment: the operator runs replica Deployments and autoscales them. "
                     "KServe: the operator renders an InferenceService (RawDeployment) "
                     "against the chart's ServingRuntime. KServeLLM: the operator renders a "
                     "KServe LLMInferenceService whose HTTPRoute sends traffic to the pagoda "
                     "router.", enum=MODES, default="Deployment"),
        "image": string("Container image holding pagoda (tritonserver + the model repository).",
                      minLength=1),
        "imagePullPolicy": string("Image pull policy.", enum=["Always", "IfNotPresent", "Never"],
                                default="IfNotPresent"),
        "terminationGracePeriodSeconds": integer(
            "How long a stopping replica may take: `pagoda serve` drains in-flight requests "
            "for this minus 10 s (its --grace-period), then the model unloads.",
            minimum=15, maximum=86400, default=60),
        "model": obj(
            {
                "name": string("Served model name: the OpenAI `model` id and the Redis namespace.",
                             pattern=_DNS_LABEL, minLength=1, maxLength=63),
                "storageUri": string(
                    "Where the weights are. pvc://<claim>[/<path>] (any mode), image:///<path> (baked into the "
                    "image, Deployment mode), s3:// gs:// hf:// https:// (KServe modes: their storage initializer).",
                    pattern=_SCHEMES),
                "loraAdapters": {
                    "type": "array", "maxItems": 64,
                    "description": "LoRA adapters (PEFT folders) every replica serves beside the base "
                                   "model; requests pick one by name (OpenAI `model`, Triton `lora_name`).",
                    "items": obj({
                        "name": string("Adapter name clients use.", pattern=_DNS_LABEL, minLength=1, maxLength=63),
                        "path": string("The adapter folder inside the replica container; a relative path "
                                     "is taken inside the model folder.", minLength=1, pattern=r"^[^,=\s]+$"),
                    }, required=["name", "path"], description="One adapter."),
                },
                "allowRuntimeLoRA": boolean(
                    "Let clients load and unload LoRA adapters at run time (the router's "
                    "/v1/load_lora_adapter and /v1/unload_lora_adapter, Triton lora_action control "
                    "requests): `--allow-runtime-lora` on the replicas and the router. Any caller the "
                    "router admits can then load a folder that exists inside the replica containers; "
                    "use API keys.", default=False),
            },
            required=["name", "storageUri"], description="The model to serve.",
        ),
        "engine": obj(
            {
                "dtype": string("Compute dtype.", enum=["auto", "float32", "float16", "bfloat16"],
                              default="auto"),
                "maxModelLen": integer("Longest sequence (prompt + output) in tokens; "
                                    "0 means the model's own limit.",
                                    minimum=0, maximum=1048576, default=0),
                "maxNumSeqs": integer("Most sequences in one batch.", minimum=1, maximum=4096,
                                   default=256),
                "maxNumBatchedTokens": integer("Token budget of one scheduler step.",
                                            minimum=16, maximum=1048576, default=8192),
                "blockSize": integer("Tokens per KV cache block.", enum=[8, 16, 32, 64, 128],
                                  default=16),
                "gpuMemoryUtilization": number("Fraction of GPU memory the engine may use.",
                                             minimum=0.05, maximum=1.0, default=0.9),
                "enablePrefixCaching": boolean("Reuse KV blocks across requests.", default=True),
                "maxWaitingRequests": integer("Admission control: past this many waiting requests a "
                                           "replica refuses new ones at once (overload error).",
                                           minimum=1, maximum=1048576, default=1024),
                "maxWaitingPromptTokens": integer("Admission control: past this many waiting prompt "
                                               "tokens a replica refuses new requests at once.",
                                               minimum=1, maximum=1073741824, default=1000000),
                "extraArgs": {"type": "array", "items": {"type": "string"}, "maxItems": 64,
                              "description": "Further `pagoda serve` arguments, appended as-is."},
            },
            description="Engine settings passed to `pagoda serve`.",
            default={},
        ),
        "resources": obj(
            {"requests": _QUANTITY_MAP, "limits": _QUANTITY_MAP},
            description="Compute resources of one replica container.",
        ),
        "parallelism": parallelism.SCHEMA,
        "kvCache": kv_tiers.SCHEMA,
        "replicas": obj(
            {
                "min": integer("Fewest replicas.", minimum=1, maximum=1000, default=1),
                "max": integer("Most replicas.", minimum=1, maximum=1000, default=1),
            },
            description="Replica count bounds (with spec.parallelism.nodes > 1: replica groups of `nodes` pods); "
                        "with autoscaling disabled, `min` replicas run.",
            default={},
            **{"x-kubernetes-validations": [
                {"rule": "self.min <= self.max", "message": "replicas.min must be <= replicas.max"}]},
        ),
        "autoscaling": obj(
            {
                "enabled": boolean("Run the built-in autoscaler (Deployment mode).", default=True),
                "targetWaitingPerReplica": number("Target queued (waiting) requests per replica.",
                                                minimum=0.1, maximum=10000, default=4),
                "targetKVCacheUsage": number("Target mean KV cache usage (0..1].",
                                             minimum=0.05, maximum=1.0, default=0.8),
                "ttftSLOSeconds": number("P90 time-to-first-token objective; 0 disables it.", minimum=0, maximum=3600,
                                       default=0),
                "itlSLOSeconds": number("P90 inter-token latency objective (read from the replicas' "
                                      "vllm:inter_token_latency_seconds histogram); 0 disables it.",
                                      minimum=0, maximum=600, default=0),
                **_scaling_knobs(),
            },
            description="Targets of the built-in autoscaler (the decode pool's with spec.disaggregation).",
            default={},
        ),
        "disaggregation": obj(
            {
                "prefillReplicas": integer("A fixed prefill pool of this many pods (the same as prefill.replicas "
                                        "min = max); set this or `prefill`, not both.", minimum=1, maximum=100),
                "prefill": obj(
                    {
                        "replicas": obj(
                            {"min": integer("Fewest prefill pods.", minimum=1, maximum=1000, default=1),
                             "max": integer("Most prefill pods.", minimum=1, maximum=1000, default=1)},
                            description="Prefill pool bounds; with autoscaling disabled, `min` pods run.",
                            default={},
                            **{"x-kubernetes-validations": [{"rule": "self.min <= self.max",
                                                             "message": "prefill.replicas.min must be <= max"}]}),
                        "autoscaling": obj(
                            {
                                "enabled": boolean("Autoscale the prefill pool (mode Deployment).", default=True),
                                "targetWaitingPerReplica": number("Target queued requests per prefill pod.",
                                                                minimum=0.1, maximum=10000, default=2),
                                "ttftSLOSeconds": number("P90 time-to-first-token objective of the prefill pods' "
                                                       "requests; 0 disables it.", minimum=0, maximum=3600,
                                                       default=0),
                                **_scaling_knobs(),
                            },
                            description="The prefill pool's own autoscaler: its queue and TTFT (not KV usage: "
                                        "a prefill pod's cache holds finished prompts until decode pods pull them).",
                            default={}),
                    },
                    description="The prefill pool, autoscaled on its own signal, apart from the decode pool.",
                ),
                "kvTransferPort": integer("Port of each pod's KV connector (`pagoda serve --kv-transfer-listen`); "
                                       "decode pods pull prompts' KV blocks from prefill pods on it.",
                                       minimum=1024, maximum=65535, default=5600),
            },
            description="Disaggregated prefill and decode (modes Deployment and KServeLLM): a prefill pool and a "
                        "decode pool (`pagoda serve --role`); the router runs each request's prefill on the first "
                        "and its decode on the second, which pulls the prompt's KV (docs/kv_transfer.md). The decode "
                        "pool is sized by spec.replicas and spec.autoscaling.",
            **{"x-kubernetes-validations": [{"rule": "!(has(self.prefillReplicas) && has(self.prefill))",
                                             "message": "set prefillReplicas or prefill, not both"}]},
        ),
        "kvEvents": obj(
            {
                "endpoint": string(
                    "ZMQ endpoint of the replicas' vLLM-format KV events (`--kv-events-config`): "
                    "tcp://*:PORT binds in each pod (subscribers connect to every pod; the port is "
                    "opened as `kv-events`), tcp://HOST:PORT connects to one subscriber (llm-d's "
                    "endpoint picker, Dynamo's or AIBrix's KV sync).",
                    pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$"),
                "topic": string("Message topic; unset: llm-d's kv@<pod-ip>:<openai port>@<model>.",
                              maxLength=253),
                "replayEndpoint": string("ZMQ ROUTER endpoint that answers replay requests after a "
                                       "subscriber missed messages (tcp://*:PORT); unset: none.",
                                       pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$"),
            },
            required=["endpoint"],
            description="Publish KV-cache events in vLLM's wire format (BlockStored/BlockRemoved/"
                        "AllBlocksCleared, msgpack over ZMQ) beside the Redis index, so fleets that "
                        "route by vLLM's events can route pagoda by cache. Deployment and KServe modes; "
                        "KServeLLM with the llm-d scheduler configures its own.",
        ),
        "routing": obj(
            {
                "policy": string("Router policy.", enum=ROUTING_POLICIES, default="prefix_aware"),
                "replicas": integer("Router pods.", minimum=1, maximum=100, default=1),
                "serviceType": string("Router Service type.",
                                    enum=["ClusterIP", "NodePort", "LoadBalancer"],
                                    default="ClusterIP"),
                "apiKeysSecretRef": obj(
                    {"name": string("Secret name.", minLength=1),
                     "key": string("Key in the Secret.", minLength=1, default="api-keys")},
                    required=["name"],
                    description="Secret whose key holds the router's API keys, lines "
                                "'KEY TENANT [rpm=N] [tpm=N] [concurrency=N]'; unset: open mode.",
                ),
                "routerSecretRef": obj(
                    {"name": string("Secret name.", minLength=1),
                     "key": string("Key in the Secret.", minLength=1, default="router-secret")},
                    required=["name"],
                    description="Secret whose key holds the routers' shared secret, the HMAC key of "
                                "tenant cache salts; unset: derived from the API keys (salts change with "
                                "the keys).",
                ),
            },
            description="The cache-aware router in front of the replicas.",
            default={},
        ),
        "redis": obj(
            {
                "url": string("Redis holding the prefix index and heartbeats.",
                            pattern=r"^rediss?://[^\s]+$", default=DEFAULT_REDIS_URL),
                "passwordSecretRef": obj(
                    {"name": string("Secret name.", minLength=1),
                     "key": string("Key in the Secret.", minLength=1, default="password")},
                    required=["name"],
                    description="Secret with the Redis password (same namespace).",
                ),
                "caSecretRef": obj(
                    {"name": string("Secret name.", minLength=1),
                     "key": string("Key in the Secret.", minLength=1, default="ca.crt")},
                    required=["name"],
                    description="With a rediss:// url: Secret holding the CA certificate that "
                                "signed Redis' server certificate (same namespace). It is mounted "
                                "into replicas and routers; the operator itself reads the CA its "
                                "chart mounted (values redis.tls).",
                ),
            },
            description="Redis used by replicas, router and autoscaler.",
            default={},
        ),
        "kserve": obj(
            {
                "runtime": string("ServingRuntime name (installed by the chart).",
                                pattern=_DNS_LABEL, default=DEFAULT_KSERVE_RUNTIME),
                "gateway": obj(
                    {"name": string("Gateway name.", pattern=_DNS_LABEL, minLength=1),
                     "namespace": string("Gateway namespace.", pattern=_DNS_LABEL)},
                    required=["name"],
                    description="Mode KServeLLM: the Gateway API Gateway the LLMInferenceService's "
                                "HTTPRoute attaches to (default: KServe's configured gateway)."),
                "scheduler": string("Mode KServeLLM: who picks the replica. pagoda: the pagoda router "
                                  "(the HTTPRoute sends everything to it). llm-d: KServe's managed "
                                  "InferencePool and llm-d endpoint picker; the replicas serve OpenAI on "
                                  "8000 and publish vLLM-format KV events to the picker.",
                                  enum=list(KSERVE_SCHEDULERS), default="pagoda"),
            },
            description="Settings for modes KServe and KServeLLM.",
            default={},
        ),
    },
    required=["image", "model"],
    description="Desired state of a served model.",
)

def make_crd() -> dict[str, Any]:
    """Build the CustomResourceDefinition object.

    Returns:
        The CRD as a plain dict, ready for YAML/JSON serialization.
    """
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "categories": ["pagoda"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
                    {"name": "Desired", "type": "integer", "jsonPath": ".status.replicas.desired"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.replicas.ready"},
                    {"name": "Min", "type": "integer", "jsonPath": ".spec.replicas.min",
                     "priority": 1},
                    {"name": "Max", "type": "integer", "jsonPath": ".spec.replicas.max",
                     "priority": 1},
                    {"name": "Policy", "type": "string", "jsonPath": ".spec.routing.policy",
                     "priority": 1},
                    {"name": "Valid", "type": "string",
                     "jsonPath": ".status.conditions[?(@.type==\"SpecValid\")].status"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A model served by a fleet of pagoda replicas behind a router.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": SPEC_SCHEMA,
                        "status": STATUS_SCHEMA,
                    },
                }},
            }],
        },
    }


def main() -> int:
    """Print the CRD as YAML (used to regenerate the chart's copy)."""
    import yaml

    sys.stdout.write("# Generated by `python -m pagoda_operator.crd`; do not edit by hand.\n")
    sys.stdout.write(yaml.safe_dump(make_crd(), sort_keys=False, width=100))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
