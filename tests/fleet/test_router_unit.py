"""Router pieces without servers: replica specs, membership and accounting, the decision
with a fake fleet view (prefix vs load-only fallback), Kubernetes discovery against a fake
API server, Redis URL expansion, BYTES decoding."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

import pytest

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.fleet.api.grpc_proxy import cache_salt_of
from pagoda.fleet.triton_wire import bytes_elements, read_string_input
from pagoda.fleet.routing.fleet_view import IndexView
from pagoda.fleet.routing.k8s_discovery import KubernetesConfig, KubernetesDiscovery, pod_to_member
from pagoda.fleet.routing.replicas import ReplicaSet, parse_replicas_spec
from pagoda.fleet.router_cli import make_parser, options_from_args
from pagoda.fleet.service import resolve_redis_url
from pagoda.fleet.routing.router import NoReplicaAvailable, Router


def test_parse_replicas_spec():
    spec = "id=a,grpc=10.0.0.1:8001,http=10.0.0.1:8000,metrics=10.0.0.1:8002; grpc=h:1,http=h:2"
    assert parse_replicas_spec(spec) == [
        ("a", {"grpc": "10.0.0.1:8001", "http": "10.0.0.1:8000", "metrics": "10.0.0.1:8002"}),
        (None, {"grpc": "h:1", "http": "h:2"})]
    for bad, message in [("", "no replica"), ("grpc=h:1", "lacks http"), ("grpc=h,http=h:2", "host:port"),
                         ("grpc=h:1,http=h:2,color=red", "unknown key"), ("grpc", "key=value")]:
        with pytest.raises(ValueError, match=message):
            parse_replicas_spec(bad)


def test_replica_roles_from_the_spec_and_from_heartbeats():
    """Disaggregated serving: role=prefill|decode|mixed in --replicas, or the heartbeat's role field."""
    [(rid, endpoints)] = parse_replicas_spec("id=p,grpc=h:1,http=h:2,role=prefill")
    assert endpoints["role"] == "prefill"
    with pytest.raises(ValueError, match="role must be one of"):
        parse_replicas_spec("grpc=h:1,http=h:2,role=both")
    replicas = ReplicaSet("static")
    replicas.set_members([("p", endpoints), ("m", {"grpc": "h:3", "http": "h:4"})])
    assert {r.replica_id: r.role for r in replicas.all()} == {"p": "prefill", "m": "mixed"}
    assert "role" not in replicas.get("p").endpoints
    beat = dict(endpoints={"grpc": "h:3"}, waiting=0, running=0, kv_usage=0.0, draining=False, ts=1.0,
                extra={"role": "decode"})
    replicas.apply_heartbeats([SimpleNamespace(replica_id="m", **beat), SimpleNamespace(replica_id="p", **beat)])
    assert replicas.get("m").role == "decode" and replicas.get("p").role == "prefill"  # the spec wins


def test_replica_set_accounting_and_ids_from_registry():
    replicas = ReplicaSet("static")
    replicas.set_members([("h:1", {"grpc": "h:1", "http": "h:2"}), ("b", {"grpc": "h:3", "http": "h:4"})])
    beat = SimpleNamespace(replica_id="pod-0", endpoints={"grpc": "h:1"}, waiting=2, running=3, kv_usage=0.5,
                           draining=True, ts=1.0)
    replicas.apply_heartbeats([beat])
    assert {r.replica_id for r in replicas.all()} == {"b", "pod-0"}  # "h:1" took its heartbeat's id
    pod = replicas.get("pod-0")
    assert (pod.waiting, pod.running, pod.kv_usage, pod.draining) == (2, 3, 0.5, True)
    assert [r.replica_id for r in replicas.routable()] == ["b"]
    assert [r.replica_id for r in replicas.routable(include_draining=True)] == ["b", "pod-0"]
    b = replicas.get("b")
    replicas.acquire(b)
    replicas.acquire(b)
    replicas.release(b)
    assert (b.in_flight, b.num_routed) == (1, 2)
    replicas.mark_unhealthy(b, "boom")
    assert replicas.routable() == [] and b.unhealthy_reason == "boom"
    replicas.mark_healthy(b)
    assert replicas.routable() == [b]
    replicas.release(b)
    with pytest.raises(AssertionError):
        replicas.release(b)


