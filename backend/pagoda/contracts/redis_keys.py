"""The Redis key layout of the fleet layer (ARCHITECTURE contract 4): the one definition.

Every key of one served model lives under the namespace ``pagoda:{model}:`` (``{model}``
is the served model name, e.g. the LLMService's ``spec.model.name``; it is *not* a Redis
cluster hash tag). Replicas, routers and the operator build names only through the
functions below; ``pagoda_operator.fleet_keys`` re-exports them.

::

    pagoda:{model}:replicas                     SET    replica ids that ever published (the registry)
    pagoda:{model}:replica:{replica_id}         HASH   heartbeat, expires after the replica's TTL:
                                                       waiting, running, kv_usage (0..1),
                                                       prefix_hit_rate (0..1), block_size,
                                                       num_blocks, ttft_p90 (s, the replica's
                                                       requests of the last 30 s), ttft_buckets
                                                       (their cumulative counts at TTFT_BUCKETS
                                                       and +Inf, comma-separated), ts (unix s),
                                                       endpoints (JSON {"grpc": "h:p", ...}),
                                                       hash_model_id (seeds block hashes),
                                                       epoch, num_dropped_events, role
                                                       (prefill | decode | mixed), shared_tier
                                                       (the KV shared tier it mounts, or absent)
    pagoda:{model}:drain:{replica_id}           STRING present = draining: routers send it no
                                                       new requests (value: when it was set)
    pagoda:{model}:replica:{replica_id}:blocks  SET    block hashes (hex) the replica holds
    pagoda:{model}:replica:{replica_id}:seq     STRING "{epoch}:{seq}" of the last event applied
                                                       to the index for that replica
    pagoda:{model}:block:{block_hash}           SET    replica ids holding that block (and the
                                                       shared tiers' pseudo ids, below)
    pagoda:{model}:shared_tiers                 SET    pseudo replica ids ``~shared-{tier}`` of the KV
                                                       shared tiers that published blocks; each has
                                                       ``replica:{id}:blocks`` / ``:seq`` like a replica
    pagoda:{model}:events                       STREAM one entry per published batch: replica,
                                                       epoch, first_seq, last_seq, events (JSON
                                                       list of contract-3 event dicts, each with
                                                       its "seq"); trimmed to ~max entries
    pagoda:{model}:routed                       STREAM one entry per routing decision, shared by
                                                       the routers (routing-time affinity,
                                                       ``pagoda.fleet.routing.affinity``): router, replica,
                                                       ttl_ms, hashes (space-separated hex block
                                                       hashes of the prompt); trimmed to ~5k entries
    pagoda:{model}:response:{tenant}:{response_id}
                                                STRING a stored Responses API turn (JSON: its
                                                       conversation as chat messages), for
                                                       ``previous_response_id``; expires after the
                                                       router's --response-store-ttl

Invariants (kept by the atomic apply script in ``pagoda.fleet.index.prefix_index``):

- ``r in block:{h}``  <=>  ``h in replica:{r}:blocks`` (both sides change in one script).
- ``replica:{r}:seq`` names the last event of replica ``r`` reflected in the two sets
  above, and the stream entry carrying that event was appended by the same script; so a
  snapshot of (blocks, seq) plus the stream entries with a larger seq is the exact state.
- Sequence numbers are the *publisher's*: per replica and epoch they start at 0 and grow
  by one per event, resync events included. A new epoch (a restarted publisher) starts
  with ``AllBlocksCleared``.
- A heartbeat key that expired means the replica is gone; its index entries stay until
  ``ReplicaRegistry.reap_expired`` removes them (every router with Redis runs it
  periodically; it is idempotent, so several routers reaping at once is harmless), or
  ``remove_replica`` (the operator after a drain). Routers ignore matches on replicas
  without a heartbeat, so stale entries cost memory, not correctness.
- A KV shared tier (a directory several replicas mount; ``engine.kv.file_tier``) is indexed as
  the pseudo replica ``shared_tier_replica_id(tier)``: its blocks are loadable by every replica
  whose heartbeat names ``shared_tier``. It never heartbeats and is not in the registry, so the
  reaper never removes it; any replica mounting it adds to it (``PrefixIndex.apply_shared``:
  idempotent set adds, stream entries with epoch ``shared``).
- ``routed`` entries are hints with a TTL, never state: losing them (Redis restarted,
  trimmed) only costs routing-time affinity for the decisions of the last few seconds.
"""

from __future__ import annotations

