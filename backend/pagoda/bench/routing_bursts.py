"""Routing under bursts, measured on live replicas (``pagoda bench routing --real``).

The workload of issue 16: ``num_prefixes`` long shared prefixes (~500 tokens each) x
``questions_per_prefix`` short questions, in a shuffled order, sent through a ``pagoda
router`` (in this process) to two real CPU replicas (``fleet_harness.two_replicas``), under
three arrival patterns:

- ``sequential``: one closed-loop client (each request waits for the previous one): the
  index always knows a prefix before its next request is routed;
- ``clients4``: ``concurrency`` closed-loop clients taking the next request from the
  shuffled list: requests sharing a prefix arrive while its first one is still queued or
  prefilling, before any KV event, which used to split prefixes across replicas;
- ``fanout``: open loop, bursts (``pagoda.fleet.sim.arrivals`` "fanout"): all questions of one
  prefix within 50 ms, bursts at Poisson times.

Each (pattern, policy) run starts from a cold cache (its own ``cache_salt``). Reported:
the replicas' prompt-token hit rate (``vllm:prefix_cache_hits`` / ``_queries`` deltas),
client TTFT P50/P90, wall time, the split over the replicas, and the router's matched
tokens by kind (``exact`` KV-event index / ``pending`` routing-time affinity).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagoda.bench.fleet_harness import metric, one_request, percentile, two_replicas, words

BURST_POLICIES = ("round_robin", "least_loaded", "precise", "prefix_aware")
PATTERNS = ("sequential", "clients4", "fanout")


@dataclass
class Scenario:
    name: str
    prompts: list[str]
    concurrency: int = 1  # closed-loop clients (ignored with arrival_times)
    arrival_times: Optional[list[float]] = None  # open loop: when each prompt is sent (s from start)


def make_scenarios(num_prefixes: int = 5, questions_per_prefix: int = 6, prefix_words: int = 470,
                   concurrency: int = 4, burst_rate: float = 1.0, seed: int = 0,
                   patterns: Sequence[str] = PATTERNS) -> list[Scenario]:
    """The issue-16 workload under each arrival pattern (module docstring)."""
    from pagoda.fleet.sim.arrivals import arrivals

    rng = random.Random(seed)
    prefixes = [f"Tenant {t} system prompt. " + words(rng, prefix_words) for t in range(num_prefixes)]
    jobs = [prefixes[t] + f"\nQuestion {q}: {words(rng, 6)}?" for t in range(num_prefixes)
            for q in range(questions_per_prefix)]
    rng.shuffle(jobs)
    out = []
    for pattern in patterns:
        name = pattern if seed == 0 else f"{pattern}/s{seed}"  # names salt the cache: unique per seed
        if pattern == "sequential":
            out.append(Scenario(name, jobs, 1))
        elif pattern == "clients4":
            out.append(Scenario(name, jobs, concurrency))
        elif pattern == "fanout":
            times = arrivals("fanout", num_prefixes * questions_per_prefix, burst_rate, num_prefixes, 0.0, rng,
                             burst_size=questions_per_prefix)
            prompts = [prefixes[t] + f"\nBurst question {i}: {words(rng, 6)}?" for i, (_, t) in enumerate(times)]
            out.append(Scenario(name, prompts, arrival_times=[t - times[0][0] for t, _ in times]))
        else:
            raise ValueError(f"unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    return out


def _drive(scenario: Scenario, url: str, salt: str, max_tokens: int) -> tuple[list[float], list[str], float]:
    """Send the scenario's prompts; returns (TTFTs, errors, wall seconds)."""
    ttfts: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def send(prompt: str) -> None:
        try:
            ttft = one_request(url, prompt, salt, max_tokens)
            with lock:
                ttfts.append(ttft)
        except Exception as exc:  # noqa: BLE001 - counted, reported
            with lock:
                errors.append(str(exc))

    start = time.perf_counter()
    if scenario.arrival_times is not None:
        threads = []
        for prompt, at in zip(scenario.prompts, scenario.arrival_times):
            time.sleep(max(0.0, at - (time.perf_counter() - start)))
            threads.append(threading.Thread(target=send, args=(prompt,)))
            threads[-1].start()
    else:
        queue = list(reversed(scenario.prompts))

        def client() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop()
                send(prompt)

        threads = [threading.Thread(target=client) for _ in range(scenario.concurrency)]
        for t in threads:
            t.start()
    for t in threads:
        t.join()
    return ttfts, errors, time.perf_counter() - start


def run_burst_comparison(redis_url: str, policies: Sequence[str] = BURST_POLICIES,
                         scenarios: Optional[Sequence[Scenario]] = None, max_tokens: int = 4,
                         kv_cache_memory_bytes: int = 256 * 1024 * 1024, seed: int = 0,
                         log_dir: str = "/tmp") -> list[dict[str, Any]]:
    """Every (scenario, policy) on two real replicas; one result dict per run."""
    from pagoda.fleet.service import BackgroundRouter, RouterOptions

    scenarios = list(scenarios if scenarios is not None else make_scenarios(seed=seed))
    namespace = f"bench-bursts-{random.Random(seed).randrange(1 << 30):x}"
    rows = []
    with two_replicas(redis_url, namespace, kv_cache_memory_bytes, log_dir) as servers:
        spec = ";".join(f"id={rid},grpc={s.grpc_url},http={s.http_url}" for rid, s in servers.items())
        for scenario in scenarios:
            for policy in policies:
                options = RouterOptions(replicas=spec, redis_url=redis_url, model_name=namespace, policy=policy,
                                        host="127.0.0.1", http_port=0, grpc_port=0, registry_interval_s=0.2)
                before = {rid: (metric(s, "vllm:prefix_cache_hits_total"),
                                metric(s, "vllm:prefix_cache_queries_total")) for rid, s in servers.items()}
                with BackgroundRouter(options) as router:
                    ttfts, errors, wall = _drive(scenario, router.grpc_url, f"{scenario.name}-{policy}-{seed}",
                                                 max_tokens)
                    core = router.service.router
                    split = router.run(lambda: {r.replica_id: r.num_routed for r in core.replicas.all()})
                    match_tokens = router.run(lambda: dict(core.num_match_tokens))
                time.sleep(0.5)  # metrics of the last responses
                hits = sum(metric(s, "vllm:prefix_cache_hits_total") - before[rid][0] for rid, s in servers.items())
                queries = sum(metric(s, "vllm:prefix_cache_queries_total") - before[rid][1]
                              for rid, s in servers.items())
                rows.append({"pattern": scenario.name, "policy": policy, "hit_rate": hits / queries if queries else 0.0,
                             "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
                             "wall_s": wall, "num_errors": len(errors), "split": split,
                             "match_tokens": match_tokens})
                print(format_burst_rows(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def format_burst_rows(rows: Sequence[dict[str, Any]], header: bool = True) -> str:
    lines = [f"{'pattern':<14}{'policy':<14}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'wall':>8}{'errors':>7}"
             f"  split / matched tokens exact+pending"] if header else []
    for r in rows:
        m = r["match_tokens"]
        lines.append(f"{r['pattern']:<14}{r['policy']:<14}{r['hit_rate']:>9.1%}{r['ttft_p50_s']:>9.2f}s"
                     f"{r['ttft_p90_s']:>9.2f}s{r['wall_s']:>7.1f}s{r['num_errors']:>7}  "
                     f"{r['split']} / {m['exact']}+{m['pending']}")
    return "\n".join(lines)
