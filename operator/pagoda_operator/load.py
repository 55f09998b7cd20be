"""Replica load for the autoscaler, and the fleet-state writes a drain needs.

`FleetStore` is what the autoscale timer talks to (tests inject a fake through
`kopf.Memo`). Two readers exist:
- `RedisFleetStore`: heartbeats and the registry in Redis (keys in fleet_keys.py);
  it also sets the drain flag and removes a departed replica's index entries.
- `MetricsScraper`: the fallback; scrapes each pod's Triton `/metrics` (vLLM metric
  names, ARCHITECTURE contract 5). TTFT and inter-token latency P90s come from the
  histograms' bucket deltas since the previous scrape of that pod (from the cumulative
  counts on the first).
`FallbackFleetStore` reads Redis first and scrapes only when Redis has nothing fresh, or,
with `need_itl` (a pool with an ITL SLO), also to add the ITL the heartbeat lacks.

A heartbeat older than `max_age_s` is ignored (the replica is gone or stuck).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from pagoda_operator import fleet_keys

Clock = Callable[[], float]


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load sample."""

    replica_id: str
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    ttft_p90: float = 0.0
    ts: float = 0.0
    # Cumulative counts {upper bound (s): requests} of the recent TTFTs behind ttft_p90
    # (+Inf included); None when the replica reported none (an older replica).
    ttft_buckets: dict[float, float] | None = None
    # The same for inter-token latency (vllm:inter_token_latency_seconds); only /metrics has it.
    itl_p90: float = 0.0
    itl_buckets: dict[float, float] | None = None


class FleetStore(Protocol):
    """Load reading and drain bookkeeping, as the autoscaler needs them."""

    source: str

    async def read_loads(self, model: str, pods: dict[str, str | None], *,
                         need_itl: bool = False) -> dict[str, ReplicaLoad]:
        """Loads of the given pods (pod name -> pod IP); missing pods are simply absent.
        `need_itl`: the caller scales on inter-token latency (read it even if it costs a scrape)."""

    async def mark_draining(self, model: str, replica_id: str) -> None:
        """Tell routers to stop sending new requests to `replica_id`."""

    async def forget_replica(self, model: str, replica_id: str) -> None:
        """Remove a removed replica from the registry and the prefix index."""


