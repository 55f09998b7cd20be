"""Arrival processes for the routing simulator and the real-replica bench: when requests
come, and which tenant (shared prefix) each one belongs to. Pure and seeded.

Every process yields ``(arrival_time_s, tenant)`` pairs, ``num_requests`` of them, with a
mean rate of ``rate`` requests per second over the run, and tenants drawn with Zipf(``s``)
popularity (tenant ``k`` has weight ``1 / (k + 1) ** s``):

``poisson``  independent arrivals, exponential gaps: the steady multi-tenant load.
``fanout``   bursts: a burst starts at Poisson times (rate ``rate / burst_size``) and
             brings ``burst_size`` requests of ONE tenant within ``burst_spread_s``
             (uniform offsets): an agent fanning out tool calls, a batch job, ``n``
             parallel completions. The burst's later requests arrive while its first one
             is still queued or prefilling, before any KV event can reach an index.
``diurnal``  a non-homogeneous Poisson process whose rate follows one day-like cycle
             over the run, ``rate(t) = peak * (low + (1 - low) * sin(pi * t / T) ** 2)``
             (quiet, ramp up to ``peak``, back down), drawn by thinning; ``peak`` is
             chosen so the mean rate is ``rate``.
``ramp``     the first half of ``diurnal`` only (quiet to peak): the autoscaler's
             scale-up trace.
"""

from __future__ import annotations

import math
import random
from typing import Iterator

ARRIVALS = ("poisson", "fanout", "diurnal", "ramp")


def zipf_weights(num_tenants: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(num_tenants)]


def arrivals(kind: str, num_requests: int, rate: float, num_tenants: int, zipf_s: float, rng: random.Random,
             burst_size: int = 8, burst_spread_s: float = 0.05, low: float = 0.1) -> list[tuple[float, int]]:
    """``num_requests`` (time, tenant) pairs of the process ``kind`` (module docstring), sorted by time.

    Raises:
        ValueError: an unknown kind or a non-positive rate / burst size.
    """
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; known: {', '.join(ARRIVALS)}")
    if rate <= 0 or burst_size < 1 or not 0 < low <= 1:
        raise ValueError(f"arrivals: need rate > 0, burst_size >= 1, 0 < low <= 1; got {rate}, {burst_size}, {low}")
    weights = zipf_weights(num_tenants, zipf_s)
    tenants = range(num_tenants)
    if kind == "poisson":
        times = list(_poisson(rate, rng, num_requests))
        return [(t, rng.choices(tenants, weights)[0]) for t in times]
    if kind == "fanout":
        out: list[tuple[float, int]] = []
        for start in _poisson(rate / burst_size, rng, math.ceil(num_requests / burst_size)):
            tenant = rng.choices(tenants, weights)[0]
            out += [(start + rng.uniform(0, burst_spread_s), tenant) for _ in range(burst_size)]
        return sorted(out[:num_requests])
    # Mean of sin^2 over a half period is 1/2; ramp covers a quarter of the cycle (mean 1/2 too).
    peak = rate / (low + (1 - low) / 2)
    period = num_requests / rate * (2 if kind == "ramp" else 1)
    out = []
    now = 0.0
    while len(out) < num_requests:
        now += rng.expovariate(peak)  # thinning: accept with rate(t) / peak
        if rng.random() < low + (1 - low) * math.sin(math.pi * now / period) ** 2:
            out.append((now, rng.choices(tenants, weights)[0]))
    return out


def _poisson(rate: float, rng: random.Random, count: int) -> Iterator[float]:
    now = 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        yield now