PREFIX = "pagoda"

# Heartbeat hash fields (the operator's autoscaler reads waiting/running/kv_usage/ttft_*/ts).
HEARTBEAT_FIELDS = (
    "waiting", "running", "kv_usage", "prefix_hit_rate", "block_size", "num_blocks",
    "ttft_p90", "ttft_buckets", "ts", "endpoints", "hash_model_id", "epoch", "num_dropped_events",
)
SHARED_TIER_PREFIX = "~shared-"  # pseudo replica ids of shared tiers ("~" is never in a pod name)

# Upper bounds (s) of the heartbeat's TTFT buckets: those of vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


def encode_ttft_buckets(latencies) -> str:
    """Cumulative counts of ``latencies`` at each of ``TTFT_BUCKETS`` and +Inf, comma-separated."""
    values = sorted(latencies)
    counts, i = [], 0
    for bound in TTFT_BUCKETS:
        while i < len(values) and values[i] <= bound:
            i += 1
        counts.append(i)
    counts.append(len(values))
    return ",".join(map(str, counts))


def decode_ttft_buckets(text: str) -> dict[float, float]:
    """``{upper bound: cumulative count}`` (+Inf included) from ``encode_ttft_buckets``; {} if malformed."""
    try:
        counts = [float(c) for c in text.split(",")]
    except (AttributeError, ValueError):
        return {}
    if len(counts) != len(TTFT_BUCKETS) + 1:
        return {}
    return dict(zip((*TTFT_BUCKETS, float("inf")), counts))


def fleet_key(model: str, *parts: str) -> str:
    """The one key builder: ``pagoda:{model}:{part}:{part}...``.

    Raises:
        ValueError: an empty model name (every key must be namespaced by a model).
    """
    if not model:
        raise ValueError("model: the fleet key namespace needs a non-empty model name")
    return ":".join((PREFIX, model, *parts))


def check_replica_id(replica_id: str) -> str:
    """Returns ``replica_id``; raises ValueError if it is empty or holds ``:`` (a colon
    would let ``replica:{a}:blocks`` collide with the heartbeat of replica ``a:blocks``)."""
    if not replica_id or ":" in replica_id:
        raise ValueError(f"replica_id: must be non-empty and contain no ':', got {replica_id!r}")
    return replica_id


def namespace(model: str) -> str:
    """``pagoda:{model}``: every key of ``model`` starts with this plus ``:``."""
    return fleet_key(model)


def registry_key(model: str) -> str:
    return fleet_key(model, "replicas")


def heartbeat_key(model: str, replica_id: str) -> str:
    return fleet_key(model, "replica", check_replica_id(replica_id))


def drain_key(model: str, replica_id: str) -> str:
    return fleet_key(model, "drain", check_replica_id(replica_id))


def replica_blocks_key(model: str, replica_id: str) -> str:
    return fleet_key(model, "replica", check_replica_id(replica_id), "blocks")


def replica_seq_key(model: str, replica_id: str) -> str:
    return fleet_key(model, "replica", check_replica_id(replica_id), "seq")


def block_owners_key(model: str, block_hash: str) -> str:
    return fleet_key(model, "block", block_hash)


def block_owners_prefix(model: str) -> str:
    """``block_owners_key(model, h) == block_owners_prefix(model) + h`` (used by Lua)."""
    return block_owners_key(model, "")


def events_stream_key(model: str) -> str:
    return fleet_key(model, "events")


def routed_stream_key(model: str) -> str:
    return fleet_key(model, "routed")


def response_key(model: str, tenant: str, response_id: str) -> str:
    """A stored Responses API turn, under its tenant (``""``: the open mode's one tenant): one
    tenant's key never names another's response."""
    return fleet_key(model, "response", tenant or "-", response_id)


def shared_tiers_key(model: str) -> str:
    return fleet_key(model, "shared_tiers")


def shared_tier_replica_id(tier_id: str) -> str:
    """The index's pseudo replica id of the KV shared tier ``tier_id`` (module docstring)."""
    if not tier_id or ":" in tier_id:
        raise ValueError(f"shared tier id: must be non-empty and contain no ':', got {tier_id!r}")
    return SHARED_TIER_PREFIX + tier_id


def shared_tier_of(replica_id: str) -> str:
    """The tier id of a shared tier's pseudo replica id; ``""`` for a real replica's id."""
    return replica_id[len(SHARED_TIER_PREFIX):] if replica_id.startswith(SHARED_TIER_PREFIX) else ""
