"""Redis key names the operator reads (heartbeats) and writes (drain flag, index cleanup).

The layout is defined once, in ``pagoda.contracts.redis_keys`` (ARCHITECTURE contract 4; see its
docstring for every key and type); this module re-exports the builders the operator uses.
"""

from __future__ import annotations

from pagoda.contracts.redis_keys import (  # noqa: F401 - re-exported for the operator
    HEARTBEAT_FIELDS,
    PREFIX,
    TTFT_BUCKETS,
    block_owners_key,
    decode_ttft_buckets,
    drain_key,
    fleet_key,
    heartbeat_key,
    registry_key,
    replica_blocks_key,
)
