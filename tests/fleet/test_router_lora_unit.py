"""The router's run-time LoRA endpoints against fake replicas (aiohttp servers answering
the replica's LoRA control request as tritonserver does): /v1/load_lora_adapter and
/v1/unload_lora_adapter fan out to every routable replica, all or nothing (rollback named
in the error), the Triton HTTP door's control requests, /v1/models following the served
set, the runtime flag and API keys, the gRPC door's refusal, and replay on rejoin."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pagoda.fleet.gate.auth import ApiKeys
from pagoda.fleet.gate.gate import Gate
from pagoda.fleet.gate.limits import LimitError, RequestLimits
from pagoda.fleet.api.lora_admin import LoRAAdmin
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.routing.router import Router

KEY = "sk-lora-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


class FakeTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


class FakeReplica:
    """A replica's LoRA control surface: adapters by name, and injectable refusals."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.adapters: dict[str, str] = {}
        self.refuse_load = None  # an error message every load gets
        self.in_use: set[str] = set()
        self.num_requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v2/models/pagoda/generate", self.generate)
        return app

    async def generate(self, request: web.Request) -> web.Response:
        self.num_requests += 1
        body = await request.json()
        action, name = body["lora_action"], body.get("lora_name")
        if action == "list":
            return _ok({"action": "list", "loaded": sorted(self.adapters), "paths": dict(self.adapters),
                        "allow_runtime_lora": True})
        if action == "load":
            if self.refuse_load:
                return _refused(self.refuse_load)
            if name in self.adapters:
                return _refused(f"lora_name: an adapter named {name!r} is already loaded")
            self.adapters[name] = body["lora_path"]
            return _ok({"action": "load", "lora_name": name, "lora_path": body["lora_path"],
                        "loaded": sorted(self.adapters)})
        if name not in self.adapters:
            return _refused(f"lora_name: unknown adapter {name!r}; loaded adapters: none")
        if name in self.in_use:
            return _refused(f"lora_name: adapter {name!r} is in use by running or waiting requests")
        path = self.adapters.pop(name)
        return _ok({"action": "unload", "lora_name": name, "lora_path": path, "loaded": sorted(self.adapters)})


def _ok(document):
    return web.json_response({"model_name": "pagoda", "text_output": json.dumps(document)})


def _refused(message):
    return web.json_response({"error": message}, status=400)


