"""Routing policies: which replica serves a request. One small strategy object per policy.

Every policy answers ``choose(replicas, request) -> ReplicaState`` and nothing else, so
the real router (``pagoda.fleet.routing.router``) and the simulator
(``pagoda.fleet.sim.simulator``) run the very same objects, through the one decision path
``pagoda.fleet.routing.decide``. Policies never do I/O; the router gathers their inputs.

Capabilities
------------
A policy declares what it reads as class attributes of ``Policy`` (the protocol every
policy subclasses; its values are the only defaults: a policy that declares nothing routes
by load alone):

``uses_exact``     reads ``matched_blocks``: the KV-event index. KV events then confirm
    (drop) its pending entries, and without the index (Redis down) the router routes with
    ``least_loaded`` instead. Default False.
``uses_pending``   reads ``pending_blocks``: every decision is recorded as pending
    ownership for ``pending_ttl_s`` seconds. Default False (``prefix_aware`` derives it
    from its knobs).

Inputs
------
``ReplicaState`` is the router's view of one replica: ``waiting``/``running``/
``kv_usage`` from its last heartbeat (up to one heartbeat interval old), ``in_flight``
(the router's own count of requests it forwarded there and that have not finished; the
router increments it right after ``choose`` returns and decrements it when the response
stream ends), ``healthy`` (the router could reach it) and ``draining`` (the drain flag).

``RoutingRequest.shared_blocks`` is the index's answer for the KV shared tiers (tier id ->
leading blocks there; the index keeps each tier under a pseudo replica id, which the router
moves out of ``matched_blocks``), credited to the replicas that mount the tier.

``RoutingRequest.matched_blocks`` is the prefix index's answer for the request's block
hashes (``PrefixIndex.match`` / ``IndexFollower.match``): replica id -> leading blocks
it holds. It is empty when the index is unavailable; every policy then still routes by
load alone. ``RoutingRequest.pending_blocks`` is the same answer from the routers' own
recent decisions (``pagoda.fleet.routing.affinity.PendingIndex``: "sent there, not yet confirmed
by its KV events"); the router fills it only for policies with ``uses_pending``.

Eligibility (all policies)
--------------------------
Only healthy replicas are ever chosen. Non-draining ones are preferred; draining ones are
used only when no healthy replica is left undrained (finishing traffic on a replica that
is shutting down beats failing it). No healthy replica: ``NoReplicaError``.

Load
----
``load = max(waiting + running, in_flight)``. The heartbeat sees every router's traffic
but lags; ``in_flight`` is exact for this router and counts a request the moment it is
routed. Taking the maximum (not the sum, which would count this router's requests twice
once the heartbeat catches up) is the optimistic in-flight accounting that stops a burst
arriving between two heartbeats from herding onto the replica that looked idle.

Policies
--------
``random``        uniform among the eligible. Knob: ``seed``.
``round_robin``   eligible replicas in ``replica_id`` order, one after the other.
``least_loaded``  smallest load; ties: smaller ``kv_usage``, then ``replica_id``.
``prefix_aware``  cache-aware with load balance, from both signals ("combined"). For each
    eligible replica ``r``, with ``exact(r)`` and ``pending(r)`` the matched prompt tokens
    of ``matched_blocks`` and ``pending_blocks`` (each capped at the prompt's length),
    ``shared(r)`` those of ``shared_blocks`` on the KV shared tier ``r`` mounts (its heartbeat's
    ``shared_tier``; 0 for none) and ``known`` the longest of any exact or shared match::

        cached(r)   = exact(r) + shared_discount * max(0, shared(r) - exact(r))
                    + pending_discount * max(0, pending(r) - max(exact(r), known))
        uncached(r) = num_prompt_tokens - cached(r)
        cost(r)     = uncached(r) + load_cost_tokens * load(r) + waiting_cost_tokens * waiting(r)

    Pending credit counts only beyond the longest exact match anywhere: pending ownership
    predicts where a prefix the index does not know yet is being computed (a burst's first
    request); where the index already knows the prefix, it is the better witness, and a
    replica that was merely sent the prefix (a guard spill still queued) must not draw the
    prefix's traffic away from the replica that holds it.

    The replica with the smallest cost wins (ties: smaller load, then
    ``replica_id``, so the choice is deterministic). ``cost`` is in prompt tokens: the
    prefill work this request would cost on ``r`` plus a token-equivalent price for the
    queue it joins. A long cached prefix therefore outweighs a few queued requests, while
    a short one (a chat template shared by everybody) barely matters.

    Imbalance guard: before costs are compared, replicas whose load exceeds the least
    loaded eligible replica's by more than ``max(imbalance_abs, imbalance_rel * min_load)``
    are set aside. A hot prefix thus fills its replica up to that margin and then spills
    to the least loaded replicas, which cache it too; the fleet never sits idle behind
    one hot tenant, however valuable its prefix.

    Knobs:
      ``load_cost_tokens`` (default 64, ``LOAD_COST_TOKENS``): prompt tokens of prefill
          one unit of load is worth. Larger = balance load sooner, smaller = follow the
          cache harder. Price what a request already on the replica costs a newcomer's
          first token: under continuous batching a running request does not make the
          newcomer wait for it, it only adds its decode token and its attention over its
          context to each shared step — on the calibrated CPU step model (``fleet.sim``)
          about 15-30 prompt tokens of prefill per step, a few steps until the newcomer's
          first token. Queues that really build (saturation) are the imbalance guard's
          job. The default was 256 (a running request priced like a queued prompt) until
          a sweep showed it spilled hot prefixes far too early: in the simulator (poisson,
          0.4 req/s/replica) 64 gave prefix_aware 1.8-2.1x lower P90 TTFT and 4-9 points
          more hit rate than 256 at 8/16/32 replicas, and on the live two-replica fleet it
          keeps 4 concurrent clients at the sequential hit rate (docs/fleet.md).
      ``waiting_cost_tokens`` (default 256, ``WAITING_COST_TOKENS``): the extra price of a
          request in the replica's own waiting queue (heartbeat ``waiting``: not admitted
          to a batch yet). Unlike a running request, a waiting one does delay a newcomer by
          its prefill. The heartbeat is up to a second old, so the price stays moderate:
          in the simulator 256 lowered ``prefix_aware``'s P90 TTFT under 4-replica fan-out
          bursts (where one replica queued while others idled) by 15-34% and on the
          diurnal cycle by 28%, and left Poisson traffic within 5%; 1024 made routing
          herd on stale heartbeats (diurnal P90 9x worse).
      ``imbalance_abs`` (default 8): load margin, in requests, tolerated above the least
          loaded replica before the guard sets a replica aside.
      ``imbalance_rel`` (default 1.5): the same margin relative to the least loaded
          replica's load (the larger of the two margins applies), so the guard scales
          with fleet-wide load.
      ``pending_discount`` (default 0.8): credit for a pending (routed, unconfirmed)
          block relative to a confirmed one; below 1 so a confirmed copy wins a tie, above
          ``load_cost_tokens / prefix_tokens`` so a burst follows its first request.
      ``shared_discount`` (default 0.75, ``SHARED_DISCOUNT``; in [0, 1)): credit for a block on
          the shared tier the replica mounts (a directory several replicas mount: the replica
          reads and verifies the file instead of recomputing) relative to one on its device.
          Below 1 so a replica holding the prefix on its device wins over one that would read
          it; above 0 so a replica that can read it beats one that would recompute. 0.75 is
          below what ``pagoda bench kv-tiers`` measured on a CPU (a shared-tier hit took 2-15% of
          the recompute's TTFT, i.e. 0.85-0.98) because those files were read from the page
          cache; a cold read from a networked volume costs more, and on a GPU prefill is fast.
      ``pending_ttl_s`` (default 10): how long the router keeps a decision as pending
          ownership (read by the router, which records it): long enough to cover queueing
          plus prefill of the first request of a burst, short enough that a decision whose
          blocks never arrived (failed request, immediate eviction) stops attracting.

``precise``       ``prefix_aware`` on the KV-event index alone (``pending_discount`` 0; no
    decisions recorded; shared tiers credited as above): llm-d's "precise prefix-cache" scorer.
``approximate``   ``prefix_aware`` on routing-time affinity alone (the exact index is
    ignored; ``pending_discount`` 1, ``pending_ttl_s`` 120): llm-d's "approximate" scorer,
    which assumes a replica holds what was recently routed to it.

``make_policy(name, **knobs)`` builds one from the ``POLICIES`` registry.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence


LOAD_COST_TOKENS = 64.0  # default price of one unit of load, in prompt tokens (module docstring)
WAITING_COST_TOKENS = 256.0  # default extra price of a request waiting in a replica's queue
SHARED_DISCOUNT = 0.75  # default credit of a shared-tier block relative to a device block (module docstring)


class NoReplicaError(RuntimeError):
    """No healthy replica can take the request."""


@dataclass
class ReplicaState:
    replica_id: str
    endpoints: dict[str, str] = field(default_factory=dict)
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0
    healthy: bool = True
    draining: bool = False
    shared_tier: str = ""  # the KV shared tier it mounts (heartbeat ``shared_tier``), "" for none

    @property
    def load(self) -> int:
        """Optimistic load: see the module docstring."""
        return max(self.waiting + self.running, self.in_flight)


@dataclass
class RoutingRequest:
    request_id: str
    block_hashes: list[str]
    num_prompt_tokens: int
    block_size: int
    matched_blocks: dict[str, int] = field(default_factory=dict)
    pending_blocks: dict[str, int] = field(default_factory=dict)
    shared_blocks: dict[str, int] = field(default_factory=dict)  # shared tier id -> leading blocks there

    def matched_tokens(self, replica_id: str) -> int:
        return min(self.matched_blocks.get(replica_id, 0) * self.block_size, self.num_prompt_tokens)

    def shared_tokens(self, tier_id: str) -> int:
        return min(self.shared_blocks.get(tier_id, 0) * self.block_size, self.num_prompt_tokens) if tier_id else 0

    def pending_tokens(self, replica_id: str) -> int:
        return min(self.pending_blocks.get(replica_id, 0) * self.block_size, self.num_prompt_tokens)


class Policy(Protocol):
    """A routing policy: a name, its capabilities (module docstring) and ``choose``.

    Policies subclass it explicitly, so these class attributes are their defaults.
    """

    name: str = ""
    uses_exact: bool = False  # reads matched_blocks (needs the KV-event index)
    uses_pending: bool = False  # reads pending_blocks (decisions are recorded as pending)
    pending_ttl_s: float = 0.0  # how long a recorded decision stays pending

    def choose(self, replicas: Sequence[ReplicaState], request: RoutingRequest) -> ReplicaState:
        """The replica for ``request``. Raises ``NoReplicaError`` if none is eligible."""


def eligible(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """Healthy non-draining replicas, else healthy draining ones; sorted by id.

    Raises:
        NoReplicaError: no healthy replica at all.
    """
    healthy = sorted((r for r in replicas if r.healthy), key=lambda r: r.replica_id)
    if not healthy:
        raise NoReplicaError(f"no healthy replica among {len(replicas)}")
    return [r for r in healthy if not r.draining] or healthy


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[ReplicaState], request: RoutingRequest) -> ReplicaState:
        return self._rng.choice(eligible(replicas))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[ReplicaState], request: RoutingRequest) -> ReplicaState:
        candidates = eligible(replicas)
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def choose(self, replicas: Sequence[ReplicaState], request: RoutingRequest) -> ReplicaState:
        return min(eligible(replicas), key=lambda r: (r.load, r.kv_usage, r.replica_id))


class PrefixAwarePolicy(Policy):
    name = "prefix_aware"
    uses_exact = True

    def __init__(self, load_cost_tokens: float = LOAD_COST_TOKENS, imbalance_abs: float = 8.0,
                 imbalance_rel: float = 1.5, pending_discount: float = 0.8, pending_ttl_s: float = 10.0,
                 waiting_cost_tokens: float = WAITING_COST_TOKENS, shared_discount: float = SHARED_DISCOUNT) -> None:
        if min(load_cost_tokens, imbalance_abs, imbalance_rel, pending_discount, pending_ttl_s,
               waiting_cost_tokens) < 0:
            raise ValueError(f"{self.name}: load_cost_tokens, imbalance_abs, imbalance_rel, pending_discount, "
                             "pending_ttl_s and waiting_cost_tokens must be >= 0")
        if not 0 <= shared_discount < 1:
            raise ValueError(f"{self.name}: shared_discount must be in [0, 1) (a device copy beats a shared-tier "
                             f"copy), got {shared_discount}")
        self.shared_discount = shared_discount
        self.load_cost_tokens = load_cost_tokens
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.pending_discount = pending_discount
        self.pending_ttl_s = pending_ttl_s
        self.waiting_cost_tokens = waiting_cost_tokens

    @property
    def uses_pending(self) -> bool:  # type: ignore[override] - derived from the knobs
        """Whether decisions are recorded and ``pending_blocks`` filled (both knobs > 0)."""
        return self.pending_discount > 0 and self.pending_ttl_s > 0

    def cached_tokens(self, request: RoutingRequest, replica_id: str, shared_tier: str = "") -> float:
        """Prompt tokens credited as cached on ``replica_id``, which mounts ``shared_tier`` (module docstring)."""
        if not self.uses_exact:
            return self.pending_discount * request.pending_tokens(replica_id) if self.uses_pending else 0
        exact = request.matched_tokens(replica_id)
        cached = exact + self.shared_discount * max(0, request.shared_tokens(shared_tier) - exact)
        if not self.uses_pending:
            return cached
        known = max(max(map(request.matched_tokens, request.matched_blocks), default=0),
                    max(map(request.shared_tokens, request.shared_blocks), default=0))
        return cached + self.pending_discount * max(0, request.pending_tokens(replica_id) - max(exact, known))

    def choose(self, replicas: Sequence[ReplicaState], request: RoutingRequest) -> ReplicaState:
        candidates = eligible(replicas)
        min_load = min(r.load for r in candidates)
        margin = max(self.imbalance_abs, self.imbalance_rel * min_load)
        balanced = [r for r in candidates if r.load <= min_load + margin]

        def cost(r: ReplicaState) -> tuple[float, int, str]:
            uncached = request.num_prompt_tokens - self.cached_tokens(request, r.replica_id, r.shared_tier)
            return (uncached + self.load_cost_tokens * r.load + self.waiting_cost_tokens * r.waiting, r.load,
                    r.replica_id)

        return min(balanced, key=cost)


class PrecisePolicy(PrefixAwarePolicy):
    name = "precise"

    def __init__(self, load_cost_tokens: float = LOAD_COST_TOKENS, imbalance_abs: float = 8.0,
                 imbalance_rel: float = 1.5, waiting_cost_tokens: float = WAITING_COST_TOKENS,
                 shared_discount: float = SHARED_DISCOUNT) -> None:
        super().__init__(load_cost_tokens, imbalance_abs, imbalance_rel, pending_discount=0.0, pending_ttl_s=0.0,
                         waiting_cost_tokens=waiting_cost_tokens, shared_discount=shared_discount)


class ApproximatePolicy(PrefixAwarePolicy):
    name = "approximate"
    uses_exact = False

    def __init__(self, load_cost_tokens: float = LOAD_COST_TOKENS, imbalance_abs: float = 8.0,
                 imbalance_rel: float = 1.5, pending_ttl_s: float = 120.0,
                 waiting_cost_tokens: float = WAITING_COST_TOKENS) -> None:
        if pending_ttl_s <= 0:
            raise ValueError("approximate: pending_ttl_s must be > 0 (it is the policy's only signal)")
        super().__init__(load_cost_tokens, imbalance_abs, imbalance_rel, pending_discount=1.0,
                         pending_ttl_s=pending_ttl_s, waiting_cost_tokens=waiting_cost_tokens)


POLICIES: dict[str, Callable[..., Policy]] = {
    RandomPolicy.name: RandomPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    PrefixAwarePolicy.name: PrefixAwarePolicy,
    PrecisePolicy.name: PrecisePolicy,
    ApproximatePolicy.name: ApproximatePolicy,
}


def make_policy(name: str, **knobs) -> Policy:
    """Build the policy registered as ``name`` with ``knobs`` (see the module docstring).

    Raises:
        ValueError: an unknown name (the message lists the known ones) or an unknown knob.
    """
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    try:
        return factory(**knobs)
    except TypeError as exc:
        raise ValueError(f"routing policy {name!r}: bad knobs {sorted(knobs)}: {exc}") from None
