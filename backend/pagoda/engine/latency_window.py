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

    def observe(self, latency: float, now: Optional[float] = None) -> None:
        self._samples.append((self.clock() if now is None else now, max(0.0, latency)))

    def samples(self, now: Optional[float] = None) -> list[float]:
        """Latencies observed within the window, oldest first."""
        now = self.clock() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return [latency for _, latency in self._samples]

    def quantile(self, q: float, now: Optional[float] = None) -> float:
        """The ``q`` quantile (nearest rank) of the window; 0.0 when it is empty."""
        values = sorted(self.samples(now))
        if not values:
            return 0.0
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]
