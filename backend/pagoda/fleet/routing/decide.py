"""The one decision path of the router and the simulator: signals -> policy -> memory.

``Router.choose`` (``pagoda.fleet.routing.router``) and ``FleetSimulator``
(``pagoda.fleet.sim.simulator``) differ in where their inputs come from (Redis or a
``LocalIndex``, heartbeats or a simulated clock) and in their own accounting (in-flight
counts, metrics); what a policy is shown and what a decision leaves behind is decided
here, from the policy's declared capabilities (``pagoda.fleet.routing.policy.Policy``):

1. ``request.matched_blocks`` holds the KV-event index's answer; a policy without
   ``uses_exact`` ignores it (the caller may keep it for its own accounting).
2. A policy with ``uses_pending`` is shown ``pending_blocks``: the pending index's answer,
   continuing past the exact index's leading blocks only where the policy reads the index
   (``approximate`` is its own history alone).
3. The policy chooses.
4. A policy with ``uses_pending`` has its decision recorded as pending ownership of the
   prompt's blocks for ``pending_ttl_s`` (``record``: the router also shares it).

KV events confirm (drop) pending entries only for a policy with ``uses_exact``
(``confirms_pending``): without the index the pending entries are the only witness.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from pagoda.fleet.routing.affinity import PendingIndex
from pagoda.fleet.routing.policy import Policy, ReplicaState, RoutingRequest

Record = Callable[[str, Sequence[str], float], None]  # (replica_id, block_hashes, ttl_s)


def decide(policy: Policy, replicas: Sequence[ReplicaState], request: RoutingRequest, pending: PendingIndex,
           record: Optional[Record] = None) -> ReplicaState:
    """Show ``policy`` its signals, let it choose, and remember the decision (module docstring).

    Args:
        policy: the policy.
        replicas: the candidates' states.
        request: the request with ``matched_blocks`` filled; ``pending_blocks`` is set here.
        pending: the pending index (matched and, without ``record``, recorded).
        record: records a decision instead of ``pending.record``.

    Returns:
        The chosen replica's state. Raises ``NoReplicaError`` when no replica is eligible.
    """
    if policy.uses_pending:
        confirmed = request.matched_blocks if policy.uses_exact else {}
        request.pending_blocks = pending.match(request.block_hashes, confirmed=confirmed)
    chosen = policy.choose(replicas, request)
    if policy.uses_pending:
        (record or pending.record)(chosen.replica_id, request.block_hashes, policy.pending_ttl_s)
    return chosen


def confirms_pending(policy: Policy) -> bool:
    """Whether KV events should drop ``policy``'s pending entries (module docstring)."""
    return policy.uses_exact
