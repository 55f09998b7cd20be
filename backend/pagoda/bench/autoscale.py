"""``pagoda bench autoscale``: the operator's autoscaler replayed on the routing simulator.

For each trace (``ramp``, ``burst``; ``pagoda.bench.autoscale_replay``) it runs the
autoscaled fleet (``pagoda_operator.autoscaler.AutoscalerPolicy`` ticking every 15 s on the
replicas' reported load, TTFT P90 SLO target ``--slo``, drain before every scale-in) and a
static fleet as large as the autoscaled one ever got, and prints replica-hours, TTFT
P50/P90, SLO attainment (requests with TTFT <= SLO; 30 s windows whose P90 met it),
scale-up lag (first SLO breach -> first scale-up decision -> first new replica routable)
and the scale-ins (count, mean drain time, index entries deleted).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace
from typing import Optional, Sequence

from pagoda.bench.autoscale_replay import AutoscaleReplay, ReplayConfig, ReplayResult


def run(traces: Sequence[str], base: ReplayConfig) -> list[tuple[str, ReplayResult]]:
    """The autoscaled fleet and its static counterpart for each trace."""
    rows = []
    for trace in traces:
        cfg = replace(base, trace=trace)
        auto = AutoscaleReplay(cfg).run()
        rows.append(("autoscaled", auto))
        static = AutoscaleReplay(replace(cfg, static_replicas=auto.max_replicas_seen)).run()
        rows.append((f"static {auto.max_replicas_seen}", static))
    return rows


def _lag(a: Optional[float], b: Optional[float]) -> str:
    return f"{b - a:.0f}" if a is not None and b is not None else "-"


def format_rows(rows: Sequence[tuple[str, ReplayResult]]) -> str:
    lines = [f"{'trace':<6} {'fleet':<11} {'max N':>5} {'replica-h':>9} {'P50 s':>6} {'P90 s':>6} "
             f"{'req<=SLO':>8} {'win<=SLO':>8} {'breach->up s':>12} {'up->ready s':>11} {'scale-ins':>9} "
             f"{'drain s':>7} {'index del':>9}"]
    for name, r in rows:
        ordered = sorted(r.ttfts)
        p50 = ordered[len(ordered) // 2] if ordered else math.nan
        drain_s = statistics.mean(d for d, _ in r.drains) if r.drains else math.nan
        deleted = sum(n for _, n in r.drains)
        breach = _lag(r.first_breach_s, r.first_scale_up_s) if name == "autoscaled" else "-"
        ready = _lag(r.first_scale_up_s, r.first_ready_s) if name == "autoscaled" else "-"
        lines.append(f"{r.cfg.trace:<6} {name:<11} {r.max_replicas_seen:>5} {r.replica_hours:>9.2f} {p50:>6.2f} "
                     f"{r.p90():>6.2f} {r.attainment():>8.1%} {r.window_attainment():>8.1%} {breach:>12} "
                     f"{ready:>11} {len(r.drains):>9} {drain_s:>7.1f} {deleted:>9}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench autoscale", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="ramp,burst")
    p.add_argument("--base-rate", type=float, default=0.5, help="requests/s outside the peak")
    p.add_argument("--peak-rate", type=float, default=4.0, help="requests/s at the peak")
    p.add_argument("--duration", type=float, default=1200.0, help="simulated seconds")
    p.add_argument("--slo", type=float, default=4.0,
                   help="TTFT P90 target, seconds (a cold 1.1k-token prefill alone takes ~2 s)")
    p.add_argument("--startup", type=float, default=30.0, help="seconds from scale-up to a routable pod")
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--policy", default="prefix_aware")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    base = ReplayConfig(base_rate=args.base_rate, peak_rate=args.peak_rate, duration_s=args.duration,
                        ttft_slo_s=args.slo, startup_s=args.startup, max_replicas=args.max_replicas,
                        policy=args.policy, seed=args.seed)
    start = time.perf_counter()
    try:
        rows = run([t for t in args.traces.split(",") if t], base)
    except ValueError as exc:
        p.error(str(exc))
    print(format_rows(rows))
    print(f"({time.perf_counter() - start:.0f}s wall)")
    return 0
