"""The router's fair queue: bounded per-tenant queues in priority bands, released fairly by tokens.

Pure bookkeeping, no I/O and no clock of its own (``flow_control`` owns the waiting, the
clock and the fleet's saturation); every operation is deterministic, so the unit tests
drive it step by step.

Rules (docs/reliability.md, "Flow control"):

- **Bands.** A waiting request (a ``Turn``) sits in the band of its ``priority``; a smaller
  value is served first (vLLM's convention, the wire request's ``priority``). ``pop``
  serves the lowest non-empty band; a lower band waits while a higher one has anyone
  ``pop`` may serve (the caller's ``skip``: tenants over their share of the fleet,
  ``flow_control``, are passed over in every band).
- **Bounds.** Each tenant holds at most ``queue_size`` waiting requests over all bands;
  one more is refused (``QueueFull``), never queued. A tenant's bound does not shrink
  another's.
- **Fairness by tokens, within a band: a virtual token counter** (VTC, Sheng et al.,
  "Fairness in Serving Large Language Models", OSDI 2024). Each tenant has a counter per
  band; ``pop`` serves the backlogged tenant whose counter is lowest and adds the
  request's cost (its prompt tokens + n x max_tokens, the worst case the rate limits
  charge too) to it. A tenant that becomes backlogged (its queue in the band was empty)
  has its counter lifted to the lowest counter of the tenants already backlogged there,
  so idle time banks no credit: a quiet tenant is served next, not forever. Ties go to
  the tenant served least recently (one never served in this busy period first), then to
  the one backlogged first: round robin among equals. A tenant's own requests leave in arrival
  order, except a request sent back (``requeue``: a replica refused it as full), which
  goes to the front of its tenant's queue with its cost given back.
- **Leaving without being served**: ``remove`` (its client hung up, its deadline passed)
  frees its place at once; its cost was never charged.
- **Rank at the replica** (``Turn.replica_priority``): the router's fairness does not stop at
  the replica's door. A released turn is *backlogged* when its tenant still has requests
  waiting here in its band and another tenant is active (``flow_control`` sets
  ``Turn.backlogged``: the tenant asks more than the fleet gives it, above its fair share; a lone
  tenant is at its share, so its requests keep their order); the replica is sent ``priority x NUM_STANDINGS + standing``
  (standing 1 when backlogged, else 0), so the band stays first and, within a band, a tenant
  below its fair share ranks before one above it; equal standing is equal rank (the replica's
  priority policy preempts only for a strictly more urgent request, so equals never thrash).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Optional

from pagoda.fleet.gate.auth import RateLimited

OPEN_TENANT = "-"  # the tenant of every request in open mode (no API keys)
# Standings within a band at the replica: 0, the tenant had nothing else waiting when the turn
# was released; 1, it was backlogged (``Turn.replica_priority``).
NUM_STANDINGS = 2


class QueueRefused(RateLimited):
    """A request that cannot wait at the router (429 + ``Retry-After``); the message names the
    limit (its flag, or the request's own ``timeout``). ``reason``: the metric's label."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason


class QueueFull(QueueRefused):
    """The tenant's queue holds ``queue_size`` requests already."""


@dataclass(eq=False)
class Turn:
    """One request's place in the flow: who sent it, its band, its cost and its deadline.

    Attributes:
        tenant: the tenant's id (``OPEN_TENANT`` in open mode).
        priority: the band (smaller first).
        cost: tokens charged to the tenant's counter when it is released (prompt + n x max_tokens).
        arrival: when it reached the router (the flow's clock).
        deadline: when it must have left the queue (the earlier of its ``timeout`` and
            ``--queue-max-wait``); ``timeout_s``: its own timeout, if any (which one bounds it).
        admitted: released by the queue (or never needed it); ``requeue`` clears it.
        backlogged: its tenant still had requests waiting here in its band, and another tenant was
            active, when it was released (its standing at the replica: ``replica_priority``).
    """

    tenant: str
    priority: int
    cost: int
    arrival: float
    deadline: float = math.inf
    timeout_s: Optional[float] = None
    admitted: bool = False
    waited_s: float = 0.0  # time spent waiting at the router, over all its waits
    queued_at: float = 0.0  # when its current wait began
    seq: int = 0
    requeued: bool = False
    unrouted: bool = False  # released, its routing decision not made yet (``FlowControl.num_unrouted``)
    backlogged: bool = False

    @property
    def replica_priority(self) -> int:
        """The ``priority`` the replica is sent: the band scaled, plus the tenant's standing at
        release (module docstring), so ``a < b`` between bands holds for every standing."""
        return self.priority * NUM_STANDINGS + int(self.backlogged)

    def remaining_timeout(self) -> Optional[float]:
        """Its own timeout less the time it waited at the router (``None``: it has none); the
        replica is sent this, so the request keeps its deadline."""
        if self.timeout_s is None:
            return None
        return max(1e-3, self.timeout_s - self.waited_s)


@dataclass
class _Band:
    queues: dict[str, deque] = field(default_factory=dict)  # tenant -> waiting turns (backlogged only)
    counters: dict[str, float] = field(default_factory=dict)  # tenant -> virtual tokens served
    since: dict[str, int] = field(default_factory=dict)  # tenant -> when it became backlogged (ties)
    served: dict[str, int] = field(default_factory=dict)  # tenant -> when it was last released from (ties)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())


class FairQueue:
    """Priority bands of per-tenant queues, released by virtual token counters (module docstring).

    Args:
        queue_size: waiting requests a tenant may hold (over all bands); at least 1.
    """

    def __init__(self, queue_size: int) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size: must be >= 1, got {queue_size}")
        self.queue_size = queue_size
        self._bands: dict[int, _Band] = {}
        self._depth: dict[str, int] = {}  # tenant -> waiting requests over all bands
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(self._depth.values())

    def depth(self, tenant: str) -> int:
        """Requests ``tenant`` has waiting."""
        return self._depth.get(tenant, 0)

    def depth_in(self, tenant: str, priority: int) -> int:
        """Requests ``tenant`` has waiting in band ``priority``."""
        band = self._bands.get(priority)
        queue = band.queues.get(tenant) if band is not None else None
        return len(queue) if queue is not None else 0

    def tenants(self) -> list[str]:
        """The tenants with requests waiting."""
        return list(self._depth)

    def depths(self) -> dict[tuple[str, int], int]:
        """Waiting requests per (tenant, band)."""
        return {(tenant, priority): len(queue) for priority, band in self._bands.items()
                for tenant, queue in band.queues.items()}

    def push(self, turn: Turn) -> None:
        """Queue ``turn`` at the back of its tenant's queue in its band (a requeued one: at the front).

        Raises:
            QueueFull: the tenant holds ``queue_size`` waiting requests (a requeued turn is
                never refused: it held a place already).
        """
        if not turn.requeued and self.depth(turn.tenant) >= self.queue_size:
            raise QueueFull(f"queue full: tenant {turn.tenant!r} has {self.depth(turn.tenant)} requests waiting at "
                            f"the router, at most {self.queue_size} (router --queue-size-per-tenant)", 1.0,
                            "queue_full")
        band = self._bands.setdefault(turn.priority, _Band())
        queue = band.queues.get(turn.tenant)
        if queue is None:  # it becomes backlogged: lift its counter (no banked credit)
            floor = min((band.counters[t] for t in band.queues), default=None)
            counter = band.counters.get(turn.tenant, 0.0)
            band.counters[turn.tenant] = counter if floor is None else max(counter, floor)
            band.since[turn.tenant] = next(self._seq)
            queue = band.queues[turn.tenant] = deque()
        turn.seq = next(self._seq)
        if turn.requeued:
            queue.appendleft(turn)
        else:
            queue.append(turn)
        self._depth[turn.tenant] = self.depth(turn.tenant) + 1

    def peek(self, skip: Collection[str] = ()) -> Optional[Turn]:
        """The turn ``pop`` would release, or ``None`` when nobody (not in ``skip``) waits."""
        for priority in sorted(self._bands):
            band = self._bands[priority]
            tenants = [t for t in band.queues if t not in skip]
            if tenants:
                tenant = min(tenants, key=lambda t: (band.counters[t], band.served.get(t, -1), band.since[t]))
                return band.queues[tenant][0]
        return None

    def pop(self, skip: Collection[str] = ()) -> Optional[Turn]:
        """Release the next turn: the highest band's backlogged tenant with the lowest counter,
        which is charged the turn's cost; tenants in ``skip`` (over their share of the fleet:
        ``flow_control``) are passed over. ``None`` when nobody else waits."""
        turn = self.peek(skip)
        if turn is None:
            return None
        band = self._bands[turn.priority]
        band.counters[turn.tenant] += turn.cost
        band.served[turn.tenant] = next(self._seq)
        self._take(band, turn)
        turn.admitted, turn.requeued = True, False
        return turn

    def requeue(self, turn: Turn) -> None:
        """Send a released turn back (a replica refused it as full): its cost is given back and
        it waits at the front of its tenant's queue."""
        band = self._bands.get(turn.priority)
        if band is not None and turn.tenant in band.counters:
            band.counters[turn.tenant] = max(0.0, band.counters[turn.tenant] - turn.cost)
        turn.admitted, turn.requeued = False, True
        self.push(turn)

    def remove(self, turn: Turn) -> bool:
        """Take a waiting turn out unserved (cancelled, expired); ``False`` if it was not waiting."""
        band = self._bands.get(turn.priority)
        queue = band.queues.get(turn.tenant) if band is not None else None
        if queue is None or turn not in queue:
            return False
        self._take(band, turn)
        return True

    def expired(self, now: float) -> list[Turn]:
        """The waiting turns whose deadline is at or before ``now`` (still queued: ``remove`` them)."""
        return [t for band in self._bands.values() for q in band.queues.values() for t in q if t.deadline <= now]

    def _take(self, band: _Band, turn: Turn) -> None:
        queue = band.queues[turn.tenant]
        queue.remove(turn)
        self._depth[turn.tenant] -= 1
        if not self._depth[turn.tenant]:
            del self._depth[turn.tenant]
        if not queue:
            del band.queues[turn.tenant]
            del band.since[turn.tenant]
        if not band.queues:  # nobody backlogged: counters would all be lifted anyway
            del self._bands[turn.priority]
