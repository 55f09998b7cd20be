"""`pagoda router`'s command line: flags -> ``RouterOptions`` -> a ``RouterService`` until a signal.

``make_parser`` is the one list of the router's flags (``tests/operator`` parses the
arguments the operator renders for the router's Deployment with it);
``options_from_args`` turns parsed flags into ``RouterOptions`` (``--policy-knob KEY=VALUE``
pairs into floats, ``--redis-timeout-ms`` into seconds, ``--no-grpc`` into no gRPC port, the
``limits`` group into ``RequestLimits``); ``main`` serves until SIGINT or SIGTERM, then stops
the service (the doors drain first, ``RouterService.stop``). A bad flag value exits with
status 1 and one line naming it, no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from typing import Optional

from pagoda.fleet.gate.flow_control import FlowOptions
from pagoda.fleet.gate.limits import RequestLimits
from pagoda.fleet.parsers.reasoning import REASONING_PARSERS
from pagoda.fleet.parsers.tool_calls import TOOL_PARSERS
from pagoda.fleet.service import RouterOptions, RouterService
from pagoda.serving.media_fetch import media_flags

POLICIES = ("random", "round_robin", "least_loaded", "prefix_aware", "precise", "approximate")


def add_parser_flags(p: argparse.ArgumentParser) -> None:
    """``--reasoning-parser`` and ``--tool-call-parser`` (``fleet.parsers``; ``pagoda serve`` has them too)."""
    p.add_argument("--reasoning-parser", choices=("none", "harmony", *REASONING_PARSERS),
                   help="how chat answers' reasoning is read (default: from the chat template; none: not at all)")
    p.add_argument("--tool-call-parser", choices=("harmony", *TOOL_PARSERS),
                   help="the tool-call format of tool_choice auto answers (default: from the chat template)")


def make_parser() -> argparse.ArgumentParser:
    """The parser of every ``pagoda router`` flag (defaults as ``RouterOptions``'s)."""
    p = argparse.ArgumentParser(
        prog="pagoda router",
        description="Cache-aware router (Triton gRPC/HTTP and OpenAI) in front of pagoda replicas.")
    p.add_argument("--model-dir", help="the served model's folder (its tokenizer); default: $PAGODA_MODEL_DIR "
                                       "or the default SmolLM2 import")
    p.add_argument("--model-name", help="served model name and Redis key namespace; default: $PAGODA_MODEL_NAME "
                                        "or the model folder's name")
    p.add_argument("--lora", action="append", default=[], metavar="NAME",
                   help="a LoRA adapter the replicas serve (repeatable): listed in /v1/models, chosen by 'model'; "
                        "optional: adapters the replicas have are learned when they become ready")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="accept /v1/load_lora_adapter and /v1/unload_lora_adapter (and `pagoda lora` control "
                        "requests), applied to every replica (started with --allow-runtime-lora)")
    add_parser_flags(p)
    p.add_argument("--response-store", action="store_true",
                   help="keep Responses API turns so a request can continue one (previous_response_id): in the "
                        "fleet's Redis with --redis-url, else in the router's memory; off by default")
    p.add_argument("--response-store-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="how long a stored Responses API turn is kept (default 3600)")
    media_flags(p)
    p.add_argument("--hash-model-id",
                   help="block-hash root (default: the model folder's name; replicas' heartbeats override)")
    p.add_argument("--replicas",
                   help="static replicas: 'id=a,grpc=host:port,http=host:port[,metrics=host:port][,kv=host:port]"
                        "[,role=mixed|prefill|decode];...'")
    p.add_argument("--k8s-selector", help="discover ready pods with these labels (a=b,c=d) in the router's namespace")
    p.add_argument("--k8s-namespace", help="namespace for --k8s-selector (default: $PAGODA_NAMESPACE or the pod's)")
    p.add_argument("--k8s-api", help="API server URL (default: in-cluster)")
    p.add_argument("--redis-url", help="redis://[:password@]host:port/db; $(PAGODA_REDIS_PASSWORD) is expanded")
    p.add_argument("--policy", default="prefix_aware", choices=POLICIES)
    p.add_argument("--policy-knob", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy knob (see pagoda.fleet.routing.policy), e.g. load_cost_tokens=64")
    p.add_argument("--index", dest="index_mode", default="follower", choices=("follower", "direct"),
                   help="prefix matches from a local mirror of the event stream, or from Redis per request")
    p.add_argument("--redis-timeout-ms", type=float, default=50.0, help="longest a request waits on Redis")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--grpc-port", type=int, default=8081)
    p.add_argument("--no-grpc", action="store_true", help="no gRPC door (HTTP and OpenAI only)")
    p.add_argument("--otlp-endpoint",
                   help="OTLP/gRPC trace receiver (default: $OTEL_EXPORTER_OTLP_ENDPOINT; none: off)")
    p.add_argument("--block-size", type=int, default=16, help="used until a replica heartbeat reports its own")
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--max-attempts", type=int, default=2, help="replicas tried when a connection is refused")
    p.add_argument("--peer-pull-min-blocks", type=int, default=4,
                   help="pull a prefix a peer holds when it gains this many blocks and beats recomputing "
                        "(docs/kv_transfer.md); 0: never")
    p.add_argument("--migration-limit", type=int, default=3, metavar="N",
                   help="times one request may move to another replica when its replica fails mid-request "
                        "(docs/reliability.md: restarted while nothing was sent, resumed once it streamed); 0: off")
    _add_tenant_flags(p)
    _add_flow_flags(p)
    limits = p.add_argument_group("limits", "input limits; a request over one gets a 4xx naming it")
    for f in dataclasses.fields(RequestLimits):
        limits.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, help=f"default {f.default}")
    return p


def _add_tenant_flags(p: argparse.ArgumentParser) -> None:
    tenants = p.add_argument_group("tenants", "API keys, cache isolation and rate limits (pagoda.fleet.gate.auth)")
    tenants.add_argument("--api-keys-file", help="lines 'KEY TENANT [rpm=N] [tpm=N] [concurrency=N]' (default: "
                                                 "$PAGODA_API_KEYS; neither: open mode, no authentication)")
    tenants.add_argument("--share-prefix-cache", action="store_true",
                         help="let tenants share cached blocks (default: each tenant's cache_salt isolates it)")
    tenants.add_argument("--router-secret-file", help="bytes keying tenant cache salts (HMAC); the same on every "
                         "router (default: $PAGODA_ROUTER_SECRET; neither: derived from the API keys)")
    tenants.add_argument("--tenant-rpm", type=float, help="requests per minute per tenant (keys may override)")
    tenants.add_argument("--tenant-tpm", type=float,
                         help="tokens (prompt + n x max_tokens, settled with usage) per minute per tenant")
    tenants.add_argument("--tenant-max-concurrent", type=int, help="requests in flight per tenant")


def _add_flow_flags(p: argparse.ArgumentParser) -> None:
    flow = p.add_argument_group("flow control", "requests wait at the router while the fleet is saturated, released "
                                "fairly between tenants by tokens, priority bands first (docs/reliability.md)")
    flow.add_argument("--queue-size-per-tenant", type=int, default=0, metavar="N",
                      help="requests a tenant may have waiting at the router; one more is refused 429 (0: flow "
                           "control off, a saturated fleet answers 429/503 at once)")
    flow.add_argument("--queue-max-wait", type=float, default=30.0, metavar="SECONDS",
                      help="the longest a request waits at the router before a 429 (a request's own timeout, when "
                           "shorter, bounds it instead)")
    flow.add_argument("--max-in-flight-per-replica", type=int, default=0, metavar="N",
                      help="a replica with N of the router's requests in flight is saturated (0: no bound by count; "
                           "its overload refusals and heartbeats still say so)")
    flow.add_argument("--tenant-share-window", type=float, default=1.0, metavar="SECONDS",
                      help="a tenant whose request ended this recently keeps its share of the fleet's in-flight "
                           "capacity (with --max-in-flight-per-replica): another tenant cannot take its slot")
    flow.add_argument("--saturation-waiting", type=int, default=0, metavar="N",
                      help="a replica whose heartbeat (Redis) reports N waiting requests is saturated (0: not read)")
    flow.add_argument("--saturation-kv-usage", type=float, default=0.0, metavar="FRACTION",
                      help="a replica whose heartbeat (Redis) reports this KV usage is saturated (0: not read)")


def flow_options(args: argparse.Namespace) -> FlowOptions:
    """The flow-control flags. Raises ValueError naming the one out of range."""
    options = FlowOptions(queue_size=args.queue_size_per_tenant, max_wait_s=args.queue_max_wait,
                          max_in_flight_per_replica=args.max_in_flight_per_replica,
                          saturation_waiting=args.saturation_waiting, saturation_kv_usage=args.saturation_kv_usage,
                          share_window_s=args.tenant_share_window)
    options.check()
    return options


def options_from_args(args: argparse.Namespace) -> RouterOptions:
    """The ``RouterOptions`` parsed flags describe.

    Raises:
        ValueError: a ``--policy-knob`` that is not ``KEY=VALUE``, a negative ``--migration-limit``, a
            flow-control flag out of range.
    """
    knobs = {}
    for item in args.policy_knob:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-knob: expected KEY=VALUE, got {item!r}")
        knobs[key] = float(value)
    if args.migration_limit < 0:
        raise ValueError(f"--migration-limit: must be >= 0 (0 turns migration off), got {args.migration_limit}")
    return RouterOptions(
        model_dir=args.model_dir, model_name=args.model_name, hash_model_id=args.hash_model_id,
        lora_names=tuple(args.lora), allow_runtime_lora=args.allow_runtime_lora,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        response_store=args.response_store, response_store_ttl_s=args.response_store_ttl,
        allowed_media_domains=args.allowed_media_domains, media_fetch_timeout_s=args.media_fetch_timeout,
        max_media_bytes=args.max_media_bytes,
        replicas=args.replicas, k8s_selector=args.k8s_selector, k8s_namespace=args.k8s_namespace,
        k8s_api=args.k8s_api, redis_url=args.redis_url, policy=args.policy, policy_knobs=knobs,
        index_mode=args.index_mode, redis_timeout_s=args.redis_timeout_ms / 1e3, host=args.host,
        http_port=args.http_port, grpc_port=None if args.no_grpc else args.grpc_port,
        otlp_endpoint=args.otlp_endpoint, block_size=args.block_size, health_interval_s=args.health_interval,
        max_attempts=args.max_attempts, peer_pull_min_blocks=args.peer_pull_min_blocks,
        migration_limit=args.migration_limit,
        api_keys_file=args.api_keys_file, share_prefix_cache=args.share_prefix_cache,
        router_secret_file=args.router_secret_file, tenant_requests_per_minute=args.tenant_rpm,
        tenant_tokens_per_minute=args.tenant_tpm, tenant_max_concurrent=args.tenant_max_concurrent,
        limits=RequestLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)}),
        flow=flow_options(args))


async def _serve(options: RouterOptions) -> None:
    service = RouterService(options)
    await service.start()
    grpc = f"{options.host}:{service.grpc_port}" if options.grpc_port is not None else "off"
    replicas = ", ".join(r.replica_id for r in service.router.replicas.all()) or "(from the registry)"
    print(f"pagoda router ({options.policy}) serving model '{service.model_name}'\n"
          f"  HTTP/OpenAI http://{options.host}:{service.http_port}  (/v2/models/pagoda/generate_stream, /v1/...)\n"
          f"  gRPC        {grpc}\n"
          f"  replicas    {replicas}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        print("stopping the router ...", file=sys.stderr, flush=True)
        await service.stop()


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``pagoda router``; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = options_from_args(make_parser().parse_args(argv))
        asyncio.run(_serve(options))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"pagoda router: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