def registry_beats(*ids, draining=False):
    return [SimpleNamespace(replica_id=rid, endpoints={"grpc": f"{rid}:1", "http": f"{rid}:2"}, waiting=0,
                            running=0, kv_usage=0.0, draining=draining, ts=0.0) for rid in ids]


def test_registry_membership_follows_heartbeats():
    replicas = ReplicaSet("registry")
    replicas.apply_heartbeats(registry_beats("x", "y"), now=0.0)
    assert [r.replica_id for r in replicas.all()] == ["x", "y"]
    # x's heartbeat expired because x died: its health probe fails, and it goes at once.
    replicas.mark_unhealthy(replicas.get("x"), "health probe: UNAVAILABLE")
    replicas.apply_heartbeats(registry_beats("y"), now=1.0)
    assert [r.replica_id for r in replicas.all()] == ["y"]


def test_an_emptied_registry_keeps_replicas_that_still_answer():
    """Redis restarted empty or FLUSHALL: every heartbeat is gone at once, the replicas still
    serve. They stay routable while healthy (at most the grace) and are listed again when
    they re-register; a draining one (its last heartbeat said so) stays unroutable."""
    replicas = ReplicaSet("registry", registry_grace_s=30.0)
    replicas.apply_heartbeats(registry_beats("x", "y"), now=0.0)
    replicas.apply_heartbeats([], now=1.0)  # FLUSHALL
    assert [r.replica_id for r in replicas.routable()] == ["x", "y"]
    assert replicas.get("x").missing_since == 1.0
    replicas.apply_heartbeats(registry_beats("x"), now=2.0)  # x re-registered; y not yet
    assert replicas.get("x").missing_since is None and replicas.get("y").missing_since == 1.0
    assert [r.replica_id for r in replicas.routable()] == ["x", "y"]
    replicas.apply_heartbeats(registry_beats("x"), now=31.0)  # y never came back within the grace
    assert [r.replica_id for r in replicas.all()] == ["x"]
    # A replica that announced its drain and deregistered is kept but never chosen.
    replicas.apply_heartbeats(registry_beats("x", draining=True), now=32.0)
    replicas.apply_heartbeats([], now=33.0)
    assert [r.replica_id for r in replicas.all()] == ["x"] and replicas.routable() == []


class FakeTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


class FakeFleet(IndexView):
    """FleetView's surface: ``match`` answers from a dict, or None when 'down'."""

    def __init__(self):
        super().__init__()
        self.available = True
        self.owners: dict[str, dict[str, int]] = {}

    async def match(self, block_hashes):
        if not self.available:
            return None
        return self.owners.get(block_hashes[0] if block_hashes else "", {})


def make_router(fleet=None, policy="prefix_aware"):
    replicas = ReplicaSet("static")
    replicas.set_members([("a", {"grpc": "a:1", "http": "a:2"}), ("b", {"grpc": "b:1", "http": "b:2"})])
    return Router(replicas, FakeTokenizer(), "model-x", policy, fleet, block_size=4)


def test_analyze_hashes_like_the_engine():
    router = make_router()
    analysis = router.analyze("abcdefghij", cache_salt="t1")
    assert analysis.num_prompt_tokens == 10
    expected = hash_prompt_blocks([ord(c) for c in "abcdefghij"], 4, "model-x", cache_salt="t1")
    assert analysis.block_hashes == [h.hex() for h in expected] and len(expected) == 2


