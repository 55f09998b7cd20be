"""The routing decision: prompt -> block hashes -> index match + replica load -> policy -> replica.

``Router.analyze`` tokenizes the prompt exactly as the engine will (the same tokenizer,
``encode(text)`` with the default special tokens) and hashes its full blocks with
``pagoda.contracts.block_hash.hash_prompt_blocks`` under the replicas' hash model id and the
request's ``cache_salt``. ``Router.choose`` asks the prefix index which replicas hold how
many leading blocks, builds a ``ReplicaState`` per routable replica (heartbeat load plus
the router's own in-flight count) and lets the configured policy pick. The chosen
replica's in-flight count is raised at once (optimistic accounting); the caller must
``release`` the decision when the request ends.

Redis (``pagoda.fleet.routing.fleet_view``): the router reads the prefix index and the
registry through a ``FleetView``; while it reports Redis unavailable, routing is load-only
(``least_loaded`` over the router's own in-flight counts, the cached heartbeat values are
ignored as stale) over the replicas known from the last registry read or the static list.

The policy's signals and memory follow ``pagoda.fleet.routing.decide``, the decision path
the simulator runs too. Routing-time affinity (``pagoda.fleet.routing.affinity``): for
policies with ``uses_pending`` (``prefix_aware``, ``approximate``) every decision is
recorded as pending ownership of the prompt's blocks on the chosen replica
(``policy.pending_ttl_s``), in the router's ``PendingIndex`` and, with Redis, on the shared
``routed`` stream for the other routers; the next requests see it as ``pending_blocks``
before the replica's KV events arrive.
KV shared tiers: the index answers for each under a pseudo replica id; ``split_shared_tiers``
moves them to ``RoutingRequest.shared_blocks`` and every replica state carries the tier its
heartbeat announces (``shared_tier``), so the policy credits them to the replicas mounting it.
Each decision counts the prompt tokens matched on the chosen replica by kind: ``exact``
(the KV-event index), ``shared`` (its shared tier beyond the exact match) and ``pending``
(pending beyond the exact match), exported as
``pagoda:router_prefix_match_tokens{kind=...}`` and as span attributes.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

from pagoda.contracts import redis_keys as keys
from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.fleet.routing.affinity import PendingIndex
from pagoda.fleet.routing.decide import confirms_pending, decide
from pagoda.fleet.routing.fleet_view import IndexView
from pagoda.fleet.routing.replicas import Replica, ReplicaSet

if TYPE_CHECKING:
    from pagoda.fleet.routing.image_routing import RouterImages
    from pagoda.models.tokenizer import Tokenizer

FALLBACK_POLICY = "least_loaded"


def split_shared_tiers(matched: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """An index answer split into (replica id -> blocks, shared tier id -> blocks): the index keeps
    each KV shared tier under a pseudo replica id (``keys.shared_tier_replica_id``)."""
    replicas, tiers = {}, {}
    for rid, n in matched.items():
        tier = keys.shared_tier_of(rid)
        if tier:
            tiers[tier] = n
        else:
            replicas[rid] = n
    return replicas, tiers


class NoReplicaAvailable(RuntimeError):
    """No healthy, non-draining replica can take the request."""


@dataclass
class Analysis:
    """What routing needs to know about a prompt."""

    num_prompt_tokens: int
    block_hashes: list[str]  # hex, full blocks only
    block_size: int
    # The prompt's token ids and the tokenizer that made them (its fingerprint; None: the
    # prompt came as ids): a door sends them on, so the replica does not tokenize again.
    token_ids: Optional[list[int]] = None
    tokenizer: Optional[str] = None


@dataclass
class Decision:
    """Where one request goes, and why."""

    replica: Replica
    policy: str
    matched_blocks: int
    num_prompt_tokens: int
    num_prompt_blocks: int
    redis_available: bool
    decision_s: float
    attempt: int = 1
    released: bool = False
    pending_blocks: int = 0  # pending (routed, unconfirmed) blocks beyond matched_blocks
    peer: Optional[str] = None  # another replica holding more of the prompt (``peer_pull``)
    peer_blocks: int = 0  # how many of its blocks that one holds
    shared_blocks: int = 0  # blocks beyond matched_blocks on the KV shared tier the replica mounts
    # Called once when the decision is released (the router's queue counts a tenant's requests in flight).
    on_release: Optional[Callable[[], None]] = field(default=None, repr=False)

    @property
    def match_kind(self) -> str:
        """``exact``, ``shared`` (only the KV shared tier it mounts holds the prefix), ``pending``
        (only routing-time affinity pointed here) or ``none``."""
        return ("exact" if self.matched_blocks else "shared" if self.shared_blocks
                else "pending" if self.pending_blocks else "none")


class Router:
    """Makes routing decisions and keeps the in-flight accounting.

    Args:
        replicas: membership, health and in-flight counts.
        tokenizer: the served model's ``Tokenizer``.
        hash_model_id: the block-hash root (the replicas' model folder name); a heartbeat's
            ``hash_model_id`` overrides it when present.
        policy_name: ``random``, ``round_robin``, ``least_loaded`` or ``prefix_aware``.
        fleet: the Redis view (an ``IndexView``), or ``None`` (no Redis: load-only routing
            always, and the router keeps its own pending index).
        block_size: used until a heartbeat reports the replicas' block size.
        images: the served model's image rules (``RouterImages``), so an image prompt's block
            hashes carry its images' keys as the replica's do; None: a text model.
        policy_knobs: keyword arguments for ``make_policy``.
    """

    def __init__(self, replicas: ReplicaSet, tokenizer: "Tokenizer", hash_model_id: str,
                 policy_name: str = "prefix_aware", fleet: Optional[IndexView] = None, block_size: int = 16,
                 images: Optional["RouterImages"] = None, **policy_knobs: Any) -> None:
        from pagoda.fleet.routing.policy import make_policy

        self.replicas = replicas
        self.tokenizer = tokenizer
        self.hash_model_id = hash_model_id
        self.policy_name = policy_name
        self.policy = make_policy(policy_name, **policy_knobs)
        self.fallback_policy = make_policy(FALLBACK_POLICY)
        self.fleet = fleet
        self.block_size = block_size
        self.images = images
        self._request_numbers = itertools.count()
        self.decision_times_s: list[float] = []  # bounded ring, read by /metrics and the bench
        self.num_decisions = 0
        self.num_fallback_decisions = 0
        self.pending = fleet.pending if fleet is not None else PendingIndex()
        if fleet is not None and confirms_pending(self.policy):
            fleet.confirm_pending_on_kv_events()
        self.num_match_tokens = {"exact": 0, "pending": 0, "shared": 0}
        self.num_two_stage = 0  # requests the doors ran prefill -> decode (disaggregated)
        self.num_peer_pulls = 0  # requests sent with a peer to pull their prefix from (routing.peer_pull)

    # --------------------------------------------------------------- heartbeats
    def apply_heartbeats(self, infos: Iterable[Any]) -> None:
        infos = list(infos)
        self.replicas.apply_heartbeats(infos)
        sizes = {int(getattr(info, "block_size", 0) or 0) for info in infos} - {0}
        if len(sizes) == 1:
            self.block_size = sizes.pop()
        model_ids = {getattr(info, "hash_model_id", None) for info in infos} - {None, ""}
        if len(model_ids) == 1:
            self.hash_model_id = model_ids.pop()

    # --------------------------------------------------------------- decisions
    def analyze(self, prompt: Union[str, list[int]], cache_salt: Optional[str] = None,
                adapter_id: Optional[str] = None, images: Sequence[Any] = ()) -> Analysis:
        """Tokenize and hash a prompt, text or token ids (the engine's tokenization and block
        hashes; a LoRA adapter is part of them, so an adapter's traffic goes where its
        prefixes live; ``images``, the prompt's encoded images in order, are too, by content:
        ``image_routing``). ``Analysis.token_ids`` stays the prompt as sent (one placeholder
        per image: the replica expands it); ``num_prompt_tokens`` counts the expanded prompt."""
        token_ids = list(prompt) if isinstance(prompt, list) else self._encode(prompt)
        hashed, spans = (self.images.expand(token_ids, images) if images and self.images is not None
                         else (token_ids, []))
        hashes = hash_prompt_blocks(hashed, self.block_size, self.hash_model_id, cache_salt=cache_salt,
                                    adapter_id=adapter_id, mm_spans=spans)
        tokenizer = None if isinstance(prompt, list) else getattr(self.tokenizer, "fingerprint", None)
        num_tokens = len(hashed) if spans else len(token_ids)
        return Analysis(num_tokens, [h.hex() for h in hashes], self.block_size, token_ids, tokenizer)

    def _encode(self, prompt: str) -> list[int]:
        # The engine's encode(prompt) ids; the batch "fast" path skips offset tracking, which
        # routing does not need (~20% of tokenizing a 1k-token prompt).
        backend = getattr(self.tokenizer, "backend", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            return backend.encode_batch_fast([prompt])[0].ids
        return self.tokenizer.encode(prompt)

    async def choose(self, analysis: Optional[Analysis], exclude: Iterable[str] = (), attempt: int = 1) -> Decision:
        """Pick a replica and count the request in flight there.

        Args:
            analysis: from ``analyze``; ``None`` when the prompt could not be read (the
                replica will answer with its own error), which routes by load.
            exclude: replica ids already tried for this request.

        Raises:
            NoReplicaAvailable: every replica is unhealthy, draining or excluded.
        """
        from pagoda.fleet.routing.policy import NoReplicaError, ReplicaState, RoutingRequest

        start = time.perf_counter()
        # Draining replicas stay candidates, flagged: the policy uses them only when no
        # other healthy replica is left (finishing traffic beats failing it).
        candidates = self.replicas.routable(exclude, include_draining=True)
        if not candidates:
            raise NoReplicaAvailable(self._no_replica_message(exclude))
        matched = None
        if self.fleet is not None and analysis is not None:
            matched = await self.fleet.match(analysis.block_hashes)
        redis_available = matched is not None
        matched, shared = split_shared_tiers(matched or {})
        by_load_only = not redis_available
        states = [ReplicaState(replica_id=r.replica_id, endpoints=r.endpoints,
                               waiting=0 if by_load_only else r.waiting, running=0 if by_load_only else r.running,
                               kv_usage=0.0 if by_load_only else r.kv_usage, in_flight=r.in_flight,
                               healthy=True, draining=r.draining, shared_tier=r.shared_tier) for r in candidates]
        # Without the index the policies that read it need a stand-in; the others route as asked.
        policy, policy_name = ((self.fallback_policy, FALLBACK_POLICY) if by_load_only and self.policy.uses_exact
                               else (self.policy, self.policy_name))
        request = RoutingRequest(
            request_id=str(next(self._request_numbers)),
            block_hashes=analysis.block_hashes if analysis else [],
            num_prompt_tokens=analysis.num_prompt_tokens if analysis else 0,
            block_size=analysis.block_size if analysis else self.block_size,
            matched_blocks=matched, shared_blocks=shared)
        try:
            chosen = decide(policy, states, request, self.pending, record=self._remember)
        except NoReplicaError as exc:
            raise NoReplicaAvailable(str(exc)) from None
        replica = self.replicas.get(chosen.replica_id)
        assert replica is not None, f"policy chose {chosen.replica_id}, which is not a candidate"
        self.replicas.acquire(replica)
        exact_blocks = int(request.matched_blocks.get(replica.replica_id, 0))
        pending_blocks = max(0, int(request.pending_blocks.get(replica.replica_id, 0)) - exact_blocks)
        self.num_match_tokens["exact"] += request.matched_tokens(replica.replica_id)
        self.num_match_tokens["pending"] += max(0, request.pending_tokens(replica.replica_id)
                                                - request.matched_tokens(replica.replica_id))
        shared_blocks = max(0, int(shared.get(replica.shared_tier, 0) if replica.shared_tier else 0) - exact_blocks)
        self.num_match_tokens["shared"] += max(0, request.shared_tokens(replica.shared_tier)
                                               - request.matched_tokens(replica.replica_id))
        holders = {rid: int(n) for rid, n in request.matched_blocks.items() if rid != replica.replica_id}
        peer = max(holders, key=holders.get, default=None)
        if peer is not None and holders[peer] <= exact_blocks:
            peer = None
        elapsed = time.perf_counter() - start
        self._record(elapsed, by_load_only)
        return Decision(replica=replica, policy=policy_name, matched_blocks=exact_blocks,
                        num_prompt_tokens=request.num_prompt_tokens, num_prompt_blocks=len(request.block_hashes),
                        redis_available=redis_available, decision_s=elapsed, attempt=attempt,
                        pending_blocks=pending_blocks, peer=peer, peer_blocks=holders.get(peer, 0) if peer else 0,
                        shared_blocks=shared_blocks)

    def _remember(self, replica_id: str, block_hashes: Sequence[str], ttl_s: float) -> None:
        """Record a decision as pending ownership, here and (with Redis) for the other routers."""
        self.pending.record(replica_id, block_hashes, ttl_s)
        if self.fleet is not None:
            self.fleet.share_decision(replica_id, block_hashes, ttl_s)

    def metric_lines(self) -> list[str]:
        """Prometheus lines for routing-time affinity and reaping (``/metrics`` appends them)."""
        lines = ["# HELP pagoda:router_prefix_match_tokens prompt tokens matched on the chosen replica, by kind",
                 "# TYPE pagoda:router_prefix_match_tokens counter",
                 *(f'pagoda:router_prefix_match_tokens{{kind="{kind}"}} {n}'
                   for kind, n in self.num_match_tokens.items()),
                 "# TYPE pagoda:router_pending_entries gauge",
                 f"pagoda:router_pending_entries {self.pending.num_entries}",
                 "# HELP pagoda:router_two_stage_requests_total requests run prefill replica -> decode replica",
                 "# TYPE pagoda:router_two_stage_requests_total counter",
                 f"pagoda:router_two_stage_requests_total {self.num_two_stage}",
                 "# HELP pagoda:router_peer_pulls_total requests whose replica pulled their prefix from a peer",
                 "# TYPE pagoda:router_peer_pulls_total counter",
                 f"pagoda:router_peer_pulls_total {self.num_peer_pulls}"]
        if self.fleet is not None:
            lines += ["# HELP pagoda:router_reaped_replicas_total "
                      "expired replicas whose index entries this router removed",
                      "# TYPE pagoda:router_reaped_replicas_total counter",
                      f"pagoda:router_reaped_replicas_total {self.fleet.num_reaped}"]
            lines += self._index_lines(getattr(self.fleet, "follower", None))  # IndexView stand-ins have none
        return lines

    @staticmethod
    def _index_lines(follower: Any) -> list[str]:
        """The index mirror's health: synced (0 means stale: matches fall back to Redis round trips)."""
        if follower is None:  # index_mode "direct": every match is a Redis read, never stale
            return []
        return ["# HELP pagoda:router_index_synced 1 while the router's in-memory prefix index follows the stream",
                "# TYPE pagoda:router_index_synced gauge",
                f"pagoda:router_index_synced {int(follower.is_synced)}",
                "# HELP pagoda:router_index_resyncs_total index snapshots taken (the first, then after lost events)",
                "# TYPE pagoda:router_index_resyncs_total counter",
                f'pagoda:router_index_resyncs_total{{scope="full"}} {follower.num_full_syncs}',
                f'pagoda:router_index_resyncs_total{{scope="replica"}} {follower.num_replica_resyncs}']

    def release(self, decision: Decision) -> None:
        """End a decision's in-flight count (idempotent)."""
        if not decision.released:
            decision.released = True
            self.replicas.release(decision.replica)
            if decision.on_release is not None:
                decision.on_release()

    def _record(self, elapsed_s: float, fallback: bool) -> None:
        self.num_decisions += 1
        self.num_fallback_decisions += int(fallback)
        self.decision_times_s.append(elapsed_s)
        if len(self.decision_times_s) > 10_000:
            del self.decision_times_s[:5_000]

    def _no_replica_message(self, exclude: Iterable[str]) -> str:
        known = self.replicas.all()
        if not known:
            return "no replica is known to the router yet"
        parts = []
        for r in known:
            state = ("tried" if r.replica_id in set(exclude) else "draining" if r.draining
                     else f"unhealthy ({r.unhealthy_reason})" if not r.healthy else "ok")
            parts.append(f"{r.replica_id}: {state}")
        return "no replica can take the request: " + "; ".join(parts)
