"""``pagoda bench routing``: routing policies compared in a calibrated fleet simulator.

Default: the routing ladder. For N = 8, 16, 32 simulated replicas (``pagoda.fleet.sim.simulator``:
the real scheduler and block pool, a step-time model fitted to the real engine), replay
the multi-tenant shared-prefix workload (``max(24, 6 * N)`` tenants with 1024-token
system prompts, Zipf popularity, ``--rate-per-replica * N`` requests per second; the
tenants' prompts need 3x (N = 8) to 12x (N = 32) one replica's KV capacity) under each
arrival process of ``--arrivals`` (``pagoda.fleet.sim.arrivals``: poisson, fanout bursts of 8
same-tenant requests, diurnal) and each policy of the ladder: random, least_loaded
("load"), approximate (routing-time affinity only), precise (KV events only) and
prefix_aware (both); print P50/P90 TTFT, P90 relative to random, output throughput and
prefix hit rate per (arrival, N, policy).

``--plot FILE``: the ladder as a figure (``bench.plots.routing_ladder``: P90 TTFT against N
per arrival process, and the TTFT CDF of each policy at the largest N).

``--rates R1,R2,...``: goodput against offered load instead of the ladder: at the first N of
``--replicas``, the first arrival process, each rate (requests/s per replica) and policy,
the requests per second whose TTFT met ``--ttft-slo-s``; with ``--plot`` as curves
(``bench.plots.goodput_curve``).

Other modes:
  --calibrate      time the real engine (SmolLM2 on this machine) over prefill and decode
                   steps of several shapes, fit ``a + b*tokens + c*context`` by least
                   squares, print it and write it to ``--step-model-out``.
  --overhead       time one routing decision (hash a 1k-token prompt, ``PrefixIndex.match``
                   in a real Redis at ``--redis-url``, ``choose``) and print p50/p99;
                   ``time_routing_decision`` is the reusable part.
"""

from __future__ import annotations

import argparse
import sys
import platform
import random
import time
from typing import Callable, Optional, Sequence

from pagoda.bench import plots
from pagoda.fleet.sim.arrivals import ARRIVALS
from pagoda.fleet.routing.policy import POLICIES, Policy, ReplicaState, RoutingRequest, make_policy
from pagoda.fleet.sim.simulator import (
    DEFAULT_STEP_MODEL, FleetSimulator, ReplicaConfig, SimResult, StepTimeModel, WorkloadConfig, make_workload,
)

POLICY_ORDER = ("random", "least_loaded", "approximate", "precise", "prefix_aware")
ARRIVAL_ORDER = ("poisson", "fanout", "diurnal")


def workload_for(num_replicas: int, rate_per_replica: float, requests_per_replica: int, seed: int,
                 tenants_per_replica: int = 6, min_tenants: int = 24, arrival: str = "poisson") -> WorkloadConfig:
    """``max(min_tenants, tenants_per_replica * N)`` tenants: their system prompts (68 blocks
    each) exceed one replica's 1024 blocks at every N, but fit in the fleet's aggregate."""
    num_tenants = max(min_tenants, tenants_per_replica * num_replicas)
    return WorkloadConfig(num_tenants=num_tenants, arrival_rate=rate_per_replica * num_replicas,
                          num_requests=requests_per_replica * num_replicas, seed=seed, arrival=arrival)


def run_comparison(replica_counts: Sequence[int], policies: Sequence[str] = POLICY_ORDER, *,
                   step_model: StepTimeModel = DEFAULT_STEP_MODEL, rate_per_replica: float = 0.4,
                   requests_per_replica: int = 100, seed: int = 0, arrivals: Sequence[str] = ("poisson",),
                   replica_config: Optional[ReplicaConfig] = None,
                   on_result: Callable[[SimResult], None] = lambda r: None) -> list[SimResult]:
    """Simulate every (arrival, N, policy) triple; the policies of one (arrival, N) see the same workload."""
    results = []
    for arrival in arrivals:
        for n in replica_counts:
            workload = make_workload(workload_for(n, rate_per_replica, requests_per_replica, seed, arrival=arrival))
            for name in policies:
                knobs = {"seed": seed} if name == "random" else {}
                sim = FleetSimulator(n, make_policy(name, **knobs), step_model, replica_config or ReplicaConfig())
                result = sim.run(workload)
                result.arrival = arrival
                on_result(result)
                results.append(result)
    return results