def _float(value: object) -> float:
    try:
        result = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return result if math.isfinite(result) else 0.0


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisFleetStore:
    """Fleet state in Redis (redis.asyncio client injected or built from a URL)."""

    source = "redis"

    def __init__(self, client, *, max_age_s: float = 30.0, clock: Clock = time.time):
        self.client = client
        self.max_age_s = max_age_s
        self.clock = clock

    @classmethod
    def from_url(cls, url: str, password: str | None = None, **kwargs) -> "RedisFleetStore":
        import redis.asyncio as redis_asyncio  # the `serve` extra; only needed here

        return cls(redis_asyncio.from_url(url, password=password), **kwargs)

    async def read_loads(self, model: str, pods: dict[str, str | None], *,
                         need_itl: bool = False) -> dict[str, ReplicaLoad]:
        replica_ids = sorted(pods)
        if not replica_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for replica_id in replica_ids:
            pipe.hgetall(fleet_keys.heartbeat_key(model, replica_id))
        rows = await pipe.execute()
        now = self.clock()
        loads = {}
        for replica_id, row in zip(replica_ids, rows):
            fields = {_text(k): v for k, v in (row or {}).items()}
            ts = _float(fields.get("ts"))
            if not fields or now - ts > self.max_age_s:
                continue
            loads[replica_id] = ReplicaLoad(
                replica_id=replica_id, waiting=_float(fields.get("waiting")),
                running=_float(fields.get("running")), kv_usage=_float(fields.get("kv_usage")),
                ttft_p90=_float(fields.get("ttft_p90")), ts=ts,
                ttft_buckets=fleet_keys.decode_ttft_buckets(_text(fields["ttft_buckets"])) or None
                if "ttft_buckets" in fields else None)
        return loads

    async def mark_draining(self, model: str, replica_id: str) -> None:
        await self.client.set(fleet_keys.drain_key(model, replica_id), str(self.clock()))

    async def forget_replica(self, model: str, replica_id: str) -> None:
        blocks_key = fleet_keys.replica_blocks_key(model, replica_id)
        block_hashes = [_text(h) for h in await self.client.smembers(blocks_key)]
        pipe = self.client.pipeline(transaction=True)
        for block_hash in block_hashes:
            pipe.srem(fleet_keys.block_owners_key(model, block_hash), replica_id)
        pipe.delete(blocks_key, fleet_keys.heartbeat_key(model, replica_id),
                    fleet_keys.drain_key(model, replica_id))
        pipe.srem(fleet_keys.registry_key(model), replica_id)
        await pipe.execute()


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>.*)\})?\s+(?P<value>\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus_text(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parse the Prometheus text exposition format.

    Returns:
        metric sample name -> [(labels, value)]; comments and malformed lines are skipped.
    """
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\")
                  for k, v in _LABEL.findall(match.group("labels") or "")}
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        samples.setdefault(match.group("name"), []).append((labels, value))
    return samples


def histogram_quantile(quantile: float, buckets: dict[float, float]) -> float:
    """Quantile from cumulative bucket counts {upper_bound: count}, interpolated linearly
    inside the bucket (as PromQL's histogram_quantile). 0.0 when there are no samples."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return 0.0
    rank = quantile * buckets[bounds[-1]]
    lower, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == lower_count:
                return bound
            return lower + (bound - lower) * (rank - lower_count) / (count - lower_count)
        lower, lower_count = bound, count
    return lower


def _sum(samples, name: str) -> float:
    return sum(value for _, value in samples.get(name, []))


def _mean(samples, name: str) -> float:
    values = [value for _, value in samples.get(name, [])]
    return sum(values) / len(values) if values else 0.0


HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds"}


def histogram_buckets(samples, name: str) -> dict[float, float]:
    """Cumulative counts {upper bound: count} of histogram `name`, summed over its label sets."""
    buckets: dict[float, float] = {}
    for labels, value in samples.get(f"{name}_bucket", []):
        bound = float(labels.get("le", "+Inf"))
        buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets


def _window(buckets: dict[float, float], previous: dict[float, float] | None) -> dict[float, float]:
    """The counts since `previous` (the last scrape); cumulative after a restart reset them."""
    if previous:
        delta = {b: c - previous.get(b, 0.0) for b, c in buckets.items()}
        if all(c >= 0 for c in delta.values()):
            return delta
    return buckets


def load_from_metrics(replica_id: str, samples, previous: dict[str, dict[float, float]] | None,
                      now: float) -> tuple[ReplicaLoad, dict[str, dict[float, float]]]:
    """Turn one parsed scrape into a ReplicaLoad; returns the histograms' buckets to keep
    ({"ttft": ..., "itl": ...}, the `previous` of the next scrape)."""
    current = {key: histogram_buckets(samples, name) for key, name in HISTOGRAMS.items()}
    ttft = _window(current["ttft"], (previous or {}).get("ttft"))
    itl = _window(current["itl"], (previous or {}).get("itl"))
    load = ReplicaLoad(
        replica_id=replica_id,
        waiting=_sum(samples, "vllm:num_requests_waiting"),
        running=_sum(samples, "vllm:num_requests_running"),
        kv_usage=_mean(samples, "vllm:kv_cache_usage_perc"),
        ttft_p90=histogram_quantile(0.9, ttft),
        ts=now,
        ttft_buckets=ttft or None,
        itl_p90=histogram_quantile(0.9, itl),
        itl_buckets=itl or None,
    )
    return load, current


class MetricsScraper:
    """Fallback reader: GET http://<pod-ip>:<port>/metrics for every pod."""

    source = "metrics"

    def __init__(self, *, port: int = 8002, timeout_s: float = 2.0, clock: Clock = time.time,
                 fetch: Callable[[str], "asyncio.Future[str]"] | None = None):
        self.port = port
        self.timeout_s = timeout_s
        self.clock = clock
        self._fetch = fetch or self._http_get
        self._buckets: dict[str, dict[str, dict[float, float]]] = {}  # replica -> histogram -> buckets

    async def _http_get(self, url: str) -> str:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url) as response:
                response.raise_for_status()
                return await response.text()

    async def _scrape(self, replica_id: str, ip: str) -> ReplicaLoad | None:
        try:
            text = await self._fetch(f"http://{ip}:{self.port}/metrics")
        except Exception:  # an unreachable pod just has no sample this round
            return None
        load, buckets = load_from_metrics(replica_id, parse_prometheus_text(text),
                                          self._buckets.get(replica_id), self.clock())
        self._buckets[replica_id] = buckets
        return load

    async def read_loads(self, model: str, pods: dict[str, str | None], *,
                         need_itl: bool = False) -> dict[str, ReplicaLoad]:
        targets = {name: ip for name, ip in pods.items() if ip}
        results = await asyncio.gather(*(self._scrape(n, ip) for n, ip in targets.items()))
        for gone in set(self._buckets) - set(pods):
            del self._buckets[gone]
        return {load.replica_id: load for load in results if load is not None}

    async def mark_draining(self, model: str, replica_id: str) -> None:
        """Without Redis there is no shared drain flag; routers see the pod go away."""

    async def forget_replica(self, model: str, replica_id: str) -> None:
        self._buckets.pop(replica_id, None)


class FallbackFleetStore:
    """Redis first; scrape /metrics when Redis is unreachable or has no fresh heartbeat."""

    def __init__(self, primary: FleetStore, fallback: FleetStore):
        self.primary = primary
        self.fallback = fallback
        self.source = primary.source

    async def read_loads(self, model: str, pods: dict[str, str | None], *,
                         need_itl: bool = False) -> dict[str, ReplicaLoad]:
        try:
            loads = await self.primary.read_loads(model, pods)
        except Exception:
            loads = {}
        if not loads:
            self.source = self.fallback.source
            return await self.fallback.read_loads(model, pods)
        self.source = self.primary.source
        if need_itl:  # heartbeats carry no ITL: take it from the pods' /metrics
            scraped = await self.fallback.read_loads(model, pods)
            loads = {name: replace(load, itl_p90=scraped[name].itl_p90, itl_buckets=scraped[name].itl_buckets)
                     if name in scraped else load for name, load in loads.items()}
        return loads

    async def mark_draining(self, model: str, replica_id: str) -> None:
        await self.primary.mark_draining(model, replica_id)

    async def forget_replica(self, model: str, replica_id: str) -> None:
        await self.primary.forget_replica(model, replica_id)
        await self.fallback.forget_replica(model, replica_id)
