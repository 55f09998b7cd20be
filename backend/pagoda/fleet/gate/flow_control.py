"""Flow control: requests wait at the router while the fleet is saturated, released fairly.

``FlowControl`` (one per router, held by the ``Gate``) is what ``Gate.choose`` awaits before
the first routing decision of a request that carries a ``Turn`` (every door makes one:
OpenAI and the agent APIs, Triton HTTP generate, gRPC stream and unary). A request passes at
once while nobody waits and the fleet has room; otherwise it waits in the ``FairQueue``
(bands, per-tenant bounds, virtual token counters) until the pump releases it, its
deadline passes, or its client hangs up (its place is freed at once).

Saturation (``Saturation``), from signals the router already has, per routable replica:
its overload memory (it refused a request as full within ``Retry-After``), its heartbeat
(with Redis: ``waiting`` at or over ``--saturation-waiting``, or ``kv_usage`` at or over
``--saturation-kv-usage``) and the router's own in-flight count against
``--max-in-flight-per-replica``. The fleet has room while some replica is not saturated and
(with the in-flight bound) its free slots outnumber the turns released but not yet routed.
Draining replicas count only when no other is left, as routing treats them; with no replica
at all the request is not held (routing answers it at once, 503 ``no replica``).

Shares: with a capacity (``--max-in-flight-per-replica`` x the routable replicas), each
active tenant (requests in flight or waiting, or one ended within ``--tenant-share-window``)
is entitled to ``ceil(capacity / active tenants)`` of it. A tenant holding its share or more
(its requests in flight, and those released and not yet routed: two slots freed in one pump
round do not both go to the flooder) is passed over while another active tenant holds less
(``over_share``): the slot stays for the other, so a quiet tenant's next request finds room
at once instead of waiting for one of the flooder's to end (at small capacities, such as a
CPU replica's two sequences, that wait is a whole long request). The flooder keeps its
share and takes every slot again once the others have been idle for the window; without a
capacity (no in-flight bound) there are no shares, only the queue's order. The virtual token
counters then order the turns of the tenants not passed over.

The pump runs while anyone waits: it drops turns whose deadline passed (429, naming the
limit that ended the wait: ``--queue-max-wait`` or the request's own ``timeout``) and
releases turns one by one while the fleet has room, re-checking every ``poll_s`` (the
in-flight counts change as requests end; heartbeats and overload memory age).

Rank at the replica: each released turn records whether its tenant still had requests waiting
in its band while another tenant was active (``Turn.backlogged``); the doors send the replica
``Turn.replica_priority`` (the band scaled, plus that standing: ``fair_queue``), so a replica
running ``--scheduling-policy priority`` admits, batches and preempts by the same fairness
(docs/reliability.md).

A request released and then refused by a replica as full goes back (``requeue``: the front
of its tenant's queue, its cost given back) instead of being answered 429, as long as its
deadline allows. Its waits add up; the replica is sent its ``timeout`` less them
(``Turn.remaining_timeout``), so the request keeps its deadline.

Metrics (``metric_lines``, on the router's ``/metrics``), per tenant and band:
``pagoda_router_queue_depth`` (gauge), ``pagoda_router_queue_wait_seconds`` (histogram of
the time each released request waited, 0 for those that passed at once),
``pagoda_router_queue_released_total``, ``pagoda_router_queue_released_backlogged_total`` (of those,
released while their tenant still had requests waiting in the band: ranked after the band's
others at the replica) and ``pagoda_router_queue_refused_total{reason}``
(``queue_full``, ``max_wait``, ``timeout``: a tenant and band seen has a row for each, zero
until it happens, so a dashboard's refusal query has series before the first refusal).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagoda.fleet.gate.fair_queue import FairQueue, QueueRefused, Turn

logger = logging.getLogger(__name__)

WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class FlowOptions:
    """The router's flow-control flags (docs/fleet.md).

    Attributes:
        queue_size: waiting requests per tenant (``--queue-size-per-tenant``); 0 turns flow
            control off (requests are forwarded at once and a full fleet answers 429/503).
        max_wait_s: the longest a request waits at the router (``--queue-max-wait``).
        max_in_flight_per_replica: a replica with this many of the router's requests is
            saturated (``--max-in-flight-per-replica``; 0: no bound by count).
        saturation_waiting: a replica whose heartbeat reports this many waiting requests is
            saturated (``--saturation-waiting``; 0: not read).
        saturation_kv_usage: ... this KV usage fraction (``--saturation-kv-usage``; 0: not read).
        share_window_s: a tenant whose request ended this recently is still active for its share
            of the fleet (``--tenant-share-window``; 0: only tenants with requests in flight or waiting).
        poll_s: how often the pump re-reads the fleet while anyone waits.
    """

    queue_size: int = 0
    max_wait_s: float = 30.0
    max_in_flight_per_replica: int = 0
    saturation_waiting: int = 0
    saturation_kv_usage: float = 0.0
    share_window_s: float = 1.0
    poll_s: float = 0.01

    def check(self) -> None:
        """Raises ValueError naming the flag that is out of range."""
        for flag, value in (("--queue-size-per-tenant", self.queue_size),
                            ("--max-in-flight-per-replica", self.max_in_flight_per_replica),
                            ("--saturation-waiting", self.saturation_waiting)):
            if value < 0:
                raise ValueError(f"{flag}: must be >= 0, got {value}")
        if not (self.share_window_s >= 0 and math.isfinite(self.share_window_s)):
            raise ValueError(f"--tenant-share-window: must be a number of seconds >= 0, got {self.share_window_s}")
        if not (self.max_wait_s > 0 and math.isfinite(self.max_wait_s)):
            raise ValueError(f"--queue-max-wait: must be a number of seconds > 0, got {self.max_wait_s}")
        if not 0.0 <= self.saturation_kv_usage <= 1.0:
            raise ValueError(f"--saturation-kv-usage: must be in [0, 1], got {self.saturation_kv_usage}")


class Saturation:
    """Whether the fleet has room for one more request (module docstring).

    Args:
        options: the thresholds.
        full_ids: the replica ids the overload memory holds as full now.
    """

    def __init__(self, options: FlowOptions, full_ids: Callable[[], list[str]]) -> None:
        self.options = options
        self.full_ids = full_ids

    def capacity(self, replicas: Any) -> int:
        """Requests the fleet holds at most (``--max-in-flight-per-replica`` x its replicas; 0: unbounded)."""
        candidates = replicas.routable() or replicas.routable(include_draining=True)
        return self.options.max_in_flight_per_replica * len(candidates)

    def room(self, replicas: Any, num_unrouted: int) -> bool:
        """``replicas``: the router's ``ReplicaSet``; ``num_unrouted``: turns released and not yet routed."""
        candidates = replicas.routable() or replicas.routable(include_draining=True)
        if not candidates:
            return True  # no replica at all is no saturation: routing answers it at once (503), not after a wait
        full = set(self.full_ids())
        bound = self.options.max_in_flight_per_replica
        free = 0
        for replica in candidates:
            if replica.replica_id in full or self._loaded(replica):
                continue
            if not bound:
                return True
            free += max(0, bound - replica.in_flight)
        return free > num_unrouted

    def _loaded(self, replica: Any) -> bool:
        o = self.options
        if not replica.heartbeat_ts:
            return False  # no heartbeat (no Redis): in-flight and overload memory only
        return bool((o.saturation_waiting and replica.waiting >= o.saturation_waiting)
                    or (o.saturation_kv_usage and replica.kv_usage >= o.saturation_kv_usage))


