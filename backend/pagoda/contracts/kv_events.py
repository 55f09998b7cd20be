"""KV-cache block events: what a replica tells the fleet layer about its prefix cache.

Three events, shaped like vLLM's KV events so external indexers can consume them:

- ``BlockStored``: full blocks became reusable (their hashes entered the block pool's
  hash map). ``block_hashes`` are in chain order; ``parent_block_hash`` is the hash of
  the block before the first one (``None`` when the first one starts a sequence). It
  carries the request's adapter name and cache salt for the vLLM-format stream
  (``contracts.vllm_kv_events``); the Redis form (``to_dict``) leaves the salt out.
- ``BlockRemoved``: blocks left the hash map (evicted for reuse).

KV cache groups (``engine.kv.layout``: a model whose layers keep different caches, e.g.
sliding-window and full attention, or recurrent states) cache the same hashes once per
group: every event names its ``group_idx`` (0 for a single-group model) and, in a
multi-group model, its group's ``kv_cache_spec_kind`` (vLLM's words: ``full_attention``,
``sliding_window`` with ``sliding_window`` tokens, ``mamba``). The Redis form writes
``group_idx`` only when it is not 0, and the fleet's index keys group 0 (whose blocks
cover every position: the routing signal); the vLLM stream carries every group.
- ``AllBlocksCleared``: the whole prefix cache was reset.

Storage medium (vLLM's ``medium`` field): ``"GPU"`` for the device tier (on a CPU too, as
vLLM names it), ``"DISK"`` for a replica's disk tier and ``"SHARED"`` for the shared tier
that several replicas mount (``engine.kv.file_tier``): those are emitted when a block file
is written (and, for the disk tier, ``BlockRemoved`` when the file is evicted or refused).
A file-tier ``BlockStored`` has ``parent_block_hash`` null: the file tier keeps no chain,
so there it does not mean "starts a sequence" (each block hash names its whole prefix
anyway). The fleet's Redis index keys device blocks only (``fleet.index.publisher``).

Hashes travel as lowercase hex strings (``BlockHash.hex()``). Every event is wrapped in a
``KVEvent`` carrying a per-replica sequence number that increases by one per event, so a
consumer that sees a gap knows it missed events and must resync.

``KVEventBuffer`` holds events between the engine loop (which emits) and the publisher
thread (which takes). It is bounded: past ``max_events`` the oldest are dropped and
counted in ``num_dropped``; the sequence numbers still reveal the gap. It is thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

MEDIUM = "GPU"  # vLLM's field for the storage tier: the device tier
MEDIA = (MEDIUM, "DISK", "SHARED")  # the device, a replica's disk tier, the replicas' shared tier


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[str]
    parent_block_hash: Optional[str]
    token_ids: list[int]  # every token of the stored blocks, concatenated
    block_size: int
    lora_id: Optional[int] = None
    lora_name: Optional[str] = None  # the request's adapter (part of every block's hash)
    cache_salt: Optional[str] = None  # the request's tenant salt (likewise); never in ``to_dict``
    group_idx: int = 0  # the KV cache group whose hash map took the blocks
    kv_cache_spec_kind: Optional[str] = None  # the group's kind (multi-group layouts only)
    sliding_window: Optional[int] = None  # the group's window, for kind "sliding_window"
    # Per stored block, the (image content hash, offset) of each image it overlaps (part of its
    # hash, contracts.block_hash's "mm"); None when no block overlaps an image. Never in ``to_dict``.
    mm_keys: Optional[list[tuple[tuple[str, int], ...]]] = None
    medium: str = MEDIUM  # one of MEDIA

    def to_dict(self) -> dict[str, Any]:
        out = {
            "type": "BlockStored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
        }
        return _with_group(out, self.group_idx)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[str]
    group_idx: int = 0
    medium: str = MEDIUM  # one of MEDIA

    def to_dict(self) -> dict[str, Any]:
        return _with_group({"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium},
                           self.group_idx)


def _with_group(event: dict[str, Any], group_idx: int) -> dict[str, Any]:
    if group_idx:  # single-group replicas keep the form consumers already parse
        event["group_idx"] = group_idx
    return event


@dataclass(frozen=True)
class AllBlocksCleared:
    def to_dict(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


BlockEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEvent:
    """One event with its per-replica sequence number and emission time (seconds)."""

    seq: int
    timestamp: float
    event: BlockEvent

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the event's fields plus ``seq`` and ``ts``."""
        return {"seq": self.seq, "ts": self.timestamp, **self.event.to_dict()}


@dataclass
class KVEventBuffer:
    """Bounded, thread-safe FIFO of ``KVEvent``s; the oldest drop past ``max_events``.

    Args:
        max_events: how many events are retained before the oldest drop.
        clock: seconds since the epoch; injected so tests never depend on wall time.
    """

    max_events: int = 100_000
    clock: Callable[[], float] = time.time
    num_dropped: int = 0
    next_seq: int = 0  # the seq the next emitted event gets
    _events: deque = field(default_factory=deque, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.max_events < 1:
            raise ValueError(f"max_events: must be >= 1, got {self.max_events}")

    def emit(self, event: BlockEvent) -> KVEvent:
        """Append ``event`` with the next sequence number; returns the wrapped event."""
        with self._lock:
            wrapped = KVEvent(self.next_seq, self.clock(), event)
            self.next_seq += 1
            self._events.append(wrapped)
            if len(self._events) > self.max_events:
                self._events.popleft()
                self.num_dropped += 1
            return wrapped

    def take(self) -> list[KVEvent]:
        """Return every retained event, oldest first, and clear the buffer."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
            return events

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
