"""Recent latencies: what the replica's heartbeat reports and the autoscaler reads.

``LatencyWindow`` keeps the latencies observed in the last ``window_s`` seconds (at most
``max_samples`` of the newest, so a flood costs bounded memory). The engine feeds it each
request's time to first token (``OutputProcessor``); ``EngineStats.ttft_p90`` and
``EngineStats.recent_ttfts`` come from it, and the fleet publisher turns the samples into
histogram bucket counts in the heartbeat, so the operator can compute one P90 over every
replica's recent requests together (``pagoda_operator.autoscaler.FleetLoad``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Optional


class LatencyWindow:
    def __init__(self, window_s: float = 30.0, max_samples: int = 1024,
                 clock: Callable[[], float] = time.time) -> None:
        assert window_s > 0 and max_samples > 0
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (when, latency)
        self._snapshot: Optional[tuple[float, tuple]] = None
        self._snapshot_time = float("-inf")

    def observe(self, latency: float, now: Optional[float] = None) -> None:
        self._samples.append((self.clock() if now is None else now, max(0.0, latency)))

    def samples(self, now: Optional[float] = None) -> list[float]:
        """Latencies observed within the window, oldest first."""
        now = self.clock() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return [latency for _, latency in self._samples]

    def p90_snapshot(self, max_age_s: float = 0.5) -> tuple[float, tuple]:
        """``(quantile(0.9), samples)``, recomputed at most every ``max_age_s`` seconds: the
        engine asks for stats after every step, the heartbeat reads them once a second, so
        the sort stays off the step's path."""
        now = self.clock()
        if self._snapshot is None or now - self._snapshot_time >= max_age_s:
            values = self.samples(now)
            self._snapshot = (_nearest_rank(sorted(values), 0.9), tuple(values))
            self._snapshot_time = now
        return self._snapshot

    def quantile(self, q: float, now: Optional[float] = None) -> float:
        """The ``q`` quantile (nearest rank) of the window; 0.0 when it is empty."""
        return _nearest_rank(sorted(self.samples(now)), q)


def _nearest_rank(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