async def _fleet(allow_runtime: bool):
    """Three fake replicas and the router's HTTP app over them (API keys on; the key is an admin key)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagoda.fleet.api.http_api import make_app
    from pagoda.fleet.api.openai_api import OpenAIApi
    from pagoda.fleet.api.tracing import RouterTracer
    from pagoda.fleet.api.upstream import GrpcUpstream

    fakes = {rid: FakeReplica(rid) for rid in ("r0", "r1", "r2")}
    servers = {rid: TestServer(fake.app()) for rid, fake in fakes.items()}
    for server in servers.values():
        await server.start_server()
    replicas = ReplicaSet("static")
    replicas.set_members((rid, {"grpc": "127.0.0.1:1", "http": f"127.0.0.1:{server.port}"})
                         for rid, server in servers.items())
    router = Router(replicas, FakeTokenizer(), "smol", "least_loaded")
    gate = Gate(RequestLimits(), ApiKeys.parse(f"{KEY} acme admin", "keys"))
    admin = LoRAAdmin((), allow_runtime, ("smol", "pagoda"))
    tracer = RouterTracer(InMemorySpanExporter(), batch=False)
    openai = OpenAIApi(router, tracer, gate, admin, GrpcUpstream(router, gate), "smol")
    client = TestClient(TestServer(make_app(router, tracer, gate, admin, openai)))
    await client.start_server()
    return router, fakes, servers, client


async def _close(servers, client):
    await client.close()
    for server in servers.values():
        await server.close()


async def _post(client, path, body, headers=AUTH):
    async with client.post(path, data=json.dumps(body), headers=headers) as response:
        return response.status, await response.json()


async def _models(client):
    async with client.get("/v1/models", headers=AUTH) as response:
        return {m["id"]: m.get("parent") for m in (await response.json())["data"]}


def test_runtime_lora_is_refused_unless_the_router_allows_it():
    async def scenario():
        router, fakes, servers, client = await _fleet(allow_runtime=False)
        try:
            status, body = await _post(client, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a"})
            assert status == 403 and "--allow-runtime-lora" in body["error"]["message"]
            status, body = await _post(client, "/v2/models/pagoda/generate",
                                       {"lora_action": "unload", "lora_name": "x"})
            assert status == 403 and "runtime LoRA updating is not enabled on this router" in body["error"]
            status, body = await _post(client, "/v2/models/pagoda/generate", {"lora_action": "list"})
            assert status == 200 and json.loads(body["text_output"])["loaded"] == []
            assert all(fake.num_requests == 0 for fake in fakes.values())
        finally:
            await _close(servers, client)

    asyncio.run(scenario())


def test_load_and_unload_fan_out_all_or_nothing():
    async def scenario():
        router, fakes, servers, client = await _fleet(allow_runtime=True)
        try:
            status, body = await _post(client, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"},
                                       headers={})
            assert status == 401  # the /v1 API keys guard it
            status, body = await _post(client, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
            assert status == 200 and body == {"action": "load", "lora_name": "sql", "lora_path": "/a/sql",
                                              "replicas": ["r0", "r1", "r2"]}
            assert all(fake.adapters == {"sql": "/a/sql"} for fake in fakes.values())
            assert await _models(client) == {"smol": None, "sql": "smol"}
            for bad, message in [({"lora_name": "sql", "lora_path": "/a/sql"}, "already loaded"),
                                 ({"lora_name": "smol", "lora_path": "/a"}, "the base model's name"),
                                 ({"lora_name": "x"}, "lora_path: required")]:
                status, body = await _post(client, "/v1/load_lora_adapter", bad)
                assert status == 400 and message in body["error"]["message"], body

            # A load one replica refuses is rolled back on the others, and the error says so.
            fakes["r2"].refuse_load = "LoRA adapter 'bad': /nowhere is not a folder"
            status, body = await _post(client, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nowhere"})
            assert status == 400, body
            assert body["error"]["message"] == (
                "loading LoRA adapter 'bad' failed on 1 of 3 replicas: r2: LoRA adapter 'bad': /nowhere is not a "
                "folder. It was unloaded again on r0, r1.")
            assert all("bad" not in fake.adapters for fake in fakes.values())
            assert "bad" not in await _models(client)
            fakes["r2"].refuse_load = None

            # An unload one replica refuses (in use) is undone where it succeeded.
            fakes["r1"].in_use.add("sql")
            status, body = await _post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})
            assert status == 400 and "failed on 1 of 3 replicas: r1: lora_name: adapter 'sql' is in use" in \
                body["error"]["message"] and "It was loaded again on r0, r2." in body["error"]["message"]
            assert all(fake.adapters == {"sql": "/a/sql"} for fake in fakes.values())
            assert "sql" in await _models(client)
            fakes["r1"].in_use.clear()

            # Through the Triton HTTP door (what `pagoda lora --url ROUTER` sends).
            status, body = await _post(client, "/v2/models/pagoda/generate",
                                       {"lora_action": "unload", "lora_name": "sql"})
            assert status == 200 and json.loads(body["text_output"]) == {
                "action": "unload", "lora_name": "sql", "replicas": ["r0", "r1", "r2"]}
            assert all(fake.adapters == {} for fake in fakes.values())
            assert await _models(client) == {"smol": None}
            status, body = await _post(client, "/v1/completions", {"model": "sql", "prompt": "hi"})
            assert status == 404 and "does not exist" in body["error"]["message"]
            status, body = await _post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})
            assert status == 404 and "no adapter named 'sql' is loaded" in body["error"]["message"]
            status, body = await _post(client, "/v2/models/pagoda/generate",
                                       {"lora_action": "list", "text_input": "hi"})
            assert status == 400 and "cannot be combined with generation inputs (text_input)" in body["error"]
        finally:
            await _close(servers, client)

    asyncio.run(scenario())


def test_rejoining_replica_gets_runtime_adapters_replayed_and_its_own_learned():
    """The health prober's path for a replica that was not routable: list its adapters
    (a name the router did not serve is learned), load the run-time ones it lacks, then
    route to it; a failed replay keeps it unhealthy with the reason."""
    from pagoda.fleet.service import RouterOptions, RouterService

    async def scenario():
        router, fakes, servers, client = await _fleet(allow_runtime=True)
        try:
            from pagoda.fleet.api.http_api import LORA_KEY

            service = RouterService(RouterOptions())
            service.router, service.lora_admin = router, client.server.app[LORA_KEY]
            status, _ = await _post(client, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
            assert status == 200
            r2 = router.replicas.get("r2")
            router.replicas.mark_unhealthy(r2, "restarting")
            fakes["r2"].adapters = {"native": "/n"}  # restarted with its own --lora native, no sql
            await service._admit_ready(r2)
            assert r2.healthy and fakes["r2"].adapters == {"native": "/n", "sql": "/a/sql"}
            assert await _models(client) == {"smol": None, "sql": "smol", "native": "smol"}
            r0 = router.replicas.get("r0")
            router.replicas.mark_unhealthy(r0, "restarting")
            fakes["r0"].adapters, fakes["r0"].refuse_load = {}, "runtime LoRA updating is not enabled"
            await service._admit_ready(r0)
            assert not r0.healthy and r0.unhealthy_reason == (
                "LoRA replay of 'sql' failed: runtime LoRA updating is not enabled")
            fakes["r0"].refuse_load = None
            await service._admit_ready(r0)  # the next probe
            assert r0.healthy and fakes["r0"].adapters == {"sql": "/a/sql"}
            num_before = fakes["r0"].num_requests
            await service._admit_ready(r0)  # already synced and healthy: no control request
            assert fakes["r0"].num_requests == num_before
        finally:
            await _close(servers, client)

    asyncio.run(scenario())


def test_grpc_door_refuses_control_requests():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from tritonclient.grpc import service_pb2

    from pagoda.fleet.api.grpc_proxy import GrpcProxy
    from pagoda.fleet.api.tracing import RouterTracer
    from pagoda.fleet.api.upstream import GrpcUpstream

    router = Router(ReplicaSet("static"), FakeTokenizer(), "smol", "least_loaded")
    gate = Gate()
    proxy = GrpcProxy(router, RouterTracer(InMemorySpanExporter(), batch=False), gate, GrpcUpstream(router, gate))
    request = service_pb2.ModelInferRequest()
    request.inputs.add(name="lora_action", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 4) + b"list")
    with pytest.raises(LimitError, match="send LoRA control requests to its HTTP door"):
        asyncio.run(proxy._admit(request, None))
