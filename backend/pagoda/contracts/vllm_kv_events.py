"""vLLM's KV-event wire format, so that fleets built for vLLM can route pagoda by cache.

llm-d's precise prefix scorer, Dynamo's KV router and AIBrix's KV sync subscribe to a
vLLM replica's ZMQ PUB socket and decode msgpack ``KVEventBatch`` es with msgspec. This
module is that format, tracking **vLLM 0.32.0** (``vllm/distributed/kv_events.py`` and
``vllm/v1/core/block_pool.py``); a golden byte string made with vLLM 0.32.0's own classes
is pinned in ``tests/serving/test_kv_event_stream.py``.

The shape, as vLLM 0.32.0 writes it:

- A batch is a msgspec *array*: ``[ts, [event, ...], data_parallel_rank]`` (one batch per
  engine step that changed the cache; pagoda's rank is 0).
- An event is a msgspec *map* tagged ``"type": "BlockStored" | "BlockRemoved" |
  "AllBlocksCleared"``, its fields in declaration order; fields whose default is ``None``
  are left out while ``None``, the others are always written.
- Block hashes are the low 64 bits of the 32-byte hash, read big-endian (vLLM's default,
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``). pagoda's hashes are its own SHA-256 chain
  (``contracts.block_hash``), so consumers that key blocks by the engine's hash work; those
  that recompute vLLM's hash from ``token_ids`` (llm-d) key by tokens and parent, which
  pagoda gives exactly.
- ``extra_keys`` has one entry per stored block: the LoRA name (when the request has an
  adapter), then the content hash of each image the block overlaps (vLLM's ``mm_hash`` keys),
  then the cache salt on the first block of a sequence only (vLLM hashes the salt into the
  first block and lets the chain carry it), or ``None`` when empty.
- ``lora_id`` (deprecated in vLLM, kept for old consumers) is ``lora_int_id(name)``: a
  stable 31-bit number from the adapter name, since pagoda names adapters and does not
  number them. ``group_idx`` is the event's KV cache group (0 for a single-group model);
  in a multi-group model (``engine.kv.layout``) ``BlockStored`` also writes its group's
  ``kv_cache_spec_kind`` (``full_attention``, ``sliding_window`` with
  ``kv_cache_spec_sliding_window``, ``mamba``), as vLLM does for its hybrid models;
  ``medium`` is the event's (``"GPU"``: vLLM's word for the device tier, on a CPU too;
  ``"DISK"`` / ``"SHARED"``: pagoda's file tiers).

Fields that vLLM 0.32.0 added and pagoda has no value for (``locality``, ``ownership``,
``session_id``) are declared so decoding vLLM's own batches works, and never written.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence, Union

import msgspec

from pagoda.contracts import kv_events as pagoda_events

VLLM_FORMAT_VERSION = "0.32.0"
MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-replay sequence number

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to a replica's prefix cache (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


VLLMEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def external_block_hash(block_hash: Union[str, bytes]) -> int:
    """vLLM's integer form of a block hash (hex string or bytes): its low 64 bits, big-endian."""
    raw = bytes.fromhex(block_hash) if isinstance(block_hash, str) else block_hash
    return int.from_bytes(raw, "big") & ((1 << 64) - 1)


def lora_int_id(lora_name: Optional[str]) -> Optional[int]:
    """A stable positive 31-bit id for an adapter name (``None`` for the base model)."""
    if lora_name is None:
        return None
    return int.from_bytes(hashlib.sha256(lora_name.encode("utf-8")).digest()[:4], "big") & 0x7FFFFFFF


def _extra_keys(event: pagoda_events.BlockStored) -> list[Optional[tuple[Any, ...]]]:
    keys: list[Optional[tuple[Any, ...]]] = []
    for i in range(len(event.block_hashes)):
        parts: list[Any] = [] if event.lora_name is None else [event.lora_name]
        if event.mm_keys is not None:
            parts += [mm_hash for mm_hash, _ in event.mm_keys[i]]
        if i == 0 and event.parent_block_hash is None and event.cache_salt:
            parts.append(event.cache_salt)
        keys.append(tuple(parts) if parts else None)
    return keys


def to_vllm_event(event: pagoda_events.BlockEvent) -> VLLMEvent:
    """One pagoda block event in vLLM's shape."""
    if isinstance(event, pagoda_events.BlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=[external_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else external_block_hash(parent),
            token_ids=list(event.token_ids), block_size=event.block_size,
            lora_id=lora_int_id(event.lora_name), medium=event.medium, lora_name=event.lora_name,
            extra_keys=_extra_keys(event), group_idx=event.group_idx, kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.sliding_window)
    if isinstance(event, pagoda_events.BlockRemoved):
        return BlockRemoved(block_hashes=[external_block_hash(h) for h in event.block_hashes],
                            medium=event.medium, group_idx=event.group_idx)
    if isinstance(event, pagoda_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a block event: {type(event).__name__}")


def make_batch(events: Sequence[pagoda_events.KVEvent], ts: float, data_parallel_rank: int = 0) -> KVEventBatch:
    """One step's pagoda events as a vLLM batch (in emission order)."""
    return KVEventBatch(ts=ts, events=[to_vllm_event(e.event) for e in events], data_parallel_rank=data_parallel_rank)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload (pagoda's or vLLM's); raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _DECODER.decode(payload)
