"""Parse and validate an `LLMService` spec into typed, defaulted dataclasses.

The API server already enforces the CRD schema, but the operator must not trust that
(the CRD may be older than the operator, or validation disabled), and the cross-field
rules below are only partly expressible in the schema. So `parse_llmservice` applies the
schema's defaults, checks the schema (`crd.SPEC_SCHEMA`, with unknown fields rejected),
then checks the rules that span fields. Every failure is a `SpecError` whose `field` is a
dotted path such as `spec.replicas.min`; the handlers turn it into a `PermanentError`
and a `SpecValid=False` status condition that names that field.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pagoda_operator import crd, kv_tiers, parallelism
from pagoda_operator.kv_tiers import KVCacheSpec
from pagoda_operator.parallelism import ParallelismSpec


class SpecError(ValueError):
    """An invalid LLMService spec. `field` is the dotted path of the offending field."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


@dataclass(frozen=True)
class ModelSpec:
    name: str
    storage_uri: str
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, path); relative paths sit in the model folder
    allow_runtime_lora: bool = False  # --allow-runtime-lora on replicas and router

    @property
    def scheme(self) -> str:
        return self.storage_uri.split("://", 1)[0]


@dataclass(frozen=True)
class EngineSpec:
    dtype: str = "auto"
    max_model_len: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024  # admission control (pagoda.engine.core.load_shedding)
    max_waiting_prompt_tokens: int = 1_000_000
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = True
    target_waiting_per_replica: float = 4.0
    target_kv_cache_usage: float = 0.8
    ttft_slo_seconds: float = 0.0
    itl_slo_seconds: float = 0.0  # P90 inter-token latency objective (from /metrics); 0: off
    tolerance: float = 0.1
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    max_scale_up_step: int = 4
    drain_timeout_seconds: int = 600


@dataclass(frozen=True)
class RoutingSpec:
    policy: str = "prefix_aware"
    replicas: int = 1
    service_type: str = "ClusterIP"
    api_keys_secret_name: str | None = None  # router API keys (pagoda.fleet.gate.auth); None: open mode
    api_keys_secret_key: str = "api-keys"
    router_secret_name: str | None = None  # HMAC key of tenant salts (PAGODA_ROUTER_SECRET); None: derived
    router_secret_key: str = "router-secret"


@dataclass(frozen=True)
class RedisSpec:
    url: str = crd.DEFAULT_REDIS_URL
    password_secret_name: str | None = None
    password_secret_key: str = "password"
    ca_secret_name: str | None = None  # rediss:// only: the CA that signed Redis' certificate
    ca_secret_key: str = "ca.crt"


# The prefill pool scales on its queue and TTFT only: a prefill pod's KV cache holds finished
# prompts until decode pods pull them, so its usage says little about load (0 turns KV off).
PREFILL_AUTOSCALING = AutoscalingSpec(target_waiting_per_replica=2.0, target_kv_cache_usage=0.0)


@dataclass(frozen=True)
class DisaggregationSpec:
    """`spec.disaggregation`: a prefill pool (its own bounds and autoscaler) beside the decode pool,
    which `spec.replicas` / `spec.autoscaling` size. `prefillReplicas: n` is `min = max = n`."""

    prefill_min_replicas: int = 1
    prefill_max_replicas: int = 1
    prefill_autoscaling: AutoscalingSpec = PREFILL_AUTOSCALING
    kv_transfer_port: int = 5600


@dataclass(frozen=True)
class KVEventsSpec:
    """`spec.kvEvents`: vLLM-format KV events from the replicas (`--kv-events-config`)."""

    endpoint: str
    topic: str | None = None  # None: llm-d's kv@<pod-ip>:<openai port>@<model>
    replay_endpoint: str | None = None


@dataclass(frozen=True)
class LLMServiceSpec:
    image: str
    model: ModelSpec
    mode: str = "Deployment"
    image_pull_policy: str = "IfNotPresent"
    termination_grace_period_seconds: int = 60
    engine: EngineSpec = field(default_factory=EngineSpec)
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    min_replicas: int = 1
    max_replicas: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    redis: RedisSpec = field(default_factory=RedisSpec)
    kserve_runtime: str = crd.DEFAULT_KSERVE_RUNTIME
    kserve_gateway: dict[str, str] = field(default_factory=dict)  # mode KServeLLM: {name[, namespace]}
    kserve_scheduler: str = "pagoda"  # mode KServeLLM: "pagoda" (our router) or "llm-d" (KServe's EPP)
    kv_events: KVEventsSpec | None = None
    disaggregation: DisaggregationSpec | None = None
    parallelism: ParallelismSpec | None = None  # spec.parallelism (parallelism.py); None: no GPU request
    kv_cache: KVCacheSpec | None = None  # spec.kvCache (kv_tiers.py): CPU, disk and shared KV tiers


