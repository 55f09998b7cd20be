"""Routing measured for real: policies on two live CPU replicas, and the router's own overhead.

``run_real_comparison`` starts a Redis-backed fleet of two ``tritonserver`` replicas
(default SmolLM2, each publishing block events and heartbeats) with a deliberately small
KV cache, and for each policy runs the same multi-tenant shared-prefix workload through a
``pagoda router`` (in this process): ``num_tenants`` tenants, each with a long system
prompt, send short questions from ``concurrency`` closed-loop gRPC streaming clients.
Each policy run uses its own ``cache_salt``, so every policy starts from a cold cache
(salted blocks share nothing). Reported per policy: the replicas' prefix-cache hit rate
(``vllm:prefix_cache_hits`` / ``_queries`` deltas, in tokens), client-side TTFT p50/p90,
wall time, and how the requests split over the replicas.

``measure_router_overhead`` times one routing decision exactly as the router makes it
(``Router.analyze``: tokenize with the model's tokenizer and hash the blocks; then
``Router.choose``: index match + policy + in-flight accounting) for ~1k-token prompts,
with the index read from Redis per request (``direct``) and from the stream-fed mirror
(``follower``), against a real Redis holding eight replicas' worth of index entries.

``main`` is what ``pagoda bench routing --real`` runs: by default the burst comparison of
``pagoda.bench.routing_bursts`` (issue 16's workload: sequential, 4 clients, fanout);
``--workload tenants`` runs ``run_real_comparison`` and the overhead timing.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import random
import threading
import time
from typing import Any, Optional, Sequence

from pagoda.bench.fleet_harness import metric, one_request, percentile, two_replicas, words

POLICIES = ("random", "round_robin", "least_loaded", "prefix_aware")


# ------------------------------------------------------------------ overhead
def measure_router_overhead(redis_url: str, model_dir: Optional[str] = None, num_samples: int = 1000,
                            prompt_tokens: int = 1024, num_replicas: int = 8) -> dict[str, dict[str, float]]:
    """p50/p99/max of one decision (ms) per index mode, plus tokenize+hash alone."""
    from pagoda.contracts.kv_events import BlockStored
    from pagoda.fleet.index.prefix_index import PrefixIndex, make_redis_client
    from pagoda.fleet.index.registry import ReplicaRegistry
    from pagoda.fleet.routing.replicas import ReplicaSet
    from pagoda.fleet.routing.fleet_view import FleetView
    from pagoda.fleet.routing.router import Router
    from pagoda.models.tokenizer import Tokenizer

    if model_dir is None:
        from pagoda.models.gguf_import import ensure_default_model

        model_dir = str(ensure_default_model())
    tokenizer = Tokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    prompts = []
    for _ in range(16):
        text = words(rng, prompt_tokens)
        while len(tokenizer.encode(text)) > prompt_tokens:
            text = text.rsplit(" ", 8)[0]
        prompts.append(text)
    namespace = f"bench-router-{rng.randrange(1 << 30):x}"
    client = make_redis_client(redis_url)
    index = PrefixIndex(client, namespace)
    results: dict[str, dict[str, float]] = {}
    try:
        replicas = ReplicaSet("static")
        replicas.set_members((f"r{i}", {"grpc": f"10.0.0.{i}:8001", "http": f"10.0.0.{i}:8000"})
                             for i in range(num_replicas))
        probe = Router(replicas, tokenizer, namespace, "prefix_aware", None, block_size=16)
        for i, prompt in enumerate(prompts):
            hashes = probe.analyze(prompt).block_hashes
            for r in range(num_replicas):
                if (i + r) % 3 == 0:
                    keep = rng.randrange(1, len(hashes) + 1)
                    index.apply(f"r{r}", [BlockStored(hashes[:keep], None, [], 16)], epoch="bench", first_seq=i)
        times = []
        cpu_times = []
        for i in range(num_samples):
            start, cpu_start = time.perf_counter(), time.thread_time()
            probe.analyze(prompts[i % len(prompts)])
            times.append(time.perf_counter() - start)
            cpu_times.append(time.thread_time() - cpu_start)
        results["tokenize+hash"] = _summary(times, cpu_times)
        for mode in ("direct", "follower"):
            fleet = FleetView(make_redis_client(redis_url), namespace, mode, timeout_s=0.05)
            fleet.available = True
            fleet.start()
            router = Router(replicas, tokenizer, namespace, "prefix_aware", fleet, block_size=16)
            try:
                if fleet.follower is not None:
                    deadline = time.monotonic() + 10
                    while not fleet.follower.is_synced and time.monotonic() < deadline:
                        time.sleep(0.01)
                results[mode] = asyncio.run(_time_decisions(router, prompts, num_samples))
            finally:
                fleet.stop()
    finally:
        registry = ReplicaRegistry(client, namespace)
        for r in range(num_replicas):
            registry.remove_replica(f"r{r}")
        client.delete(f"pagoda:{namespace}:events")
    return results


async def _time_decisions(router: Any, prompts: Sequence[str], num_samples: int) -> dict[str, float]:
    times, cpu_times = [], []
    for i in range(num_samples):
        start, cpu_start = time.perf_counter(), time.thread_time()
        decision = await router.choose(router.analyze(prompts[i % len(prompts)]))
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - cpu_start)
        router.release(decision)
    return _summary(times, cpu_times)


def _summary(times: Sequence[float], cpu_times: Sequence[float] = ()) -> dict[str, float]:
    """Wall-clock p50/p99/max, and the p99 of this thread's CPU time (what contention does not inflate;
    it excludes the wait for Redis, which the wall-clock figures include)."""
    out = {"p50_ms": percentile(times, 0.5) * 1e3, "p99_ms": percentile(times, 0.99) * 1e3,
           "max_ms": max(times) * 1e3}
    if cpu_times:
        out["cpu_p99_ms"] = percentile(cpu_times, 0.99) * 1e3
    return out




def run_real_comparison(redis_url: str, policies: Sequence[str] = POLICIES, num_tenants: int = 6,
                        prefix_words: int = 300, requests_per_policy: int = 36, concurrency: int = 2,
                        max_tokens: int = 4, kv_cache_memory_bytes: int = 96 * 1024 * 1024, seed: int = 0,
                        log_dir: str = "/tmp") -> list[dict[str, Any]]:
    """Run every policy over the same workload on two real replicas; one result dict per policy."""
    from pagoda.fleet.service import BackgroundRouter, RouterOptions

    rng = random.Random(seed)
    prefixes = [f"Tenant {t} system prompt. " + words(rng, prefix_words) for t in range(num_tenants)]
    workload = [(rng.randrange(num_tenants), f"\nQuestion {i}: {words(rng, 6)}?") for i in range(requests_per_policy)]
    namespace = f"bench-real-{rng.randrange(1 << 30):x}"
    rows = []
    with two_replicas(redis_url, namespace, kv_cache_memory_bytes, log_dir) as servers:
        spec = ";".join(f"id={rid},grpc={s.grpc_url},http={s.http_url}" for rid, s in servers.items())
        for policy in policies:
            options = RouterOptions(replicas=spec, redis_url=redis_url, model_name=namespace, policy=policy,
                                    host="127.0.0.1", http_port=0, grpc_port=0, registry_interval_s=0.2)
            salt = f"{policy}-{seed}"
            before = {rid: (metric(s, "vllm:prefix_cache_hits_total"), metric(s, "vllm:prefix_cache_queries_total"))
                      for rid, s in servers.items()}
            with BackgroundRouter(options) as router:
                jobs: queue.Queue = queue.Queue()
                for item in workload:
                    jobs.put(item)
                ttfts: list[float] = []
                errors: list[str] = []

                def worker() -> None:
                    while True:
                        try:
                            tenant, question = jobs.get_nowait()
                        except queue.Empty:
                            return
                        try:
                            ttfts.append(one_request(router.grpc_url, prefixes[tenant] + question, salt, max_tokens))
                        except Exception as exc:  # noqa: BLE001 - counted, reported
                            errors.append(str(exc))

                start = time.perf_counter()
                threads = [threading.Thread(target=worker) for _ in range(concurrency)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - start
                split = router.run(lambda: {r.replica_id: r.num_routed for r in router.service.router.replicas.all()})
            time.sleep(0.5)  # metrics of the last responses
            hits = sum(metric(s, "vllm:prefix_cache_hits_total") - before[rid][0] for rid, s in servers.items())
            queries = sum(metric(s, "vllm:prefix_cache_queries_total") - before[rid][1] for rid, s in servers.items())
            rows.append({"policy": policy, "hit_rate": hits / queries if queries else 0.0,
                         "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
                         "wall_s": wall, "num_errors": len(errors), "split": split})
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'policy':<14}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'wall':>8}{'errors':>8}  split"]
    for r in rows:
        lines.append(f"{r['policy']:<14}{r['hit_rate']:>9.1%}{r['ttft_p50_s']:>9.2f}s{r['ttft_p90_s']:>9.2f}s"
                     f"{r['wall_s']:>7.1f}s{r['num_errors']:>8}  {r['split']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``pagoda bench routing --real`` (and ``--router-overhead``)."""
    p = argparse.ArgumentParser(prog="pagoda bench routing --real", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--requests", type=int, default=36, help="requests per policy")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="each replica's KV cache (default 96 for tenants: capacity matters; 256 for bursts)")
    p.add_argument("--overhead-only", action="store_true", help="only time routing decisions (no replicas)")
    p.add_argument("--samples", type=int, default=1000, help="decisions timed per index mode")
    p.add_argument("--workload", default="bursts", choices=("bursts", "tenants"),
                   help="bursts: issue 16's 5 prefixes x 6 questions, sequential / 4 clients / fanout "
                        "(pagoda.bench.routing_bursts); tenants: the multi-tenant capacity comparison")
    p.add_argument("--patterns", default="sequential,clients4,fanout", help="with --workload bursts")
    p.add_argument("--seeds", default="0", help="with --workload bursts: shuffles/burst draws to run (e.g. 0,1)")
    args = p.parse_args([a for a in (argv or []) if a != "--real"])
    if args.workload == "bursts" and not args.overhead_only:
        from pagoda.bench import routing_bursts as bench_bursts

        policies = [x for x in args.policies.split(",") if x] if args.policies != ",".join(POLICIES) \
            else list(bench_bursts.BURST_POLICIES)
        patterns = [x for x in args.patterns.split(",") if x]
        scenarios = [sc for seed in args.seeds.split(",") if seed
                     for sc in bench_bursts.make_scenarios(patterns=patterns, seed=int(seed))]
        rows = bench_bursts.run_burst_comparison(args.redis_url, policies, scenarios,
                                                 kv_cache_memory_bytes=(args.kv_cache_mib or 256) * 1024 * 1024)
        print(bench_bursts.format_burst_rows(rows))
        return 0
    print("router overhead, ~1k-token prompts, 8 replicas in the index (ms):")
    for name, stats in measure_router_overhead(args.redis_url, num_samples=args.samples).items():
        print(f"  {name:<14}" + "  ".join(f"{k}={v:.3f}" for k, v in stats.items()))
    if args.overhead_only:
        return 0
    rows = run_real_comparison(args.redis_url, [x for x in args.policies.split(",") if x], args.tenants,
                               args.prefix_words, args.requests, args.concurrency,
                               kv_cache_memory_bytes=(args.kv_cache_mib or 96) * 1024 * 1024)
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