def test_analyze_keeps_lora_adapters_apart_and_reads_them_from_triton_requests():
    """An adapter is part of the block hashes (as in the engine), so its traffic is routed
    where its own prefixes live; the Triton doors read it from the input or the JSON."""
    from tritonclient.grpc import service_pb2

    from pagoda.fleet.api.generate_request import GenerateRequest
    from pagoda.fleet.api.grpc_proxy import analyze_routed
    from pagoda.fleet.api.routed_request import RoutedRequest

    router = make_router()
    base, sql = router.analyze("abcdefghij"), router.analyze("abcdefghij", adapter_id="sql")
    expected = hash_prompt_blocks([ord(c) for c in "abcdefghij"], 4, "model-x", adapter_id="sql")
    assert sql.block_hashes == [h.hex() for h in expected] and sql.block_hashes != base.block_hashes
    def generate(document):
        return GenerateRequest.of_document(document, "pagoda", is_front=False)

    assert generate({"text_input": "abcdefghij", "lora_name": "sql"}).analyzed(router)[0].block_hashes == \
        sql.block_hashes
    in_json = {"text_input": "abcdefghij", "sampling_parameters": '{"lora_name": "sql"}'}
    assert generate(in_json).analyzed(router)[0].block_hashes == sql.block_hashes
    front = GenerateRequest.of_document({"text_input": "abcdefghij", "lora_name": "sql"}, "ensemble", is_front=True)
    assert front.analyzed(router)[0].block_hashes == sql.block_hashes
    request = service_pb2.ModelInferRequest()
    for name in ("text_input", "lora_name"):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
    request.raw_input_contents.extend([struct.pack("<I", 10) + b"abcdefghij", struct.pack("<I", 3) + b"sql"])
    assert analyze_routed(router, RoutedRequest.of_infer_request(request)).block_hashes == sql.block_hashes


def test_choose_follows_prefix_then_falls_back_to_load():
    async def scenario():
        fleet = FakeFleet()
        router = make_router(fleet)
        analysis = router.analyze("x" * 64)
        fleet.owners[analysis.block_hashes[0]] = {"b": 16}
        first = await router.choose(analysis)
        assert (first.replica.replica_id, first.policy, first.matched_blocks) == ("b", "prefix_aware", 16)
        assert first.replica.in_flight == 1  # counted at decision time
        router.release(first)
        router.release(first)  # idempotent
        assert first.replica.in_flight == 0
        fleet.available = False  # Redis down: least loaded by the router's own counts
        held = [await router.choose(analysis) for _ in range(4)]
        assert [d.replica.replica_id for d in held] == ["a", "b", "a", "b"]
        assert all(d.policy == "least_loaded" and not d.redis_available for d in held)
        with pytest.raises(NoReplicaAvailable, match="tried"):
            await router.choose(analysis, exclude=["a", "b"])
        assert router.num_fallback_decisions == 4

    asyncio.run(scenario())


def test_non_prefix_policy_kept_without_redis():
    async def scenario():
        router = make_router(None, policy="round_robin")
        chosen = [(await router.choose(None)).replica.replica_id for _ in range(4)]
        assert chosen == ["a", "b", "a", "b"]

    asyncio.run(scenario())


def test_bytes_inputs_and_salt():
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest()
    for name in ("stream", "text_input", "sampling_parameters"):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
    request.raw_input_contents.extend([b"\x01", struct.pack("<I", 5) + "héllo".encode()[:5],
                                       struct.pack("<I", 18) + b'{"cache_salt":"t"}'])
    assert read_string_input(request, "text_input") == "héll"
    assert cache_salt_of(read_string_input(request, "sampling_parameters")) == "t"
    assert read_string_input(request, "missing") is None
    assert bytes_elements(struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)) == [b"ab", b""]
    assert cache_salt_of("{not json") is None and cache_salt_of({"cache_salt": ""}) is None