def format_table(results: Sequence[SimResult]) -> str:
    """One row per (arrival, N, policy), with the P90 TTFT of the baseline over this one's at the
    same (arrival, N): the baseline is ``random`` when it ran, else the first policy listed."""
    base: dict[tuple[str, int], float] = {}
    for r in sorted(results, key=lambda r: r.policy != "random"):
        base.setdefault((r.arrival, r.num_replicas), r.percentile(0.9))
    lines = [f"{'arrival':<8} {'N':>3} {'policy':<13} {'P50 TTFT s':>10} {'P90 TTFT s':>10} {'base/this P90':>15} "
             f"{'out tok/s':>9} {'hit rate':>8} {'busy':>5} {'preempt':>7}"]
    for r in results:
        p90 = r.percentile(0.9)
        ratio = base.get((r.arrival, r.num_replicas), float("nan")) / p90 if p90 > 0 else float("nan")
        lines.append(f"{r.arrival:<8} {r.num_replicas:>3} {r.policy:<13} {r.percentile(0.5):>10.3f} {p90:>10.3f} "
                     f"{ratio:>14.1f}x {r.throughput:>9.1f} {r.hit_rate:>8.1%} {r.busy_fraction:>5.0%} "
                     f"{r.num_preemptions:>7}")
    return "\n".join(lines)


def run_rate_sweep(num_replicas: int, rates_per_replica: Sequence[float], policies: Sequence[str], *,
                   slo_s: float, **knobs) -> dict[str, list[tuple[float, float, float]]]:
    """Goodput against offered load: ``run_comparison`` at each rate (``knobs``: its other
    arguments, one arrival process).

    Returns:
        policy -> [(offered requests/s, requests/s with TTFT <= ``slo_s``, that fraction)].
    """
    curves: dict[str, list[tuple[float, float, float]]] = {name: [] for name in policies}
    for rate in rates_per_replica:
        for result in run_comparison([num_replicas], policies, rate_per_replica=rate, **knobs):
            good = sum(1 for ttft in result.ttfts if ttft <= slo_s)
            fraction = good / len(result.ttfts) if result.ttfts else 0.0
            curves[result.policy].append((rate * num_replicas, good / result.makespan_s if result.makespan_s else 0.0,
                                          fraction))
    return curves


def format_goodput(curves: dict[str, list[tuple[float, float, float]]], slo_s: float) -> str:
    """One row per (offered rate, policy)."""
    lines = [f"{'offered req/s':>13} {'policy':<13} {'goodput req/s':>13} {f'TTFT <= {slo_s:g} s':>14}"]
    for rate in sorted({point[0] for points in curves.values() for point in points}):
        for policy, points in curves.items():
            for offered, goodput, fraction in points:
                if offered == rate:
                    lines.append(f"{offered:>13.2f} {policy:<13} {goodput:>13.2f} {fraction:>14.1%}")
    return "\n".join(lines)


# ------------------------------------------------------------------ calibration