class FlowControl:
    """The router's waiting room (module docstring).

    Args:
        options: the flags.
        saturation: the fleet's room (``Saturation``).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, options: FlowOptions, saturation: Saturation,
                 clock: Callable[[], float] = time.monotonic) -> None:
        options.check()
        self.options = options
        self.saturation = saturation
        self.clock = clock
        self.queue = FairQueue(max(1, options.queue_size))
        self.num_unrouted = 0  # turns released that have not made their routing decision yet
        self.unrouted: Counter = Counter()  # tenant -> of those, its (they count toward its share)
        self._waiters: dict[int, tuple[Turn, asyncio.Future]] = {}
        self._pump: Optional[asyncio.Task] = None
        self.released: Counter = Counter()  # (tenant, priority) -> released
        self.released_backlogged: Counter = Counter()  # (tenant, priority) -> released with more waiting
        self.refused: Counter = Counter()  # (tenant, priority, reason) -> refused
        self.waits: dict[tuple[str, int], list] = {}  # (tenant, priority) -> [bucket counts..., sum, count]
        self.in_flight: Counter = Counter()  # tenant -> its requests routed and not yet ended
        self._last_end: dict[str, float] = {}  # tenant -> when its last request ended (its share's window)

    @property
    def enabled(self) -> bool:
        return self.options.queue_size > 0

    def turn(self, tenant: str, priority: int, cost: int, timeout_s: Optional[float]) -> Turn:
        """A new request's ``Turn``: its deadline the earlier of its timeout and ``--queue-max-wait``."""
        now = self.clock()
        wait = self.options.max_wait_s if timeout_s is None else min(self.options.max_wait_s, timeout_s)
        return Turn(tenant, priority, max(0, int(cost)), now, now + wait, timeout_s)

    async def wait(self, turn: Turn, replicas: Any) -> None:
        """Return when ``turn`` may be routed (at once when nobody waits and the fleet has room);
        the caller then routes it and calls ``routed``.

        Raises:
            QueueRefused: its tenant's queue is full, or its deadline passed while it waited.
            asyncio.CancelledError: its client hung up (its place is freed).
        """
        if turn.admitted:
            return
        start = turn.queued_at = self.clock()
        if not turn.requeued and not len(self.queue) and self.saturation.room(replicas, self.num_unrouted) \
                and turn.tenant not in self.over_share(replicas):
            turn.admitted = True  # its slot is held until it is routed
            self._hold_slot(turn)
            self._released(turn, 0.0)
            return
        try:
            if turn.requeued:
                self.queue.requeue(turn)
            else:
                self.queue.push(turn)
        except QueueRefused as exc:
            self.refused[(turn.tenant, turn.priority, exc.reason)] += 1
            raise
        future = asyncio.get_running_loop().create_future()
        self._waiters[id(turn)] = (turn, future)
        self._start_pump(replicas)
        try:
            await future
        except asyncio.CancelledError:
            if self.queue.remove(turn):
                logger.debug("a waiting request of tenant %r left the queue (its client went)", turn.tenant)
            self.routed(turn)  # released just before its client went: the slot is free again
            raise
        finally:
            self._waiters.pop(id(turn), None)
            turn.waited_s += self.clock() - start

    def routed(self, turn: Optional[Turn]) -> None:
        """A released turn made its routing decision (or failed to): it no longer holds a slot in
        ``num_unrouted``."""
        if turn is not None and turn.unrouted:
            turn.unrouted = False
            self.num_unrouted = max(0, self.num_unrouted - 1)
            self.unrouted[turn.tenant] -= 1
            if self.unrouted[turn.tenant] <= 0:
                del self.unrouted[turn.tenant]

    def _hold_slot(self, turn: Turn) -> None:
        """A released turn holds a slot until it is routed, and counts toward its tenant's share."""
        turn.unrouted = True
        self.num_unrouted += 1
        self.unrouted[turn.tenant] += 1

    def started(self, turn: Optional[Turn], decision: Any) -> None:
        """``turn``'s request was routed (``decision``): it counts in its tenant's share until the
        decision is released (``Router.release`` calls back)."""
        if turn is None or not self.enabled:
            return
        self.in_flight[turn.tenant] += 1
        decision.on_release = lambda: self._ended(turn.tenant)

    def _ended(self, tenant: str) -> None:
        self.in_flight[tenant] -= 1
        if self.in_flight[tenant] <= 0:
            del self.in_flight[tenant]
        self._last_end[tenant] = self.clock()

    def over_share(self, replicas: Any) -> set[str]:
        """Tenants holding their share of the fleet or more while another active tenant holds less:
        they wait, so the slot stays for the other (module docstring). Empty without a capacity."""
        capacity = self.saturation.capacity(replicas)
        if not capacity:
            return set()
        active = self.active_tenants()
        share = -(-capacity // max(1, len(active)))
        holding = {t: self.in_flight[t] + self.unrouted[t] for t in active}  # released, not yet routed: counted
        under = [t for t in active if holding[t] < share]
        return {t for t in active if holding[t] >= share} if under else set()

    def active_tenants(self) -> set[str]:
        """Tenants with requests in flight, released or waiting, or one ended within ``--tenant-share-window``."""
        now, window = self.clock(), self.options.share_window_s
        for tenant in [t for t, at in self._last_end.items() if now - at > window and not self.in_flight[t]]:
            del self._last_end[tenant]  # bounded by the tenants active within the window
        return set(self.in_flight) | set(self.unrouted) | set(self._last_end) | set(self.queue.tenants())

    def requeue(self, turn: Optional[Turn]) -> bool:
        """A released turn refused by a replica as full: ``wait`` queues it again (``True``),
        unless flow control is off or its deadline has passed."""
        if turn is None or not self.enabled or self.clock() >= turn.deadline:
            return False
        turn.admitted, turn.requeued = False, True
        return True

    def _start_pump(self, replicas: Any) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump(replicas))

    async def _run_pump(self, replicas: Any) -> None:
        while len(self.queue):
            try:
                self.pump(replicas)
            except Exception:  # noqa: BLE001 - a waiter must never hang on a dead pump
                logger.exception("flow control: the queue's pump failed; retrying")
            if not len(self.queue):
                return
            await asyncio.sleep(self.options.poll_s)

    def pump(self, replicas: Any) -> None:
        """One round: expire what waited past its deadline, release while the fleet has room."""
        now = self.clock()
        for turn in self.queue.expired(now):
            self.queue.remove(turn)
            self._refuse_expired(turn, now)
        while len(self.queue) and self.saturation.room(replicas, self.num_unrouted):
            turn = self.queue.pop(skip=self.over_share(replicas))
            if turn is None:
                return  # the room left is another active tenant's share
            entry = self._waiters.get(id(turn))
            if entry is None or entry[1].done():
                continue  # its waiter is gone (cancelled between rounds)
            self._released(turn, turn.waited_s + now - turn.queued_at)
            self._hold_slot(turn)
            entry[1].set_result(None)

    def _refuse_expired(self, turn: Turn, now: float) -> None:
        by_timeout = turn.timeout_s is not None and turn.timeout_s <= self.options.max_wait_s
        reason = "timeout" if by_timeout else "max_wait"
        limit = (f"its timeout ({turn.timeout_s:g} s) would pass before a replica had room" if by_timeout else
                 f"it waited {now - turn.arrival:.1f} s, the longest a request may wait (router --queue-max-wait "
                 f"{self.options.max_wait_s:g})")
        self.refused[(turn.tenant, turn.priority, reason)] += 1
        entry = self._waiters.get(id(turn))
        if entry is not None and not entry[1].done():
            entry[1].set_exception(QueueRefused(f"queue wait: the fleet is saturated and {limit}; retry later",
                                                1.0, reason))

    def _released(self, turn: Turn, waited_s: float) -> None:
        key = (turn.tenant, turn.priority)
        self.released[key] += 1
        # Its standing at the replica (fair_queue, "Rank at the replica"): was its tenant left waiting
        # while another tenant is active? (A lone tenant is at its share: its requests keep their order.)
        turn.backlogged = self.queue.depth_in(turn.tenant, turn.priority) > 0 \
            and bool(self.active_tenants() - {turn.tenant})
        if turn.backlogged:
            self.released_backlogged[key] += 1
        counts = self.waits.setdefault(key, [0] * (len(WAIT_BUCKETS_S) + 2))
        for k, bound in enumerate(WAIT_BUCKETS_S):
            if waited_s <= bound:
                counts[k] += 1
        counts[-2] += waited_s
        counts[-1] += 1

    def metric_lines(self) -> list[str]:
        """Prometheus lines per tenant queue (module docstring); none while flow control is off."""
        if not self.enabled:
            return []
        depths = self.queue.depths()
        lines = ["# HELP pagoda_router_queue_depth requests waiting at the router, per tenant and priority band",
                 "# TYPE pagoda_router_queue_depth gauge"]
        keys = sorted(set(self.released) | set(depths))
        lines += [f'pagoda_router_queue_depth{{{_labels(t, p)}}} {depths.get((t, p), 0)}'
                  for t, p in keys]
        lines += ["# HELP pagoda_router_queue_wait_seconds time a released request waited at the router",
                  "# TYPE pagoda_router_queue_wait_seconds histogram"]
        for (tenant, priority), counts in sorted(self.waits.items()):
            labels = _labels(tenant, priority)
            lines += [f'pagoda_router_queue_wait_seconds_bucket{{{labels},le="{bound:g}"}} {counts[k]}'
                      for k, bound in enumerate(WAIT_BUCKETS_S)]
            lines += [f'pagoda_router_queue_wait_seconds_bucket{{{labels},le="+Inf"}} {counts[-1]}',
                      f"pagoda_router_queue_wait_seconds_sum{{{labels}}} {counts[-2]:.6f}",
                      f"pagoda_router_queue_wait_seconds_count{{{labels}}} {counts[-1]}"]
        lines += ["# HELP pagoda_router_queue_released_total requests the router's queue let through",
                  "# TYPE pagoda_router_queue_released_total counter"]
        lines += [f"pagoda_router_queue_released_total{{{_labels(t, p)}}} {n}"
                  for (t, p), n in sorted(self.released.items())]
        lines += ["# HELP pagoda_router_queue_released_backlogged_total released requests whose tenant still had "
                  "requests waiting in their band (sent to the replica ranked after the band's others)",
                  "# TYPE pagoda_router_queue_released_backlogged_total counter"]
        lines += [f"pagoda_router_queue_released_backlogged_total{{{_labels(t, p)}}} {self.released_backlogged[(t, p)]}"
                  for (t, p) in sorted(self.released)]
        lines += ["# HELP pagoda_router_queue_refused_total requests the router's queue refused (429), by reason",
                  "# TYPE pagoda_router_queue_refused_total counter"]
        seen = sorted(set(keys) | {(t, p) for t, p, _ in self.refused})
        lines += [f'pagoda_router_queue_refused_total{{{_labels(t, p)},reason="{r}"}} {self.refused.get((t, p, r), 0)}'
                  for t, p in seen for r in REFUSAL_REASONS]
        return lines


# Why the queue refuses (QueueRefused.reason): its bound, the router's longest wait, the request's timeout.
REFUSAL_REASONS = ("queue_full", "max_wait", "timeout")


def _labels(tenant: str, priority: int) -> str:
    escaped = tenant.replace("\\", "\\\\").replace('"', '\\"')
    return f'tenant="{escaped}",priority="{priority}"'
