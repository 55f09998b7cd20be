"""What a transfer offers and how the receiver checks it (pure Python, no torch).

An offer names a contiguous run of full blocks by their chained block hashes
(``contracts.block_hash``) plus each block's token ids, the hash of the block before the
run (``None``: the run starts at the request's first block, under the model's root hash),
the request's extra keys (cache salt, adapter) and the sender's KV layout.

The receiver recomputes the whole chain from the parent (or from *its own* model's root
hash) and refuses the offer unless every hash matches: so a received block is entered in
the prefix cache only under the hash the receiver would have computed itself, and two
replicas of different models, block sizes or KV layouts never exchange blocks.

Blocks that overlap an image are hashed with the image's content (``mm`` extra keys), which
an offer does not carry: their recomputed hashes never match, so such an offer is refused
here, and replicas refuse image prompts with ``kv_transfer_params`` before any transfer
(``serving.kv_transfer_control``).

``has_state`` (a hybrid model's offer, ``connector.check_layout``): the recurrent-state
checkpoint at the run's last block boundary comes too, as payload index ``len(block_hashes)``
(``state_bytes`` of the layout long); the receiver enters it in its state group under the
run's last hash, so a request with that prefix hits in every group.

``nixl`` (optional): where the sender's blocks lie in its NIXL-registered KV memory
(``nixl_memory.NixlKVMemory.describe``); a receiver that speaks NIXL reads them itself, any
other receiver ignores it and the blocks come as CHUNKs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pagoda.contracts.block_hash import BlockHash, hash_prompt_blocks
from pagoda.engine.kv_transfer.wire import PROTOCOL_VERSION


@dataclass(frozen=True)
class Offer:
    transfer_id: str
    model_id: str
    block_size: int
    layout: dict
    block_hashes: list[BlockHash]
    token_ids: list[list[int]]
    parent_block_hash: Optional[BlockHash] = None
    cache_salt: Optional[str] = None
    adapter_id: Optional[str] = None
    nixl: Optional[dict] = None
    has_state: bool = False

    def payload_bytes(self, index: int) -> int:
        """Bytes of payload ``index``: a block, or (past the blocks) the state checkpoint."""
        return int(self.layout["state_bytes"] if index == len(self.block_hashes) else self.layout["block_bytes"])

    @property
    def num_payloads(self) -> int:
        return len(self.block_hashes) + (1 if self.has_state else 0)

    def to_json(self) -> dict:
        obj = {"version": PROTOCOL_VERSION, "transfer_id": self.transfer_id, "model_id": self.model_id,
               "block_size": self.block_size, "layout": self.layout,
               "block_hashes": [h.hex() for h in self.block_hashes], "token_ids": self.token_ids,
               "parent_block_hash": self.parent_block_hash.hex() if self.parent_block_hash else None,
               "cache_salt": self.cache_salt, "adapter_id": self.adapter_id}
        if self.nixl is not None:
            obj["nixl"] = self.nixl
        if self.has_state:
            obj["has_state"] = True
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Offer":
        """Raises ValueError naming the first missing or malformed field."""
        if obj.get("version") != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {obj.get('version')!r}; this replica speaks {PROTOCOL_VERSION}")
        try:
            parent = obj.get("parent_block_hash")
            return cls(transfer_id=str(obj["transfer_id"]), model_id=str(obj["model_id"]),
                       block_size=int(obj["block_size"]), layout=dict(obj["layout"]),
                       block_hashes=[BlockHash(bytes.fromhex(h)) for h in obj["block_hashes"]],
                       token_ids=[[int(t) for t in block] for block in obj["token_ids"]],
                       parent_block_hash=BlockHash(bytes.fromhex(parent)) if parent else None,
                       cache_salt=obj.get("cache_salt"), adapter_id=obj.get("adapter_id"),
                       nixl=dict(obj["nixl"]) if obj.get("nixl") is not None else None,
                       has_state=bool(obj.get("has_state", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed OFFER: {type(e).__name__}: {e}") from None


def check_offer(offer: Offer, model_id: str, block_size: int, layout: dict) -> Optional[str]:
    """Why the receiver must refuse ``offer`` (a message naming the mismatch), or None."""
    if offer.block_size != block_size:
        return f"block_size {offer.block_size} differs from this replica's {block_size}"
    if offer.layout != layout:
        return f"KV layout {offer.layout} differs from this replica's {layout}"
    if not offer.block_hashes or len(offer.block_hashes) != len(offer.token_ids):
        return f"{len(offer.block_hashes)} block hashes for {len(offer.token_ids)} token blocks"
    if offer.has_state and "state_bytes" not in layout:
        return "the offer carries a recurrent state and this replica's model keeps none"
    if any(len(block) != block_size for block in offer.token_ids):
        return f"every offered block must hold exactly {block_size} tokens"
    tokens = [t for block in offer.token_ids for t in block]
    expected = hash_prompt_blocks(tokens, block_size, model_id, offer.cache_salt, offer.adapter_id,
                                  parent=offer.parent_block_hash)
    for i, (got, want) in enumerate(zip(offer.block_hashes, expected)):
        if got != want:
            return (f"block {i}'s hash {got.hex()[:16]}... is not this replica's hash of its tokens "
                    f"({want.hex()[:16]}...; model_id {model_id!r})")
    return None


def contiguous_runs(indices: Sequence[int]) -> list[list[int]]:
    """``[0, 1, 3, 4, 6]`` -> ``[[0, 1], [3, 4], [6]]`` (indices ascending)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