def calibrate(model: Optional[str] = None, seed: int = 0, quick: bool = False,
              log: Callable[[str], None] = print) -> tuple[StepTimeModel, list[tuple[int, int, float]]]:
    """Fit the step-time model to the real engine on this machine.

    Runs prefill-only steps (one prompt of 32..1024 tokens) and decode steps (batches of
    1..32 requests at contexts of 64..768 tokens) and times each ``engine.step()``.

    Returns:
        (the fitted model, the samples as (num_batched_tokens, sum_context, seconds)).
    """
    import numpy as np

    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, max_num_seqs=64,
                                    max_num_batched_tokens=2048))
    rng = random.Random(seed)
    samples: list[tuple[int, int, float]] = []
    schedule = engine.scheduler.schedule
    shapes: list = []

    def recording_schedule():
        out = schedule()
        shapes.append((out.total_num_scheduled_tokens,
                       sum(s.num_computed_tokens + s.num_new_tokens for s in out.scheduled)))
        return out

    engine.scheduler.schedule = recording_schedule

    def run(prompt_lens: Sequence[int], max_tokens: int, record: bool = True) -> None:
        for i, n in enumerate(prompt_lens):
            prompt = [rng.randrange(1000, 30000) for _ in range(n)]
            engine.add_request(f"c{len(samples)}-{i}-{rng.random()}", prompt,
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
        while engine.has_unfinished_requests():
            shapes.clear()
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            if record and shapes and shapes[0][0] > 0:
                samples.append((*shapes[0], elapsed))

    run([16], 2, record=False)  # warm-up
    prefill_lens = (32, 128, 512, 1024) if quick else (32, 64, 128, 256, 512, 768, 1024, 1024)
    for n in prefill_lens:
        run([n], 1)
    batches = ((1, 64), (8, 256), (32, 64)) if quick else ((1, 64), (1, 768), (8, 64), (8, 512), (16, 256),
                                                            (32, 64), (32, 384))
    for batch, context in batches:
        run([context] * batch, 6)
        log(f"calibrate: batch {batch} x context {context} done ({len(samples)} steps timed)")
    a, b, c = fit_step_model(samples)
    where = f"{engine.model_id} on {platform.machine()} {platform.processor() or ''} ({_num_cpus()} CPUs)".strip()
    return StepTimeModel(a=round(a, 6), b=round(b, 9), c=round(c, 10), source=where), samples


def fit_step_model(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares ``a + b*tokens + c*context`` to (tokens, context, seconds), robust to
    outliers (a shared machine stalls some steps): fit, drop samples off by more than 3x
    the median absolute residual, refit. Coefficients are clamped at 0."""
    import numpy as np

    x = np.array([[1.0, t, c] for t, c, _ in samples])
    y = np.array([s for _, _, s in samples])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(3):
        coef, *_ = np.linalg.lstsq(x[keep], y[keep], rcond=None)
        residual = np.abs(x @ coef - y)
        keep = residual <= 3 * max(float(np.median(residual[keep])), 1e-6)
    return tuple(max(0.0, float(v)) for v in coef)


def _num_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ------------------------------------------------------------------ router overhead


def time_routing_decision(match: Callable[[list[str]], dict[str, int]], policy: Policy,
                          replicas: Sequence[ReplicaState], prompts: Sequence[Sequence[int]], block_size: int,
                          model_id: str, num_samples: int = 1000) -> dict[str, float]:
    """Time what a router does per request: hash the prompt's blocks, look them up
    (``match``: ``PrefixIndex.match`` for Redis, ``IndexFollower.match`` for the local
    mirror), and ``policy.choose``.

    Returns:
        {"p50_ms", "p99_ms", "max_ms", "mean_ms"} over ``num_samples`` decisions.
    """
    from pagoda.contracts.block_hash import hash_prompt_blocks

    times = []
    for i in range(num_samples):
        prompt = prompts[i % len(prompts)]
        start = time.perf_counter()
        hashes = [h.hex() for h in hash_prompt_blocks(prompt, block_size, model_id)]
        matched = match(hashes)
        policy.choose(replicas, RoutingRequest(f"t{i}", hashes, len(prompt), block_size, matched))
        times.append(time.perf_counter() - start)
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1000  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": times[-1] * 1000,
            "mean_ms": sum(times) / len(times) * 1000}


def measure_overhead(redis_url: str, num_replicas: int = 8, prompt_tokens: int = 1024, block_size: int = 16,
                     num_samples: int = 1000) -> dict[str, dict[str, float]]:
    """Populate a scratch model namespace in Redis with ``num_replicas`` replicas holding
    prefixes of the test prompts, then time decisions via Redis and via a follower."""
    from pagoda.contracts.block_hash import hash_prompt_blocks
    from pagoda.contracts.kv_events import BlockStored
    from pagoda.fleet.index.mirror import IndexFollower
    from pagoda.fleet.index.prefix_index import PrefixIndex, make_redis_client
    from pagoda.fleet.index.registry import ReplicaRegistry

    model = f"bench-overhead-{random.randrange(1 << 30):x}"
    client = make_redis_client(redis_url)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_tokens)] for _ in range(16)]
    index = PrefixIndex(client, model)
    replicas = [ReplicaState(f"r{i}") for i in range(num_replicas)]
    try:
        for i, prompt in enumerate(prompts):
            hashes = [h.hex() for h in hash_prompt_blocks(prompt, block_size, model)]
            for r in range(num_replicas):
                keep = rng.randrange(len(hashes) + 1) if (i + r) % 3 == 0 else 0
                if keep:
                    index.apply(f"r{r}", [BlockStored(hashes[:keep], None, [], block_size)], epoch="bench",
                                first_seq=i * num_replicas + r)
        follower = IndexFollower(client, model)
        follower.sync()
        policy = make_policy("prefix_aware")
        return {
            "redis": time_routing_decision(index.match, policy, replicas, prompts, block_size, model, num_samples),
            "follower": time_routing_decision(follower.match, policy, replicas, prompts, block_size, model,
                                              num_samples),
        }
    finally:
        registry = ReplicaRegistry(client, model)
        for r in range(num_replicas):
            registry.remove_replica(f"r{r}")
        client.delete(f"pagoda:{model}:events")


# ------------------------------------------------------------------ CLI


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--real" in argv:
        # The same policies for real: two CPU replicas behind the router (bench/routing_real.py).
        from pagoda.bench import routing_real as bench_real

        return bench_real.main([a for a in argv if a != "--real"])
    p = argparse.ArgumentParser(prog="pagoda bench routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="8,16,32", help="comma-separated fleet sizes")
    p.add_argument("--policies", default=",".join(POLICY_ORDER), help=f"of {', '.join(sorted(POLICIES))}")
    p.add_argument("--arrivals", default=",".join(ARRIVAL_ORDER), help="of poisson, fanout, diurnal, ramp")
    p.add_argument("--rate-per-replica", type=float, default=0.4, help="mean arrivals per second per replica")
    p.add_argument("--requests-per-replica", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-model", help="a JSON written by --calibrate (default: the shipped coefficients)")
    p.add_argument("--calibrate", action="store_true", help="fit the step-time model to the real engine here")
    p.add_argument("--quick", action="store_true", help="with --calibrate: fewer shapes")
    p.add_argument("--model", help="with --calibrate: a model folder (default SmolLM2)")
    p.add_argument("--step-model-out", default=None, help="with --calibrate: write the fit to this JSON")
    p.add_argument("--overhead", action="store_true", help="time routing decisions against a real Redis")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--plot", default=None, help="write the ladder (or with --rates, the goodput curves) as a PNG")
    p.add_argument("--rates", default=None,
                   help="comma-separated requests/s per replica: goodput against offered load instead of the ladder")
    p.add_argument("--ttft-slo-s", type=float, default=2.0, help="with --rates: the TTFT objective goodput counts")
    p.add_argument("--real", action="store_true",
                   help="run the comparison on two real replicas instead (see pagoda.bench.routing_real --help)")
    args = p.parse_args(argv)

    if args.calibrate:
        model, samples = calibrate(args.model, args.seed, args.quick)
        for tokens, context, seconds in samples:
            print(f"  tokens={tokens:5d} context={context:6d} measured={seconds * 1000:8.1f} ms "
                  f"model={model.step_time(tokens, context) * 1000:8.1f} ms")
        print(f"step time = {model.a:.6f} + {model.b:.3e} * tokens + {model.c:.3e} * context  ({model.source})")
        if args.step_model_out:
            model.save(args.step_model_out)
            print(f"wrote {args.step_model_out}")
        return 0
    if args.overhead:
        for name, stats in measure_overhead(args.redis_url).items():
            print(f"{name:<9} " + "  ".join(f"{k}={v:.3f}" for k, v in stats.items()))
        return 0

    try:
        counts = [int(n) for n in args.replicas.split(",") if n]
        policies = [n for n in args.policies.split(",") if n]
        arrival_kinds = [n for n in args.arrivals.split(",") if n]
        for name in policies:
            make_policy(name)
        for kind in arrival_kinds:
            if kind not in ARRIVALS:
                raise ValueError(f"unknown arrival process {kind!r}; known: {', '.join(ARRIVALS)}")
    except ValueError as exc:
        p.error(str(exc))
    step_model = StepTimeModel.load(args.step_model) if args.step_model else DEFAULT_STEP_MODEL
    print(f"step model: {step_model.a} + {step_model.b} * tokens + {step_model.c} * context ({step_model.source})")
    start = time.perf_counter()
    progress = lambda r: print(f"  simulated {r.arrival} N={r.num_replicas} {r.policy} "  # noqa: E731
                               f"({time.perf_counter() - start:.0f}s)", flush=True)
    knobs = dict(step_model=step_model, requests_per_replica=args.requests_per_replica, seed=args.seed,
                 on_result=progress)
    problem = plots.missing_matplotlib() if args.plot else None
    if args.rates:
        rates = [float(r) for r in args.rates.split(",") if r]
        curves = run_rate_sweep(counts[0], rates, policies, slo_s=args.ttft_slo_s, arrivals=arrival_kinds[:1],
                                **knobs)
        print(format_goodput(curves, args.ttft_slo_s))
        title = (f"goodput, N = {counts[0]}, {arrival_kinds[0]} arrivals, {args.requests_per_replica} requests per "
                 f"replica, seed {args.seed}; simulated ({step_model.source})")
        draw = lambda: plots.goodput_curve(curves, args.plot, title, args.ttft_slo_s)  # noqa: E731
    else:
        results = run_comparison(counts, policies, rate_per_replica=args.rate_per_replica, arrivals=arrival_kinds,
                                 **knobs)
        print(format_table(results))
        title = (f"routing ladder, {args.rate_per_replica} req/s per replica, {args.requests_per_replica} requests "
                 f"per replica, seed {args.seed}; simulated ({step_model.source})")
        draw = lambda: plots.routing_ladder(results, args.plot, title)  # noqa: E731
    if args.plot and problem:
        print(problem)  # the numbers above stand; only the picture needs matplotlib
    elif args.plot:
        draw()
        print(f"wrote {args.plot}")
    print(f"({time.perf_counter() - start:.0f}s wall)")
    return 0
