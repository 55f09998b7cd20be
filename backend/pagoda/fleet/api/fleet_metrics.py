"""The fleet's ``vllm:`` series on the router's ``/metrics``: each replica's, labelled.

Tools that read vLLM's metrics from the port they send OpenAI requests to (AIPerf's
server-metrics view, the Gateway API Inference Extension's endpoint picker when pointed
at a router or at ``pagoda serve``'s OpenAI door) find them there: at each scrape the
router fetches every known replica's ``/metrics`` (its ``metrics`` endpoint; concurrently,
``SCRAPE_TIMEOUT_S`` each) and re-exposes every ``vllm:`` family once, each sample with a
``replica_id`` label added (the label the router's own ``pagoda_router_replica_*`` series
use). Per replica, not summed: sums are one PromQL ``sum by`` away, and a sum of gauges
such as ``vllm:kv_cache_usage_perc`` would be wrong. A replica that does not answer is left
out and counted in ``pagoda_router_metrics_scrape_failures_total``.

Invariant: the output is valid Prometheus text — each family's ``# HELP`` / ``# TYPE``
once, its samples (histogram ``_bucket`` / ``_sum`` / ``_count`` included) contiguous.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import aiohttp

logger = logging.getLogger(__name__)

PREFIX = "vllm:"
SCRAPE_TIMEOUT_S = 2.0


class _Family:
    def __init__(self, name: str) -> None:
        self.name = name
        self.help = ""
        self.type = ""
        self.samples: list[str] = []


def _family_of(sample_name: str, known: dict[str, _Family]) -> str:
    if sample_name in known:
        return sample_name
    for suffix in ("_bucket", "_sum", "_count", "_created", "_total"):
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in known:
            return sample_name[: -len(suffix)]
    return sample_name


def _with_label(line: str, label: str) -> str:
    """``name{a="b"} 1`` -> ``name{label,a="b"} 1``; ``name 1`` -> ``name{label} 1``."""
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = line[brace + 1:]
        return f"{line[:brace]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{line[:space]}{{{label}}}{line[space:]}"


def merge_vllm_series(scrapes: Iterable[tuple[str, str]]) -> list[str]:
    """Prometheus lines for every ``vllm:`` family in ``scrapes`` (``(replica_id, text)``)."""
    families: dict[str, _Family] = {}
    for replica_id, text in scrapes:
        label = f'replica_id="{replica_id}"'
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                parts = line.split(" ", 3)
                if len(parts) < 4 or not parts[2].startswith(PREFIX):
                    continue
                family = families.setdefault(parts[2], _Family(parts[2]))
                if parts[1] == "HELP":
                    family.help = family.help or line
                else:
                    family.type = family.type or line
            elif line.startswith(PREFIX):
                name = line[: min(i for i in (line.find("{"), line.find(" ")) if i != -1)]
                family = families.setdefault(_family_of(name, families), _Family(name))
                family.samples.append(_with_label(line, label))
    lines: list[str] = []
    for family in families.values():
        lines += [h for h in (family.help, family.type) if h] + family.samples
    return lines


async def scrape_replicas(session: aiohttp.ClientSession, replicas: Iterable[Any]) -> tuple[list[tuple[str, str]], int]:
    """Every replica's metrics text that answered in time, and how many did not."""
    targets = [r for r in replicas if r.endpoints.get("metrics")]

    async def one(replica: Any) -> tuple[str, str]:
        url = f"http://{replica.endpoints['metrics']}/metrics"
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as response:
            response.raise_for_status()
            return replica.replica_id, await response.text()

    results = await asyncio.gather(*(one(r) for r in targets), return_exceptions=True)
    scrapes = [r for r in results if not isinstance(r, BaseException)]
    for replica, result in zip(targets, results):
        if isinstance(result, BaseException):
            logger.debug("metrics of replica %s: %s", replica.replica_id, result)
    return scrapes, len(targets) - len(scrapes)
