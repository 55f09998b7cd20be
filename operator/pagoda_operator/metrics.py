"""The operator's own Prometheus series, and the ``/metrics`` endpoint that serves them.

What an operator dashboard needs and no other component knows: per LLMService and pool,
the replicas the operator wants and those ready, its scaling decisions, its drains, and
whether its autoscaler ticks work. Series (labels ``namespace``, ``llmservice``, ``pool`` —
``replicas``, ``decode`` or ``prefill``, as ``pools.Pool.role``):

| name                                        | kind    | from                                              |
|---------------------------------------------|---------|---------------------------------------------------|
| pagoda_operator_replicas{state}             | gauge   | desired / ready, each reconcile and tick          |
| pagoda_operator_draining                    | gauge   | 1 while a scale-in drain of the pool goes on      |
| pagoda_operator_scaling_events_total{direction} | counter | up / down applied (ScaledUp / ScaledDown)    |
| pagoda_operator_drains_total                | counter | drains started (Draining events)                  |
| pagoda_operator_autoscale_ticks_total{outcome} | counter | ok / failed (API errors); no pool label       |

Every counter row of a pool exists from its first report (at 0), so ``rate()`` sees it
before the first event. Handlers (kopf's event loop) write; the endpoint reads; a lock
covers both. ``pagoda operator --metrics-port`` serves it (0: off).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

from aiohttp import web

EVENT_DIRECTIONS = {"ScaledUp": "up", "ScaledDown": "down"}
DRAIN_EVENT = "Draining"


@dataclass
class PoolReport:
    """What one autoscaler tick did to one pool (``scaling.autoscale_tick`` fills it)."""

    role: str
    desired: Optional[int] = None
    ready: Optional[int] = None
    draining: bool = False
    events: list[str] = field(default_factory=list)  # event reasons (ScaledUp, ScaledDown, Draining)


class OperatorMetrics:
    """The operator's series in memory; ``render()`` gives the Prometheus text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gauges: dict[tuple[str, tuple], float] = {}  # (name, labels) -> value
        self._counters: Counter = Counter()  # (name, labels) -> count

    def set_replicas(self, namespace: str, name: str, role: str, desired: Optional[int],
                     ready: Optional[int]) -> None:
        """Record a pool's desired / ready replicas (``None``: not known, left as it was)."""
        pool = _labels(namespace=namespace, llmservice=name, pool=role)
        with self._lock:
            for state, value in (("desired", desired), ("ready", ready)):
                if value is not None:
                    self._gauges[("pagoda_operator_replicas", pool + (("state", state),))] = float(value)

    def record_tick(self, namespace: str, name: str, reports: Iterable[PoolReport], ok: bool = True) -> None:
        """Count one autoscaler tick and what it did to each pool.

        Args:
            namespace: the LLMService's namespace.
            name: its name.
            reports: one per pool the tick looked at (none for a failed tick).
            ok: False when the tick failed on a Kubernetes API error.
        """
        service = _labels(namespace=namespace, llmservice=name)
        ticks = "pagoda_operator_autoscale_ticks_total"
        with self._lock:
            for outcome in ("ok", "failed"):
                self._counters[(ticks, service + (("outcome", outcome),))] += 0
            self._counters[(ticks, service + (("outcome", "ok" if ok else "failed"),))] += 1
        for report in reports:
            self.set_replicas(namespace, name, report.role, report.desired, report.ready)
            pool = _labels(namespace=namespace, llmservice=name, pool=report.role)
            with self._lock:
                self._gauges[("pagoda_operator_draining", pool)] = float(report.draining)
                for direction in EVENT_DIRECTIONS.values():
                    self._counters[("pagoda_operator_scaling_events_total", pool + (("direction", direction),))] += 0
                self._counters[("pagoda_operator_drains_total", pool)] += 0
                for reason in report.events:
                    if reason in EVENT_DIRECTIONS:
                        key = pool + (("direction", EVENT_DIRECTIONS[reason]),)
                        self._counters[("pagoda_operator_scaling_events_total", key)] += 1
                    elif reason == DRAIN_EVENT:
                        self._counters[("pagoda_operator_drains_total", pool)] += 1

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted LLMService's series."""
        def keep(key: tuple) -> bool:
            labels = dict(key[1])
            return (labels.get("namespace"), labels.get("llmservice")) != (namespace, name)

        with self._lock:
            self._gauges = {k: v for k, v in self._gauges.items() if keep(k)}
            self._counters = Counter({k: v for k, v in self._counters.items() if keep(k)})

    def render(self) -> str:
        """The Prometheus text format, each family's ``# TYPE`` once, samples sorted."""
        with self._lock:
            rows = [("gauge", k, v) for k, v in self._gauges.items()] + \
                   [("counter", k, v) for k, v in self._counters.items()]
        lines, typed = [], set()
        for kind, (name, labels), value in sorted(rows, key=lambda row: row[1]):
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE {name} {kind}")
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{name}{{{text}}} {value:g}")
        return "\n".join(lines) + "\n"


def _labels(**labels: str) -> tuple:
    return tuple(labels.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def start_server(metrics: OperatorMetrics, host: str, port: int) -> web.AppRunner:
    """Serve ``GET /metrics`` on ``host:port`` (in the running event loop; ``runner.cleanup()`` stops it).

    Returns:
        The aiohttp ``AppRunner``; its bound port is ``bound_port(runner)``.
    """
    async def handle(_: web.Request) -> web.Response:
        return web.Response(text=metrics.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port a runner listens on (the one the OS chose for port 0)."""
    return runner.addresses[0][1]