def test_redis_url_expansion_and_cli():
    env = {"PAGODA_REDIS_PASSWORD": "s3cret"}
    assert resolve_redis_url("redis://:$(PAGODA_REDIS_PASSWORD)@redis:6379/0", env) == "redis://:s3cret@redis:6379/0"
    # The operator's rendered arguments parse.
    args = make_parser().parse_args(["--k8s-selector", "app=pagoda,component=replica", "--redis-url",
                                     "redis://:$(PAGODA_REDIS_PASSWORD)@r:6379/0", "--policy", "prefix_aware",
                                     "--policy-knob", "load_cost_tokens=128"])
    options = options_from_args(args)
    assert options.k8s_selector == "app=pagoda,component=replica"
    assert options.policy_knobs == {"load_cost_tokens": 128.0}
    assert (options.http_port, options.grpc_port) == (8080, 8081)


def test_pod_to_member():
    pod = {"metadata": {"name": "llm-0"},
           "spec": {"containers": [{"ports": [{"name": "grpc", "containerPort": 9001}]}]},
           "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_to_member(pod) == ("llm-0", {"http": "10.1.2.3:8000", "grpc": "10.1.2.3:9001",
                                            "metrics": "10.1.2.3:8002"})
    not_ready = {**pod, "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "False"}]}}
    deleting = {**pod, "metadata": {"name": "llm-0", "deletionTimestamp": "now"}}
    assert pod_to_member(not_ready) is None and pod_to_member(deleting) is None


def test_kubernetes_discovery_against_a_fake_api():
    from aiohttp import web

    def pod(name, ready):
        return {"metadata": {"name": name}, "spec": {"containers": [{}]},
                "status": {"podIP": f"10.0.0.{name[-1]}", "conditions": [{"type": "Ready", "status": str(ready)}]}}

    seen = {}

    async def list_pods(request):
        seen["selector"] = request.query["labelSelector"]
        seen["auth"] = request.headers.get("Authorization")
        seen["namespace"] = request.match_info["ns"]
        return web.json_response({"items": [pod("p1", True), pod("p2", False)]})

    async def scenario():
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", list_pods)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        replicas = ReplicaSet("kubernetes")
        discovery = KubernetesDiscovery(replicas, "app=x", KubernetesConfig(f"http://127.0.0.1:{port}", "ns1", "tok"))
        try:
            await discovery.refresh()
        finally:
            await discovery.stop()
            await runner.cleanup()
        return replicas

    replicas = asyncio.run(scenario())
    assert [(r.replica_id, r.endpoints["grpc"]) for r in replicas.all()] == [("p1", "10.0.0.1:8001")]
    assert seen == {"selector": "app=x", "auth": "Bearer tok", "namespace": "ns1"}


def test_router_tokenizes_exactly_like_the_engine(smollm2_path):
    from pagoda.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(smollm2_path)
    replicas = ReplicaSet("static")
    router = Router(replicas, tokenizer, "SmolLM2-135M-Instruct", "round_robin", None, block_size=16)
    for text in ["Hello world", "  leading spaces and 12345 digits\n\ttabs", "héllo wörld ✓ " * 40,
                 tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])]:
        ids = tokenizer.encode(text)  # what LLMEngine.add_request does with a text prompt
        analysis = router.analyze(text)
        assert analysis.num_prompt_tokens == len(ids)
        assert analysis.block_hashes == [h.hex() for h in hash_prompt_blocks(ids, 16, "SmolLM2-135M-Instruct")]


def test_wire_helpers_read_an_output_in_either_encoding():
    """The two-stage path's helper (fleet/api/upstream.py): the prefill's KV handle read from a
    response, raw or typed contents."""
    from tritonclient.grpc import service_pb2

    from pagoda.fleet.triton_wire import output_text

    response = service_pb2.ModelInferResponse()
    response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    response.outputs.add(name="kv_transfer_params", datatype="BYTES", shape=[1])
    response.raw_output_contents.extend([struct.pack("<I", 1) + b"x", struct.pack("<I", 4) + b'{"a"'])
    assert output_text(response, "kv_transfer_params") == '{"a"' and output_text(response, "nope") is None
    typed = service_pb2.ModelInferResponse()
    typed.outputs.add(name="kv_transfer_params", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"{}")
    assert output_text(typed, "kv_transfer_params") == "{}"
