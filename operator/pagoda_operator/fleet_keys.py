"""Redis key names the operator reads (heartbeats) and writes (drain flag, index cleanup).

ASSUMPTION, until the fleet layer's keys module (ARCHITECTURE contract 4) lands: that
module owns the real names; every name here comes from `fleet_key`, so repointing the
operator is a one-function change (or an import of the fleet module's builder).

    pagoda:{model}:replicas                      SET   replica ids (the registry)
    pagoda:{model}:replica:{replica_id}          HASH  heartbeat: waiting, running,
                                                       kv_usage (0..1), ttft_p90 (s),
                                                       ts (unix seconds)
    pagoda:{model}:drain:{replica_id}            STR   present = router must not pick it
    pagoda:{model}:replica:{replica_id}:blocks   SET   block hashes this replica holds
    pagoda:{model}:block:{block_hash}            SET   replica ids holding that block

`replica_id` is the replica's pod name (`PAGODA_REPLICA_ID`, see render_replicas.py).
"""

from __future__ import annotations

PREFIX = "pagoda"

HEARTBEAT_FIELDS = ("waiting", "running", "kv_usage", "ttft_p90", "ts")


def fleet_key(model: str, *parts: str) -> str:
    """The one key builder: `pagoda:{model}:{part}:{part}...`."""
    return ":".join((PREFIX, model, *parts))


def registry_key(model: str) -> str:
    return fleet_key(model, "replicas")


def heartbeat_key(model: str, replica_id: str) -> str:
    return fleet_key(model, "replica", replica_id)


def drain_key(model: str, replica_id: str) -> str:
    return fleet_key(model, "drain", replica_id)


def replica_blocks_key(model: str, replica_id: str) -> str:
    return fleet_key(model, "replica", replica_id, "blocks")


def block_owners_key(model: str, block_hash: str) -> str:
    return fleet_key(model, "block", block_hash)
