"""Retrying Redis politely: exponential backoff with jitter, and logs that do not flood.

A fleet component that loses Redis (publisher, index follower, affinity share, registry
refresh) must neither hammer it nor its own log while it is gone: ``Backoff`` spaces the
retries (``initial_s`` doubling up to ``max_s``, each delay drawn uniformly from the upper
half, "equal jitter", so replicas that lost Redis together do not retry in lockstep), and
``RateLimitedLog`` prints the first failure at once and then at most one line per
``interval_s`` with how many were suppressed. Both take an injectable clock / RNG so tests
never sleep.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Optional


class Backoff:
    """Delays for consecutive failures: ``min(max_s, initial_s * 2**k)``, jittered to [d/2, d].

    Args:
        initial_s: the first delay's upper bound.
        max_s: the cap.
        rng: a ``random.Random`` (seeded in tests).
    """

    def __init__(self, initial_s: float = 0.05, max_s: float = 5.0, rng: Optional[random.Random] = None) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"backoff: need 0 < initial_s <= max_s, got {initial_s}, {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.rng = rng or random.Random()
        self.num_failures = 0

    def next_delay(self) -> float:
        """The delay before the next attempt (counts one more failure)."""
        ceiling = min(self.max_s, self.initial_s * 2 ** min(self.num_failures, 60))
        self.num_failures += 1
        return self.rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        """A success: the next failure starts again at ``initial_s``."""
        self.num_failures = 0


class RateLimitedLog:
    """At most one log line per ``interval_s`` (the first at once); counts what it held back.

    Args:
        logger: where the lines go.
        interval_s: the minimum spacing between lines.
        clock: monotonic seconds.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last = float("-inf")
        self.num_suppressed = 0

    def log(self, level: int, message: str, *args: object) -> bool:
        """Log unless a line went out less than ``interval_s`` ago; returns whether it did."""
        now = self.clock()
        if now - self._last < self.interval_s:
            self.num_suppressed += 1
            return False
        if self.num_suppressed:
            message += f" ({self.num_suppressed} similar messages suppressed)"
        self.logger.log(level, message, *args)
        self._last = now
        self.num_suppressed = 0
        return True

    def warning(self, message: str, *args: object) -> bool:
        return self.log(logging.WARNING, message, *args)

    def info(self, message: str, *args: object) -> bool:
        return self.log(logging.INFO, message, *args)

    def reset(self) -> None:
        """The condition cleared: the next failure is logged at once."""
        self._last = float("-inf")
        self.num_suppressed = 0
