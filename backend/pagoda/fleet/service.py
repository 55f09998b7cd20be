"""`pagoda router`: one endpoint (Triton gRPC + HTTP + OpenAI) in front of many replicas.

Pieces (each in its own module):

- ``routing.router``: prompt -> block hashes -> prefix-index match + load -> policy ->
  replica, with optimistic in-flight accounting; ``routing.fleet_view``: Redis (registry,
  index) with fault handling (load-only fallback);
- ``routing.replicas``: membership (``--replicas``, ``--k8s-selector``: ``routing.k8s_discovery``, or the
  registry), health, load;
- ``gate.gate`` (with ``limits`` and ``auth``): input limits, API keys -> tenants -> cache
  salt, per-tenant rate limits, overload memory;
- ``api.lora_admin``: the served LoRA adapters; run-time load/unload on every replica
  (``--allow-runtime-lora``); a replica that (re)joins has its adapters listed and the
  run-time ones replayed before it is routable;
- ``api.upstream``: the gRPC client that streams one routed request to a replica;
- the doors: ``api.grpc_proxy`` (Triton's ``GRPCInferenceService``, ``--grpc-port``,
  default 8081), ``api.http_api`` + ``api.openai_api`` (``/v2/...`` generate and ``/v1/...``
  OpenAI routes, ``--http-port``, default 8080);
- ``api.tracing``: a span per routed request, ``traceparent`` forwarded to the replica.

Composition: ``RouterService.start`` makes each piece once and passes it to the
constructors that use it (the gate and the upstream client, with its peer-pull decision,
to both streaming doors; the LoRA admin to the HTTP and OpenAI doors). ``RouterService``
owns them and two background tasks: the registry refresh (every ``registry_interval_s``:
heartbeat load, block size, hash model id; its first success after a failure brings
prefix routing back) and the health prober (every ``health_interval_s``: ``ServerReady``;
a replica marked unhealthy becomes routable again once it answers ready and its LoRA
adapters are synced: ``lora_admin``). ``BackgroundRouter`` runs a service on its own
thread and event loop (tests, ``pagoda bench routing --real``). The command line
(``pagoda router``'s flags and main) is ``router_cli``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pagoda.fleet.gate.flow_control import FlowOptions
from pagoda.fleet.gate.limits import RequestLimits
from pagoda.fleet.shutdown import STOP_PHASE_S, bounded

if TYPE_CHECKING:
    from pagoda.fleet.api.lora_admin import LoRAAdmin
    from pagoda.fleet.api.response_store import ResponseStore
    from pagoda.fleet.api.tracing import RouterTracer
    from pagoda.fleet.gate.gate import Gate
    from pagoda.fleet.routing.replicas import Replica
    from pagoda.fleet.routing.router import Router
    from pagoda.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# When the router stops, requests in flight on every door get this long to finish (HTTP
# connections and gRPC streams alike; gRPC's was 1 s, so its streams were cut first).
HTTP_SHUTDOWN_TIMEOUT_S = 10.0
DRAIN_GRACE_S = HTTP_SHUTDOWN_TIMEOUT_S

PASSWORD_ENV = "PAGODA_REDIS_PASSWORD"


@dataclass
class RouterOptions:
    """Everything ``pagoda router`` accepts (``router_cli.make_parser`` says what each means)."""

    model_dir: Optional[str] = None
    model_name: Optional[str] = None
    lora_names: tuple = ()  # LoRA adapters the replicas serve (OpenAI model names)
    allow_runtime_lora: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter (lora_admin)
    reasoning_parser: Optional[str] = None  # fleet.parsers: None detects it from the chat template
    tool_call_parser: Optional[str] = None
    response_store: bool = False  # keep Responses API turns for previous_response_id (fleet.api.response_store)
    response_store_ttl_s: float = 3600.0
    allowed_media_domains: Optional[str] = None  # http(s) image URLs fetched from these hosts (serving.media_fetch)
    media_fetch_timeout_s: float = 5.0
    max_media_bytes: int = 20 * 2**20
    hash_model_id: Optional[str] = None
    replicas: Optional[str] = None
    k8s_selector: Optional[str] = None
    k8s_namespace: Optional[str] = None
    k8s_api: Optional[str] = None
    redis_url: Optional[str] = None
    policy: str = "prefix_aware"
    policy_knobs: dict[str, float] = field(default_factory=dict)
    index_mode: str = "follower"
    redis_timeout_s: float = 0.05
    host: str = "0.0.0.0"
    http_port: int = 8080
    grpc_port: Optional[int] = 8081  # None: no gRPC door (pagoda serve's per-replica OpenAI door)
    otlp_endpoint: Optional[str] = None
    block_size: int = 16
    registry_interval_s: float = 0.5
    health_interval_s: float = 2.0
    max_attempts: int = 2
    peer_pull_min_blocks: int = 4  # pull a prefix a peer holds from this many blocks on; 0: never (routing.peer_pull)
    migration_limit: int = 3  # migrations per request when its replica fails (api.migration); 0: off
    # Tenants (pagoda.fleet.gate.auth): keys file (else $PAGODA_API_KEYS; neither: open mode).
    api_keys_file: Optional[str] = None
    share_prefix_cache: bool = False
    router_secret_file: Optional[str] = None  # keys tenant salts (else $PAGODA_ROUTER_SECRET; gate.auth)
    tenant_requests_per_minute: Optional[float] = None  # defaults for keys without their own
    tenant_tokens_per_minute: Optional[float] = None
    tenant_max_concurrent: Optional[int] = None
    limits: Optional[RequestLimits] = None  # None: the defaults
    flow: Optional[FlowOptions] = None  # the router's queue (gate.flow_control); None: off


def make_gate(options: RouterOptions) -> "Gate":
    """The ``Gate`` (limits, API keys, rate limits) the options describe."""
    from pagoda.fleet.gate.auth import Tenant, load_api_keys, load_router_secret
    from pagoda.fleet.gate.gate import Gate

    defaults = Tenant("", options.tenant_requests_per_minute, options.tenant_tokens_per_minute,
                      options.tenant_max_concurrent)
    keys = load_api_keys(options.api_keys_file, defaults)
    secret = load_router_secret(options.router_secret_file, keys=keys) if keys is not None else None
    return Gate(options.limits, keys, options.share_prefix_cache, salt_secret=secret, flow=options.flow)


def resolve_redis_url(url: str, environ: Optional[dict[str, str]] = None) -> str:
    """Expand ``$(PAGODA_REDIS_PASSWORD)`` (as the kubelet would) and ``${VAR}`` in a Redis URL."""
    env = os.environ if environ is None else environ
    url = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), url)
    return os.path.expandvars(url) if environ is None else url


class RouterService:
    """The running router: servers, background tasks, and the ``Router`` they share.

    Args:
        options: the configuration.
        tracer: a ``RouterTracer`` to use instead of one built from ``otlp_endpoint``.
        tokenizer: a ``Tokenizer`` to use instead of loading ``model_dir``'s.
    """

    def __init__(self, options: RouterOptions, tracer: Optional["RouterTracer"] = None,
                 tokenizer: Optional["Tokenizer"] = None) -> None:
        self.options = options
        self._tracer = tracer
        self._tokenizer = tokenizer
        self.router: Optional["Router"] = None  # from start()
        self.gate: Optional["Gate"] = None
        self.lora_admin: Optional["LoRAAdmin"] = None
        self.tracer: Optional["RouterTracer"] = None
        self.model_name = ""
        self.http_port = 0
        self.grpc_port = 0
        self._tasks: list[asyncio.Task] = []
        self._grpc_server: Any = None
        self._http_runner: Any = None
        self._discovery: Any = None
        self._redis: Any = None

    async def start(self) -> "RouterService":
        """Compose the pieces (module docstring), start the background tasks, then serve."""
        from pagoda.fleet.api.lora_admin import LoRAAdmin
        from pagoda.fleet.api.tracing import make_router_tracer

        o = self.options
        if o.replicas and o.k8s_selector:
            raise ValueError("give --replicas or --k8s-selector, not both")
        if not (o.replicas or o.k8s_selector or o.redis_url):
            raise ValueError("the router needs replicas: --replicas, --k8s-selector or --redis-url (registry)")
        otlp_endpoint = o.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        self.tracer = self._tracer or make_router_tracer(otlp_endpoint)
        self.router = self._make_router()
        self.gate = make_gate(o)
        self.gate.announce()
        self.lora_admin = LoRAAdmin(o.lora_names, o.allow_runtime_lora, (self.model_name, "pagoda"))
        if o.k8s_selector:
            self._start_discovery()
        if self.router.fleet is not None:
            await self._refresh_registry()
            self._tasks.append(asyncio.create_task(self._registry_loop(), name="pagoda-router-registry"))
        # Probe once before serving, so a replica that is down at start is never tried.
        await asyncio.gather(*(self.probe(r) for r in self.router.replicas.all()), return_exceptions=True)
        self._tasks.append(asyncio.create_task(self._health_loop(), name="pagoda-router-health"))
        await self._serve_doors()
        return self

    def _make_router(self) -> "Router":
        """The ``Router`` over the options' replicas, tokenizer and (with Redis) ``FleetView``."""
        from pagoda.fleet.routing.fleet_view import FleetView
        from pagoda.fleet.routing.image_routing import RouterImages
        from pagoda.fleet.routing.replicas import ReplicaSet, parse_replicas_spec
        from pagoda.fleet.routing.router import Router
        from pagoda.models.tokenizer import Tokenizer

        o = self.options
        model_dir = o.model_dir or os.environ.get("PAGODA_MODEL_DIR")
        if not model_dir:
            from pagoda.models.gguf_import import ensure_default_model

            model_dir = str(ensure_default_model())
        folder = Path(model_dir).resolve().name
        self.model_name = o.model_name or os.environ.get("PAGODA_MODEL_NAME") or folder
        tokenizer = self._tokenizer or Tokenizer.from_pretrained(model_dir)
        replicas = ReplicaSet("static" if o.replicas else "kubernetes" if o.k8s_selector else "registry")
        if o.replicas:
            members = parse_replicas_spec(o.replicas)
            replicas.set_members((rid or endpoints["grpc"], endpoints) for rid, endpoints in members)
        fleet = None
        if o.redis_url:
            from pagoda.fleet.index.prefix_index import make_redis_client

            # Short socket timeouts, no retries: a dead Redis fails fast into load-only routing.
            self._redis = make_redis_client(resolve_redis_url(o.redis_url))
            fleet = FleetView(self._redis, self.model_name, o.index_mode, o.redis_timeout_s)
            fleet.start()
        return Router(replicas, tokenizer, o.hash_model_id or folder, o.policy, fleet,
                      block_size=o.block_size, images=RouterImages.from_model_dir(model_dir), **o.policy_knobs)

    def _start_discovery(self) -> None:
        from pagoda.fleet.routing.k8s_discovery import KubernetesConfig, KubernetesDiscovery

        o = self.options
        config = (KubernetesConfig(o.k8s_api, o.k8s_namespace or os.environ.get("PAGODA_NAMESPACE") or "default")
                  if o.k8s_api else KubernetesConfig.in_cluster(o.k8s_namespace))
        self._discovery = KubernetesDiscovery(self.router.replicas, o.k8s_selector, config)
        self._discovery.start()

    def _response_store(self) -> Optional["ResponseStore"]:
        """Where Responses API turns are kept: the fleet's Redis when the router has one, else memory."""
        from pagoda.fleet.api.response_store import MemoryResponseStore, RedisResponseStore

        o = self.options
        if not o.response_store:
            return None
        if self._redis is not None:
            return RedisResponseStore(self._redis, self.model_name, o.response_store_ttl_s)
        return MemoryResponseStore(o.response_store_ttl_s)

    async def _serve_doors(self) -> None:
        """The doors over the composed pieces: gRPC, then HTTP with the OpenAI routes."""
        from aiohttp import web

        from pagoda.fleet.api.grpc_proxy import GrpcProxy, make_grpc_server
        from pagoda.fleet.api.http_api import make_app
        from pagoda.fleet.api.http_runner import make_runner
        from pagoda.fleet.api.messages_api import MessagesApi
        from pagoda.fleet.api.openai_api import OpenAIApi
        from pagoda.fleet.api.responses_api import ResponsesApi
        from pagoda.fleet.api.migration import Migrations
        from pagoda.fleet.api.openai_images import MEDIA
        from pagoda.fleet.api.upstream import GrpcUpstream
        from pagoda.serving.media_fetch import make_fetcher

        o = self.options
        MEDIA.fetcher = make_fetcher(o.allowed_media_domains, o.max_media_bytes, o.media_fetch_timeout_s)
        migrations = Migrations(o.migration_limit)  # one for every door: /metrics counts them all
        upstream = self.upstream = GrpcUpstream(self.router, self.gate, o.max_attempts, o.peer_pull_min_blocks,
                                                migrations)
        grpc_door = GrpcProxy(self.router, self.tracer, self.gate, upstream)
        openai_door = OpenAIApi(self.router, self.tracer, self.gate, self.lora_admin, upstream, self.model_name,
                                parsers=(self.options.reasoning_parser, self.options.tool_call_parser))
        app = make_app(self.router, self.tracer, self.gate, self.lora_admin, openai_door, migrations)
        ResponsesApi(openai_door, self._response_store()).add_routes(app)
        MessagesApi(openai_door).add_routes(app)
        if o.grpc_port is not None:
            self._grpc_server, self.grpc_port = make_grpc_server(grpc_door, o.host, o.grpc_port)
            await self._grpc_server.start()
        # A client that disconnects cancels its handler, and with it the upstream gRPC stream
        # (GrpcUpstream.stream cancels its call), so the replica aborts the request and frees
        # its KV blocks — for non-streaming requests too, which otherwise ran to completion.
        # shutdown_timeout bounds how long stop() waits for open connections (aiohttp's
        # default, 60 s, made a router with one idle keep-alive client take a minute to stop).
        self._http_runner = make_runner(app, HTTP_SHUTDOWN_TIMEOUT_S)  # echoes no unparsable header
        await self._http_runner.setup()
        site = web.TCPSite(self._http_runner, o.host, o.http_port)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]

    async def _refresh_registry(self) -> None:
        infos = await self.router.fleet.refresh()
        if infos is not None:
            self.router.apply_heartbeats(infos)

    async def _registry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.registry_interval_s)
            try:
                await self._refresh_registry()
            except Exception:  # noqa: BLE001 - never let the loop die
                logger.exception("registry refresh failed")

    async def probe(self, replica: "Replica") -> bool:
        """Ask one replica ``ServerReady``; update its health; return whether it is ready and routable."""
        import grpc
        from tritonclient.grpc import service_pb2

        try:
            response = await replica.probe_stub().ServerReady(service_pb2.ServerReadyRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.router.replicas.mark_unhealthy(replica, f"health probe: {exc.code().name}")
            return False
        if response.ready:
            await self._admit_ready(replica)
        else:
            self.router.replicas.mark_unhealthy(replica, "health probe: not ready")
        return bool(response.ready) and replica.healthy

    async def _admit_ready(self, replica: "Replica") -> None:
        """A ready replica becomes routable; one that was not (or is new) first gets its LoRA
        adapters synced (``lora_admin.sync``: learn its adapters, replay the run-time ones)."""
        if not replica.healthy or not replica.lora_synced:
            reason = await self.lora_admin.sync(replica)
            replica.lora_synced = reason is None
            if reason is not None:
                self.router.replicas.mark_unhealthy(replica, reason)
                return
        self.router.replicas.mark_healthy(replica)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            replicas = self.router.replicas.all()
            await asyncio.gather(*(self.probe(r) for r in replicas), return_exceptions=True)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await bounded("background tasks", asyncio.gather(*self._tasks, return_exceptions=True))
        self._tasks.clear()
        if self._discovery is not None:
            await bounded("Kubernetes discovery", self._discovery.stop())
        doors = []  # both doors drain together, each with the same grace
        if self._grpc_server is not None:
            doors.append(self._grpc_server.stop(grace=DRAIN_GRACE_S))
        if self._http_runner is not None:
            doors.append(self._http_runner.cleanup())
        await bounded("the doors' drain", asyncio.gather(*doors), DRAIN_GRACE_S + STOP_PHASE_S)
        if self.router is not None:
            if self.router.fleet is not None:
                self.router.fleet.stop()
            await bounded("closing the replicas' channels", self.router.replicas.close())
        if self._redis is not None:
            self._redis.close()
        if self.tracer is not None and self._tracer is None:
            self.tracer.shutdown()


class BackgroundRouter:
    """A ``RouterService`` on its own thread and event loop (a context manager).

    Attributes after start: ``http_url`` (``127.0.0.1:port``), ``grpc_url``, ``service``.
    """

    def __init__(self, options: RouterOptions, **service_kwargs: Any) -> None:
        self.service = RouterService(options, **service_kwargs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pagoda-router", daemon=True)

    def call(self, coroutine: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the router's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def run(self, fn: Any, timeout: float = 60.0) -> Any:
        """Run a plain function on the router's loop (to read its state safely)."""

        async def wrapper():
            return fn()

        return self.call(wrapper(), timeout)

    def __enter__(self) -> "BackgroundRouter":
        self._thread.start()
        try:
            self.call(self.service.start(), timeout=300)
        except BaseException:
            self.__exit__()
            raise
        self.http_url = f"127.0.0.1:{self.service.http_port}"
        self.grpc_url = f"127.0.0.1:{self.service.grpc_port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.call(self.service.stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.loop.close()