@dataclass(frozen=True)
class LLMService:
    """One LLMService object: identity plus the parsed spec. Input of every render_*."""

    name: str
    namespace: str
    spec: LLMServiceSpec
    uid: str = ""
    generation: int = 0


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Return a copy of `value` with the schema's defaults filled in, as the API server does."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
    return value


def validate(value: Any, schema: dict[str, Any], path: str) -> None:
    """Check `value` against our CRD schema subset; raise SpecError at the first problem.

    Unknown object fields are errors (the CRD is structural and lists every field).
    """
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                validate(value, option, path)
                break
            except SpecError:
                continue
        else:
            raise SpecError(path, "has the wrong type")
    kind = schema.get("type")
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"must be an integer, got {value!r}")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"must be a number, got {value!r}")
    elif kind in _TYPES and not isinstance(value, _TYPES[kind]):
        raise SpecError(path, f"must be of type {kind}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise SpecError(path, f"must be one of {schema['enum']}, got {value!r}")
    if "minimum" in schema and value < schema["minimum"]:
        raise SpecError(path, f"must be >= {schema['minimum']}, got {value!r}")
    if "maximum" in schema and value > schema["maximum"]:
        raise SpecError(path, f"must be <= {schema['maximum']}, got {value!r}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise SpecError(path, "must not be empty")
        if len(value) > schema.get("maxLength", len(value)):
            raise SpecError(path, f"must be at most {schema['maxLength']} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise SpecError(path, f"{value!r} does not match {schema['pattern']}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            raise SpecError(path, f"must have at most {schema['maxItems']} items")
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise SpecError(f"{path}.{key}", "is required")
        props = schema.get("properties")
        for key, item in value.items():
            if props is not None:
                if key not in props:
                    raise SpecError(f"{path}.{key}", "is not a known field")
                validate(item, props[key], f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                validate(item, schema["additionalProperties"], f"{path}.{key}")


def _check_cross_fields(spec: dict[str, Any]) -> None:
    replicas = spec["replicas"]
    if replicas["min"] > replicas["max"]:
        raise SpecError("spec.replicas.min",
                        f"{replicas['min']} is greater than spec.replicas.max {replicas['max']}")
    scheme = spec["model"]["storageUri"].split("://", 1)[0]
    if spec["mode"] == "Deployment" and scheme not in ("pvc", "image"):
        raise SpecError("spec.model.storageUri",
                        f"scheme {scheme}:// needs mode KServe (its storage initializer "
                        "downloads it); mode Deployment mounts pvc:// or uses image://")
    if spec["mode"] in ("KServe", "KServeLLM") and scheme == "image":
        raise SpecError("spec.model.storageUri",
                        f"image:// is only for mode Deployment; {spec['mode']} needs a storage URI")
    if scheme == "pvc" and not re.match(r"^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?$",
                                        spec["model"]["storageUri"]):
        raise SpecError("spec.model.storageUri", "must look like pvc://<claim-name>[/<path>]")
    if scheme == "image" and not spec["model"]["storageUri"].startswith("image:///"):
        raise SpecError("spec.model.storageUri", "must be an absolute path: image:///<path>")
    url = urlsplit(spec["redis"]["url"])
    if not url.hostname:
        raise SpecError("spec.redis.url", "has no host")
    if "caSecretRef" in spec["redis"] and url.scheme != "rediss":
        raise SpecError("spec.redis.caSecretRef", "needs a TLS url (rediss://...)")
    if url.password and "passwordSecretRef" in spec["redis"]:
        raise SpecError("spec.redis.passwordSecretRef",
                        "set either a password in spec.redis.url or a passwordSecretRef, not both")
    if "disaggregation" in spec:
        _check_disaggregation(spec)
    for field_path, message in (*parallelism.check(spec), *kv_tiers.check(spec)):
        raise SpecError(field_path, message)
    if "kvEvents" in spec and spec["mode"] == "KServeLLM" and spec["kserve"].get("scheduler") == "llm-d":
        raise SpecError("spec.kvEvents", "the llm-d scheduler configures the replicas' KV events itself "
                                         "(its endpoint picker's ZMQ port); remove spec.kvEvents")


def _check_disaggregation(spec: dict[str, Any]) -> None:
    disaggregation = spec["disaggregation"]
    if spec["mode"] == "KServe":
        raise SpecError("spec.disaggregation", "needs mode Deployment (the operator's pools) or KServeLLM "
                                               "(LLMInferenceService's prefill section), got KServe")
    if spec["mode"] == "KServeLLM" and spec["kserve"].get("scheduler") == "llm-d":
        raise SpecError("spec.disaggregation", "needs kserve.scheduler pagoda: llm-d's P/D path runs vLLM's "
                                               "NIXL connector through its routing sidecar, which pagoda's KV "
                                               "handle does not speak")
    if disaggregation["kvTransferPort"] in (8000, 8001, 8002, 9000):
        raise SpecError("spec.disaggregation.kvTransferPort", "is one of the replica's own ports (8000-8002, 9000)")
    if "prefillReplicas" in disaggregation and "prefill" in disaggregation:
        raise SpecError("spec.disaggregation.prefillReplicas",
                        "set either prefillReplicas (a fixed pool) or prefill.replicas, not both")
    bounds = disaggregation.get("prefill", {}).get("replicas", {"min": 1, "max": 1})
    if bounds["min"] > bounds["max"]:
        raise SpecError("spec.disaggregation.prefill.replicas.min",
                        f"{bounds['min']} is greater than spec.disaggregation.prefill.replicas.max {bounds['max']}")


def _autoscaling(auto: dict[str, Any], base: AutoscalingSpec = AutoscalingSpec()) -> AutoscalingSpec:
    """An AutoscalingSpec from a (defaulted) autoscaling object; targets it lacks keep `base`'s."""
    return AutoscalingSpec(
        enabled=auto["enabled"],
        target_waiting_per_replica=float(auto["targetWaitingPerReplica"]),
        target_kv_cache_usage=float(auto.get("targetKVCacheUsage", base.target_kv_cache_usage)),
        ttft_slo_seconds=float(auto["ttftSLOSeconds"]),
        itl_slo_seconds=float(auto.get("itlSLOSeconds", base.itl_slo_seconds)),
        tolerance=float(auto["tolerance"]),
        scale_up_stabilization_seconds=auto["scaleUpStabilizationSeconds"],
        scale_down_stabilization_seconds=auto["scaleDownStabilizationSeconds"],
        max_scale_up_step=auto["maxScaleUpStep"],
        drain_timeout_seconds=auto["drainTimeoutSeconds"],
    )


def _disaggregation(raw: dict[str, Any] | None) -> DisaggregationSpec | None:
    if raw is None:
        return None
    if "prefillReplicas" in raw:  # a fixed pool: the same policy, held in [n, n]
        count = raw["prefillReplicas"]
        return DisaggregationSpec(count, count, PREFILL_AUTOSCALING, raw["kvTransferPort"])
    prefill = apply_defaults(raw.get("prefill", {}), crd.SPEC_SCHEMA["properties"]["disaggregation"]
                             ["properties"]["prefill"])
    return DisaggregationSpec(prefill["replicas"]["min"], prefill["replicas"]["max"],
                              _autoscaling(prefill["autoscaling"], PREFILL_AUTOSCALING), raw["kvTransferPort"])


def parse_spec(raw_spec: dict[str, Any]) -> LLMServiceSpec:
    """Default, validate and convert a raw `spec` mapping.

    Args:
        raw_spec: `.spec` of an LLMService as stored by the API server.
    Returns:
        The typed spec.
    Raises:
        SpecError: naming the first invalid field.
    """
    if not isinstance(raw_spec, dict):
        raise SpecError("spec", "must be an object")
    spec = apply_defaults(raw_spec, crd.SPEC_SCHEMA)
    validate(spec, crd.SPEC_SCHEMA, "spec")
    _check_cross_fields(spec)
    engine, auto = spec["engine"], spec["autoscaling"]
    routing, redis = spec["routing"], spec["redis"]
    secret = redis.get("passwordSecretRef") or {}
    ca_secret = redis.get("caSecretRef") or {}
    return LLMServiceSpec(
        image=spec["image"],
        model=ModelSpec(name=spec["model"]["name"], storage_uri=spec["model"]["storageUri"],
                        lora_adapters=_lora_adapters(spec["model"].get("loraAdapters", [])),
                        allow_runtime_lora=bool(spec["model"].get("allowRuntimeLoRA", False))),
        mode=spec["mode"],
        image_pull_policy=spec["imagePullPolicy"],
        termination_grace_period_seconds=spec["terminationGracePeriodSeconds"],
        engine=EngineSpec(
            dtype=engine["dtype"], max_model_len=engine["maxModelLen"],
            max_num_seqs=engine["maxNumSeqs"],
            max_num_batched_tokens=engine["maxNumBatchedTokens"],
            block_size=engine["blockSize"],
            gpu_memory_utilization=float(engine["gpuMemoryUtilization"]),
            enable_prefix_caching=engine["enablePrefixCaching"],
            max_waiting_requests=engine["maxWaitingRequests"],
            max_waiting_prompt_tokens=engine["maxWaitingPromptTokens"],
            extra_args=tuple(engine.get("extraArgs", ())),
        ),
        resources=copy.deepcopy(spec.get("resources", {})),
        min_replicas=spec["replicas"]["min"],
        max_replicas=spec["replicas"]["max"],
        autoscaling=_autoscaling(auto),
        routing=RoutingSpec(policy=routing["policy"], replicas=routing["replicas"],
                            service_type=routing["serviceType"],
                            api_keys_secret_name=(routing.get("apiKeysSecretRef") or {}).get("name"),
                            api_keys_secret_key=(routing.get("apiKeysSecretRef") or {}).get("key", "api-keys"),
                            router_secret_name=(routing.get("routerSecretRef") or {}).get("name"),
                            router_secret_key=(routing.get("routerSecretRef") or {}).get("key", "router-secret")),
        redis=RedisSpec(url=redis["url"], password_secret_name=secret.get("name"),
                        password_secret_key=secret.get("key", "password"),
                        ca_secret_name=ca_secret.get("name"), ca_secret_key=ca_secret.get("key", "ca.crt")),
        kserve_runtime=spec["kserve"]["runtime"],
        kserve_gateway=dict(spec["kserve"].get("gateway") or {}),
        kserve_scheduler=spec["kserve"].get("scheduler", "pagoda"),
        kv_events=_kv_events(spec.get("kvEvents")),
        disaggregation=_disaggregation(spec.get("disaggregation")),
        parallelism=parallelism.parse(spec.get("parallelism")),
        kv_cache=kv_tiers.parse(spec.get("kvCache")),
    )


def _kv_events(raw: dict[str, Any] | None) -> KVEventsSpec | None:
    if raw is None:
        return None
    spec = KVEventsSpec(raw["endpoint"], raw.get("topic"), raw.get("replayEndpoint"))
    for name, endpoint in (("endpoint", spec.endpoint), ("replayEndpoint", spec.replay_endpoint)):
        port = int(endpoint.rpartition(":")[2]) if endpoint else 1
        if not 1 <= port <= 65535:
            raise SpecError(f"spec.kvEvents.{name}", f"port must be 1-65535, got {port}")
    if spec.replay_endpoint and spec.replay_endpoint.rpartition(":")[2] == spec.endpoint.rpartition(":")[2]:
        raise SpecError("spec.kvEvents.replayEndpoint", "must use another port than endpoint")
    return spec


def parse_llmservice(body: dict[str, Any]) -> LLMService:
    """Parse a whole LLMService object (metadata + spec). Raises SpecError."""
    meta = body.get("metadata", {})
    return LLMService(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation", 0) or 0),
        spec=parse_spec(body.get("spec")),
    )


def _lora_adapters(items: list) -> tuple[tuple[str, str], ...]:
    """``spec.model.loraAdapters`` as (name, path) pairs; a repeated name is refused."""
    names = [item["name"] for item in items]
    for name in names:
        if names.count(name) > 1:
            raise SpecError("spec.model.loraAdapters", f"the name {name!r} appears more than once")
    return tuple((item["name"], item["path"]) for item in items)
