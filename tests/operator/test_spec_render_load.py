"""Spec parsing, pure renderers, and the load readers (Prometheus text, Redis keys)."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.contracts import redis_keys as pagoda_keys
from pagoda_operator import fleet_keys
from pagoda_operator.load import (MetricsScraper, RedisFleetStore, histogram_quantile,
                                  parse_prometheus_text)
from pagoda_operator.render_replicas import model_path, render_replica_deployment
from pagoda_operator.render_router import render_router_deployment
from pagoda_operator.spec import SpecError, parse_llmservice


def body(**spec):
    base = {"image": "pagoda:1", "model": {"name": "chat", "storageUri": "pvc://models/chat"}}
    base.update(spec)
    return {"metadata": {"name": "chat", "namespace": "llm", "uid": "u1"}, "spec": base}


@pytest.mark.parametrize("spec, field", [
    ({"replicas": {"min": 4, "max": 2}}, "spec.replicas.min"),
    ({"replicas": {"min": 0, "max": 2}}, "spec.replicas.min"),
    ({"routing": {"policy": "random"}}, "spec.routing.policy"),
    ({"engine": {"blockSize": 7}}, "spec.engine.blockSize"),
    ({"autoscaling": {"targetKVCacheUsage": 1.5}}, "spec.autoscaling.targetKVCacheUsage"),
    ({"modle": {}}, "spec.modle"),
    ({"model": {"name": "chat", "storageUri": "s3://b/k"}}, "spec.model.storageUri"),
    ({"mode": "KServe", "model": {"name": "c", "storageUri": "image:///m"}},
     "spec.model.storageUri"),
    ({"redis": {"url": "http://redis"}}, "spec.redis.url"),
    ({"model": {"name": "chat", "storageUri": "pvc://m/c", "loraAdapters": [{"name": "Bad_Name", "path": "x"}]}},
     "spec.model.loraAdapters[0].name"),
    ({"model": {"name": "chat", "storageUri": "pvc://m/c",
                "loraAdapters": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}}, "spec.model.loraAdapters"),
    ({"model": {"name": "chat", "storageUri": "pvc://m/c", "loraAdapters": [{"name": "a"}]}},
     "spec.model.loraAdapters[0].path"),
    ({"autoscaling": {"itlSLOSeconds": -1}}, "spec.autoscaling.itlSLOSeconds"),
    ({"disaggregation": {"prefill": {"replicas": {"min": 3, "max": 2}}}}, "spec.disaggregation.prefill.replicas.min"),
    ({"disaggregation": {"prefillReplicas": 2, "prefill": {}}}, "spec.disaggregation.prefillReplicas"),
    ({"disaggregation": {"prefil": {}}}, "spec.disaggregation.prefil"),
    ({"disaggregation": {"prefill": {"autoscaling": {"targetKVCacheUsage": 0.5}}}},  # not a prefill signal
     "spec.disaggregation.prefill.autoscaling.targetKVCacheUsage"),
    ({"disaggregation": {"prefill": {"autoscaling": {"ttftSLOSeconds": "1s"}}}},
     "spec.disaggregation.prefill.autoscaling.ttftSLOSeconds"),
    ({"mode": "KServeLLM", "model": {"name": "c", "storageUri": "hf://o/m"}, "kserve": {"scheduler": "llm-d"},
      "disaggregation": {}}, "spec.disaggregation"),
])
def test_invalid_specs_name_the_field(spec, field):
    with pytest.raises(SpecError) as error:
        parse_llmservice(body(**spec))
    assert error.value.field == field


def test_lora_adapters_reach_replicas_router_and_kserve():
    adapters = [{"name": "sql", "path": "adapters/sql"}, {"name": "chat2", "path": "/opt/chat2"}]
    svc = parse_llmservice(body(model={"name": "chat", "storageUri": "pvc://models/chat", "loraAdapters": adapters}))
    args = render_replica_deployment(svc, 1)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-4:] == ["--lora", f"sql={model_path(svc)}/adapters/sql", "--lora", "chat2=/opt/chat2"]
    router_args = render_router_deployment(svc)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router_args[-4:] == ["--lora", "sql", "--lora", "chat2"]
    from pagoda.serving.launch.serve_flags import make_parser, options_from_args

    parsed = options_from_args(make_parser().parse_args(args))  # `pagoda serve` accepts what is rendered
    assert parsed.engine_args["lora_modules"] == f"sql={model_path(svc)}/adapters/sql,chat2=/opt/chat2"
    kserve = parse_llmservice(body(mode="KServe", model={"name": "chat", "storageUri": "s3://b/chat",
                                                         "loraAdapters": adapters[:1]}))
    from pagoda_operator.render_kserve import render_inference_service

    model = render_inference_service(kserve)["spec"]["predictor"]["model"]
    assert model["args"][-2:] == ["--lora", "sql=/mnt/models/adapters/sql"]
    assert "--allow-runtime-lora" not in args + router_args  # off unless the spec asks


def test_runtime_lora_reaches_replicas_and_router_when_allowed():
    svc = parse_llmservice(body(model={"name": "chat", "storageUri": "pvc://models/chat",
                                       "allowRuntimeLoRA": True}))
    args = render_replica_deployment(svc, 1)["spec"]["template"]["spec"]["containers"][0]["args"]
    router_args = render_router_deployment(svc)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-1] == "--allow-runtime-lora" and router_args[-1] == "--allow-runtime-lora"
    from pagoda.fleet.router_cli import make_parser as router_parser
    from pagoda.serving.launch.serve_flags import make_parser, options_from_args

    assert options_from_args(make_parser().parse_args(args)).engine_args["enable_lora"] == "true"
    assert router_parser().parse_args(router_args).allow_runtime_lora
    with pytest.raises(SpecError, match="allowRuntimeLoRA"):
        parse_llmservice(body(model={"name": "chat", "storageUri": "pvc://models/chat", "allowRuntimeLoRA": "yes"}))


def test_defaults_and_renderers():
    svc = parse_llmservice(body(replicas={"min": 2, "max": 5},
                                redis={"url": "redis://r:6379/0",
                                       "passwordSecretRef": {"name": "redis"}}))
    assert svc.spec.autoscaling.scale_down_stabilization_seconds == 300
    assert model_path(svc) == "/mnt/models/chat"
    dep = render_replica_deployment(svc, 3)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 3
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["args"][:8] == ["--model", "/mnt/models/chat", "--http-port", "8000",
                                     "--grpc-port", "8001", "--metrics-port", "8002"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PAGODA_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["PAGODA_REDIS_URL"]["value"] == "redis://:$(PAGODA_REDIS_PASSWORD)@r:6379/0"
    router = render_router_deployment(svc)["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][:2] == ["--k8s-selector",
                                  "app.kubernetes.io/component=replica,pagoda.dev/llmservice=chat"]
    # The router tokenizes with the replicas' own model: same folder, same volume.
    assert router["args"][router["args"].index("--model-dir") + 1] == "/mnt/models/chat"
    router_pod = render_router_deployment(svc)["spec"]["template"]["spec"]
    assert router_pod["volumes"][:1] == dep["spec"]["template"]["spec"]["volumes"][:1]
    assert [m for m in router["volumeMounts"] if m["name"] == "model"] == \
        [m for m in container["volumeMounts"] if m["name"] == "model"]
    assert render_replica_deployment(svc, 3) == dep  # pure: same input, same output
    # Admission control defaults reach `pagoda serve`; no API keys: the router runs open.
    args = container["args"]
    assert args[args.index("--max-waiting-requests") + 1] == "1024"
    assert args[args.index("--max-waiting-prompt-tokens") + 1] == "1000000"
    assert "PAGODA_API_KEYS" not in {e["name"] for e in router["env"]}


def test_engine_admission_and_router_api_keys_from_the_spec():
    svc = parse_llmservice(body(engine={"maxWaitingRequests": 16, "maxWaitingPromptTokens": 50000},
                                routing={"apiKeysSecretRef": {"name": "chat-keys"}}))
    args = render_replica_deployment(svc, 1)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-waiting-requests") + 1] == "16"
    assert args[args.index("--max-waiting-prompt-tokens") + 1] == "50000"
    router = render_router_deployment(svc)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in router["env"]}
    assert env["PAGODA_API_KEYS"] == {"name": "PAGODA_API_KEYS",
                                      "valueFrom": {"secretKeyRef": {"name": "chat-keys", "key": "api-keys"}}}
    assert "PAGODA_ROUTER_SECRET" not in env  # derived from the keys by every router pod alike
    shared = parse_llmservice(body(routing={"apiKeysSecretRef": {"name": "chat-keys"},
                                            "routerSecretRef": {"name": "chat-salt"}}))
    env = {e["name"]: e for e in render_router_deployment(shared)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGODA_ROUTER_SECRET"]["valueFrom"] == {"secretKeyRef": {"name": "chat-salt", "key": "router-secret"}}
    with pytest.raises(SpecError, match="routerSecretRef"):
        parse_llmservice(body(routing={"routerSecretRef": {"key": "x"}}))
    with pytest.raises(SpecError) as error:
        parse_llmservice(body(engine={"maxWaitingRequests": 0}))
    assert error.value.field == "spec.engine.maxWaitingRequests"


METRICS = """
# HELP vllm:num_requests_waiting waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="pagoda"} 3
vllm:num_requests_running{model_name="pagoda"} 5
vllm:kv_cache_usage_perc{model_name="pagoda"} 0.42
vllm:time_to_first_token_seconds_bucket{le="0.1"} 50
vllm:time_to_first_token_seconds_bucket{le="0.5"} 90
vllm:time_to_first_token_seconds_bucket{le="1.0"} 100
vllm:time_to_first_token_seconds_bucket{le="+Inf"} 100
"""


def test_disaggregation_pools_parse_with_their_own_bounds_and_targets():
    from pagoda_operator.pools import scaled_pools
    from pagoda_operator.reconcile import render_children

    svc = parse_llmservice(body(replicas={"min": 1, "max": 6}, autoscaling={"itlSLOSeconds": 0.05},
                                disaggregation={"prefill": {"replicas": {"min": 2, "max": 5},
                                                            "autoscaling": {"ttftSLOSeconds": 1.5,
                                                                            "scaleDownStabilizationSeconds": 60}}}))
    decode, prefill = scaled_pools(svc)
    assert (decode.deployment, decode.min_replicas, decode.max_replicas, decode.status_key) == (
        "chat-decode", 1, 6, None)
    assert decode.autoscaling.itl_slo_seconds == 0.05 and decode.autoscaling.target_kv_cache_usage == 0.8
    assert (prefill.deployment, prefill.min_replicas, prefill.max_replicas, prefill.status_key) == (
        "chat-prefill", 2, 5, "prefill")
    auto = prefill.autoscaling
    assert (auto.ttft_slo_seconds, auto.scale_down_stabilization_seconds, auto.target_waiting_per_replica,
            auto.target_kv_cache_usage, auto.itl_slo_seconds) == (1.5, 60, 2.0, 0.0, 0.0)
    assert prefill.selector["pagoda.dev/pool"] == "prefill" and decode.selector["pagoda.dev/pool"] == "decode"
    counts = {c["metadata"]["name"]: c["spec"]["replicas"] for c in render_children(svc, 3, 4)
              if c["kind"] == "Deployment"}
    assert counts["chat-decode"] == 3 and counts["chat-prefill"] == 4
    assert {c["metadata"]["name"]: c["spec"]["replicas"] for c in render_children(svc, 3)
            if c["kind"] == "Deployment"}["chat-prefill"] == 2  # new: its minimum
    fixed = parse_llmservice(body(disaggregation={"prefillReplicas": 3})).spec.disaggregation
    assert (fixed.prefill_min_replicas, fixed.prefill_max_replicas) == (3, 3)  # the old field: a fixed pool
    [single] = scaled_pools(parse_llmservice(body()))
    assert (single.role, single.deployment, single.status_key) == ("replicas", "chat-replicas", None)


def test_prometheus_parsing_and_scrape_fallback():
    samples = parse_prometheus_text(METRICS)
    assert samples["vllm:num_requests_waiting"] == [({"model_name": "pagoda"}, 3.0)]
    assert histogram_quantile(0.9, {0.1: 50, 0.5: 90, 1.0: 100, float("inf"): 100}) == 0.5

    async def fetch(url: str) -> str:
        assert url == "http://10.0.0.7:8002/metrics"
        return METRICS

    scraper = MetricsScraper(fetch=fetch, clock=lambda: 5.0)
    loads = asyncio.run(scraper.read_loads("chat", {"pod-a": "10.0.0.7", "pod-b": None}))
    assert list(loads) == ["pod-a"]
    load = loads["pod-a"]
    assert (load.waiting, load.running, load.kv_usage, load.ttft_p90) == (3, 5, 0.42, 0.5)
    assert load.ttft_buckets and max(load.ttft_buckets.values()) > 0  # merged with other replicas by FleetLoad


class FakeRedis:
    """Just the redis.asyncio calls RedisFleetStore makes."""

    def __init__(self):
        self.data: dict = {}

    def pipeline(self, transaction=True):
        redis, calls = self, []

        class Pipe:
            def __getattr__(self, name):
                return lambda *args: calls.append((name, args))

            async def execute(self):
                return [await getattr(redis, name)(*args) for name, args in calls]
        return Pipe()

    async def hgetall(self, key):
        return self.data.get(key, {})

    async def set(self, key, value):
        self.data[key] = value

    async def smembers(self, key):
        return set(self.data.get(key, set()))

    async def srem(self, key, *members):
        self.data.get(key, set()).difference_update(members)

    async def delete(self, *keys):
        for key in keys:
            self.data.pop(key, None)


def test_redis_store_reads_heartbeats_and_cleans_up():
    redis = FakeRedis()
    redis.data[fleet_keys.heartbeat_key("chat", "a")] = {
        b"waiting": b"2", b"running": b"1", b"kv_usage": b"0.5", b"ttft_p90": b"0.2", b"ts": b"99",
        b"ttft_buckets": pagoda_keys.encode_ttft_buckets([0.2, 0.2, 3.0]).encode()}
    redis.data[fleet_keys.heartbeat_key("chat", "old")] = {b"waiting": b"9", b"ts": b"1"}
    redis.data[fleet_keys.registry_key("chat")] = {"a", "old"}
    redis.data[fleet_keys.replica_blocks_key("chat", "a")] = {"h1"}
    redis.data[fleet_keys.block_owners_key("chat", "h1")] = {"a", "b"}
    store = RedisFleetStore(redis, max_age_s=30, clock=lambda: 100.0)
    loads = asyncio.run(store.read_loads("chat", {"a": None, "old": None}))
    assert list(loads) == ["a"] and loads["a"].waiting == 2.0  # stale heartbeat ignored
    assert loads["a"].ttft_buckets[0.25] == 2 and loads["a"].ttft_buckets[float("inf")] == 3
    asyncio.run(store.mark_draining("chat", "a"))
    assert fleet_keys.drain_key("chat", "a") == "pagoda:chat:drain:a"
    assert fleet_keys.drain_key("chat", "a") in redis.data
    asyncio.run(store.forget_replica("chat", "a"))
    assert redis.data[fleet_keys.block_owners_key("chat", "h1")] == {"b"}
    assert redis.data[fleet_keys.registry_key("chat")] == {"old"}
    assert fleet_keys.heartbeat_key("chat", "a") not in redis.data


def _histogram_text(name: str, bounds, values) -> str:
    """Prometheus text of a histogram of `values` (cumulative counts per `le`), as Triton exports it."""
    lines = [f"# TYPE {name} histogram"]
    for bound in [*bounds, float("inf")]:
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        lines.append(f'{name}_bucket{{model="pagoda",version="1",le="{le}"}} {sum(v <= bound for v in values)}')
    lines.append(f'{name}_count{{model="pagoda",version="1"}} {len(values)}')
    return "\n".join(lines) + "\n"


def test_scraper_reads_inter_token_latency_as_bucket_deltas_and_redis_loads_get_it_when_asked():
    """ITL P90 from vllm:inter_token_latency_seconds: the bucket deltas since the previous scrape,
    checked against the true P90 of the gaps behind them; a FallbackFleetStore adds it to Redis
    heartbeats (which carry none) only when the pool scales on ITL."""
    import statistics

    from pagoda.serving.metrics import ITL_BUCKETS
    from pagoda_operator.load import FallbackFleetStore

    old_gaps = [0.02] * 200
    new_gaps = [0.02] * 40 + [0.35] * 60  # a stall since the last scrape
    texts = iter([METRICS + _histogram_text("vllm:inter_token_latency_seconds", ITL_BUCKETS, old_gaps),
                  METRICS + _histogram_text("vllm:inter_token_latency_seconds", ITL_BUCKETS, old_gaps + new_gaps)])

    async def fetch(url: str) -> str:
        return next(texts)

    scraper = MetricsScraper(fetch=fetch, clock=lambda: 5.0)
    first = asyncio.run(scraper.read_loads("chat", {"pod-a": "10.0.0.7"}))["pod-a"]
    assert first.itl_p90 <= 0.025 and first.itl_buckets[float("inf")] == 200
    second = asyncio.run(scraper.read_loads("chat", {"pod-a": "10.0.0.7"}))["pod-a"]
    true_p90 = statistics.quantiles(new_gaps, n=10)[-1]
    assert second.itl_buckets[float("inf")] == 100  # only the new gaps
    assert 0.3 < second.itl_p90 <= 0.4 and 0.3 < true_p90 <= 0.4  # the same bucket as the true P90

    redis = FakeRedis()
    redis.data[fleet_keys.heartbeat_key("chat", "pod-a")] = {b"waiting": b"2", b"ts": b"99"}
    texts = iter([METRICS + _histogram_text("vllm:inter_token_latency_seconds", ITL_BUCKETS, new_gaps)] * 2)
    store = FallbackFleetStore(RedisFleetStore(redis, clock=lambda: 100.0), MetricsScraper(fetch=fetch))
    plain = asyncio.run(store.read_loads("chat", {"pod-a": "10.0.0.7"}))["pod-a"]
    assert plain.waiting == 2 and plain.itl_buckets is None and store.source == "redis"
    with_itl = asyncio.run(store.read_loads("chat", {"pod-a": "10.0.0.7"}, need_itl=True))["pod-a"]
    assert with_itl.waiting == 2 and 0.3 < with_itl.itl_p90 <= 0.4  # the heartbeat's load, the scrape's ITL
