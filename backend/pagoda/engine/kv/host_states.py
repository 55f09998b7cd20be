"""The CPU tier's recurrent-state slots: swapped requests' states and evicted state checkpoints.

A hybrid model (``kv.state_manager``) keeps, beside its paged blocks, one fixed-size state per
sequence. The CPU tier (``kv.host_tier``) gives such states ``num_slots`` host state slots, one
pool (a ``HostBlockPool``: reference counts, LRU free queue, hash map) serving two uses:

1. **Swap.** A request preempted by swap copies its working slot device -> host into a slot it
   owns (``ref_cnt`` 1, never hashed) and gets it back, into a new working slot, when it is
   readmitted; the host slot is free again once that step's copies are taken.
2. **Prefix tier.** When the device state pool evicts a checkpoint (the state after the block
   ending at position ``p`` of a cached prefix, keyed by that block's hash), it is copied to a
   host slot under the same hash instead of being dropped (``on_device_evict``), cached but
   free in LRU order. A waiting request whose group-0 prefix (device blocks, then host blocks)
   reaches a host checkpoint at ``p`` (``find_checkpoint``, right to left as on the device)
   resumes there: its new working slot is filled host -> device before its first forward
   (``restore``), and it starts at ``p`` instead of recomputing the prefix.

Copies of one step: every device -> host copy runs before every host -> device copy, both
before the forward (``runner.host_kv_cache``), so a device slot evicted and handed out again
in the same step is read before its new owner writes it, and a host slot stored this step
may be restored in the same step. Host slots read this step are pinned until the copies are
taken; a host slot stored twice in one step keeps only the last pair. A decode checkpoint
the device forgets (``BlockPool.uncache``) is not offered here: it is superseded, not evicted.
No torch.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagoda.contracts.block_hash import BlockHash
from pagoda.engine.kv.block_pool import KVCacheBlock

BlockPairs = list[tuple[int, int]]  # (src slot id, dst slot id)


class HostStates:
    """Args:
    pool: the host state slots (a ``kv.host_tier.HostBlockPool``), or None for none.
    block_size: tokens per block (checkpoints sit at block boundaries).
    enable_prefix_tier: keep checkpoints evicted from the device.
    """

    def __init__(self, pool, block_size: int, enable_prefix_tier: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_tier = enable_prefix_tier and pool is not None
        self.req_to_slot: dict[str, KVCacheBlock] = {}
        self._out: dict[int, int] = {}  # host dst -> device src (a destination is written once)
        self._in: list[tuple[int, int]] = []  # (host src, device dst)
        self._pinned: list[KVCacheBlock] = []  # host slots read this step
        self.num_offloaded = 0  # device checkpoints evicted and copied here
        self.num_restored = 0  # requests that resumed a host checkpoint
        self.num_restored_tokens = 0

    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks if self.pool is not None else 0

    @property
    def num_free_slots(self) -> int:
        return self.pool.num_free_blocks if self.pool is not None else 0

    # Swap ------------------------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether a swap can take a host slot now (a cached checkpoint may be evicted for it)."""
        return self.num_free_slots > 0

    def swap_out(self, request_id: str, device_slot: int) -> None:
        """Record the device -> host copy of a victim's working slot (``has_room`` checked)."""
        slot = self.pool.allocate(1)
        assert slot is not None, "swap_out of a state without a free host slot"
        self.req_to_slot[request_id] = slot[0]
        self._out[slot[0].block_id] = device_slot

    def swap_in(self, request_id: str, device_slot: int) -> bool:
        """Record the host -> device copy of a swapped request's state (False: it has none);
        its host slot is released when the step's copies are taken."""
        slot = self.req_to_slot.pop(request_id, None)
        if slot is None:
            return False
        assert device_slot, "swap-in of a state needs a device state slot"
        self._in.append((slot.block_id, device_slot))
        self._pinned.append(slot)  # already referenced once
        return True

    def free_request(self, request_id: str) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self.pool.free([slot])

    # Prefix tier -----------------------------------------------------------------------

    def on_device_evict(self, slot: KVCacheBlock) -> None:
        """The device state pool's ``on_evict`` hook: a checkpoint is about to lose its hash."""
        if not self.enable_prefix_tier:
            return
        host_slot = self.pool.store_cached(slot.block_hash, slot.token_ids)
        if host_slot is not None:
            self._out[host_slot.block_id] = slot.block_id
            self.num_offloaded += 1

    def find_checkpoint(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int,
                        end: int) -> tuple[int, Optional[KVCacheBlock]]:
        """The last host checkpoint at a block boundary ``p`` with ``start < p / block_size <= end``.

        Returns:
            (``p / block_size``, its host slot), or (0, None) when there is none.
        """
        if not self.enable_prefix_tier:
            return 0, None
        size = self.block_size
        for i in range(min(end, len(block_hashes)) - 1, start - 1, -1):
            slot = self.pool.get_cached_block(block_hashes[i])
            if slot is not None and list(slot.token_ids) == list(token_ids[i * size:(i + 1) * size]):
                return i + 1, slot
        return 0, None

    def pin(self, slot: Optional[KVCacheBlock]) -> None:
        if slot is not None:
            self.pool.touch([slot])

    def unpin(self, slot: Optional[KVCacheBlock]) -> None:
        if slot is not None:
            self.pool.free([slot])

    def restore(self, slot: KVCacheBlock, device_slot: int, num_tokens: int) -> None:
        """Record the host -> device copy of a pinned checkpoint into a new working slot, for a
        request resuming at ``num_tokens``; unpinned when the step's copies are taken."""
        assert device_slot, "a restored state needs a device working slot"
        self._in.append((slot.block_id, device_slot))
        self._pinned.append(slot)
        self.num_restored += 1
        self.num_restored_tokens += num_tokens

    # Step boundary ---------------------------------------------------------------------

    def take_copies(self) -> tuple[BlockPairs, BlockPairs]:
        """This step's (device -> host, host -> device) slot copies as (src, dst); releases the
        host slots read this step."""
        out = [(src, dst) for dst, src in self._out.items()]
        pairs_in, pinned = self._in, self._pinned
        self._out, self._in, self._pinned = {}, [], []
        if pinned:
            self.pool.free(pinned)
        return out, pairs_in

    def reset_prefix_cache(self) -> None:
        if self.pool is not None:
            self.pool.reset_prefix_cache()
