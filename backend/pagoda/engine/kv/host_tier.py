"""The CPU tier of the KV cache: host block bookkeeping and the swap-vs-recompute model.

Pure Python (no torch): the scheduler decides here, ``pagoda.engine.runner.host_kv_cache`` moves
the bytes. Two uses share one pool of ``num_host_blocks`` host blocks:

1. **Preemption by swap.** A preempted request's blocks covering its
   ``num_computed_tokens`` are copied device -> host into blocks the request owns
   (``ref_cnt`` 1, never hashed); the request keeps ``num_computed_tokens`` and waits
   *swapped out* (``is_swapped_out``). When rescheduled, fresh device blocks are
   allocated and filled host -> device, and its host blocks are freed.
2. **Prefix tier.** When the device pool evicts a cached full block (``BlockPool``'s
   eviction path, ``on_evict``), its contents are copied to a host block keyed by the
   same block hash instead of being dropped. A waiting request whose device prefix hit
   stops at block ``i`` continues the lookup here (``lookup_prefix``): host hits get new
   device blocks filled host -> device ("copy back") and count as computed.

KV cache groups (``kv.layout``): a swap moves every group's live blocks (a sliding
window's out-of-window blocks are freed first, so only the window travels) as one list,
plus the request's recurrent-state slot into one of ``num_host_state_slots`` host state
slots (``states_to_swap_out`` / ``states_to_swap_in`` pairs; ``kv.host_states``). The prefix
tier keeps group 0's blocks, and only for layouts with one paged group (the scheduler turns
it off otherwise, naming why: a sliding-window group's hit needs its window's blocks beside
group 0's, which the host tier does not track). A state group's evicted checkpoints go to the
host state slots too (``kv.host_states``), so a hybrid's prefix evicted from the device comes
back whole: group 0's blocks and the state at the boundary where they end
(``KVCacheManager.usable_loaded_blocks`` picks the last checkpoint, device or host).

Host blocks reuse ``KVCacheBlock``/``FreeBlockQueue``: a host block is in use
(``ref_cnt > 0``: owned by a swapped request, or pinned while a copy reads it this
step) or free in LRU order; a free block may still hold a cached hash. Unlike the
device pool there is no null block: host ids are ``0 .. num_host_blocks - 1``.

Copies of one step are ordered: every device -> host copy (``blocks_to_swap_out``)
runs before every host -> device copy (``blocks_to_swap_in``, ``blocks_to_copy_back``),
all before the forward pass. Sources are therefore read before anything of this step
overwrites them. Host blocks read this step are pinned until ``schedule()`` ends, so a
later eviction in the same step cannot reuse them; a host block stored twice in one
step keeps only the last pair (``index_copy`` needs unique destinations).

Block events: only the device tier is advertised (ARCHITECTURE contract 3 unchanged:
``BlockRemoved`` when a block leaves the device, even if it moves to the CPU tier).
Host-tier blocks emit no events: the fleet index has no notion of a storage medium, and
a replica that advertised CPU blocks as ``medium: "GPU"`` would overstate its hits.

Whether a preempted request swaps or recomputes is ``kv.swap_cost.SwapCostModel``'s
prediction (``wants_swap``).

File tiers (``kv.file_tier``, optional): a block entering the prefix side is also written
to the disk and shared tiers (write-through, on the runner's writer thread), and a lookup
that runs past the host blocks continues there, loading verified blocks into host blocks
(``FileTiers.promote``); a host block reused within the step cancels its pending file I/O.

The scheduler holds a ``HostTier`` either way: ``KVOffloadManager`` when the tier exists,
``NoHostTier`` (answers "nothing swapped, nothing cached, no copies") when it does not,
so no scheduler path asks whether the tier is on.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from pagoda.contracts.block_hash import BlockHash
from pagoda.engine.kv.block_pool import FreeBlockQueue, KVCacheBlock
from pagoda.engine.kv.file_tier import FileTiers
from pagoda.engine.kv.host_states import HostStates
from pagoda.engine.kv.swap_cost import SwapCostModel
from pagoda.engine.config import PREEMPTION_MODES

BlockPairs = list[tuple[int, int]]  # (src block id, dst block id)


class HostBlockPool:
    """``num_blocks`` host blocks: reference counts, LRU free queue, hash map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_host_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.on_reuse: Optional[Callable[[int], None]] = None  # file tiers: the block's pending I/O is void

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def pop_free(self) -> KVCacheBlock:
        """The least recently freed block with ``ref_cnt`` 0, its old hash evicted."""
        block = self.free_block_queue.popleft()
        if self.on_reuse is not None:
            self.on_reuse(block.block_id)
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        return block

    def allocate(self, num_blocks: int) -> Optional[list[KVCacheBlock]]:
        """``num_blocks`` blocks with ``ref_cnt`` 1, or None (nothing changes) if too few are free."""
        if num_blocks > self.num_free_blocks:
            return None
        blocks = [self.pop_free() for _ in range(num_blocks)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            assert block.ref_cnt > 0, f"host {block}: reference count would go negative"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def store_cached(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> Optional[KVCacheBlock]:
        """Enter a block evicted from the device under its hash.

        Returns:
            The host block to copy into, or None when no copy is needed (the hash is
            already here; it becomes most recently used) or possible (every block in use).
        """
        existing = self.cached_block_hash_to_block.get(block_hash)
        if existing is not None:
            if existing.ref_cnt == 0:  # refresh its LRU position
                self.free_block_queue.remove(existing)
                self.free_block_queue.append(existing)
            return None
        if self.num_free_blocks == 0:
            return None
        block = self.pop_free()
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached_block_hash_to_block[block_hash] = block
        self.free_block_queue.append(block)  # cached but free: evictable in LRU order
        return block

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def reset_prefix_cache(self) -> None:
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            block.token_ids = ()
        self.cached_block_hash_to_block.clear()


class KVOffloadManager:
    """Scheduler-side state of the CPU tier: host block tables, pending copies, counters.

    Args:
        num_host_blocks: size of the host pool.
        block_size: tokens per block.
        preemption_mode: ``auto`` (cost model), ``recompute`` (never swap) or ``swap``
            (swap whenever the host pool has room).
        cost_model: required to swap in ``auto`` mode; without it ``auto`` recomputes.
        enable_prefix_tier: keep blocks evicted from the device (prefix caching on).
        file_tiers: the disk and shared tiers below (``kv.file_tier``), prefix tier only.
    """

    is_enabled = True

    def __init__(self, num_host_blocks: int, block_size: int, preemption_mode: str = "auto",
                 cost_model: Optional[SwapCostModel] = None, enable_prefix_tier: bool = True,
                 num_host_state_slots: int = 0, file_tiers: Optional[FileTiers] = None) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.pool = HostBlockPool(num_host_blocks)
        self.states = HostStates(HostBlockPool(num_host_state_slots) if num_host_state_slots > 0 else None,
                                 block_size, enable_prefix_tier)
        self.block_size = block_size
        self.preemption_mode = preemption_mode
        self.cost_model = cost_model
        self.enable_prefix_tier = enable_prefix_tier
        self.file_tiers = file_tiers if enable_prefix_tier else None
        if self.file_tiers is not None:
            self.pool.on_reuse = self.file_tiers.cancel
        self.req_to_host_blocks: dict[str, list[KVCacheBlock]] = {}
        # This step's copies. Keyed by destination so a destination is written once.
        self._swap_out: dict[int, int] = {}  # host dst -> device src
        # device dst -> (host src, is a swap-in); one dict so a device block reallocated
        # within the step is written once, by its last owner.
        self._to_device: dict[int, tuple[int, bool]] = {}
        self._pinned: list[KVCacheBlock] = []  # host blocks read this step; released in take_copies
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_offloaded_blocks = 0  # device evictions copied to the host tier
        self.prefix_cache_hits_host = 0  # tokens, of admitted requests

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # Preemption ----------------------------------------------------------------------

    def is_swapped_out(self, request_id: str) -> bool:
        return request_id in self.req_to_host_blocks

    def wants_swap(self, num_tokens: int, num_blocks: int) -> bool:
        """Whether a victim with ``num_tokens`` computed tokens in ``num_blocks`` should swap."""
        if num_tokens == 0 or self.preemption_mode == "recompute":
            return False
        if self.preemption_mode == "swap":
            return True
        return self.cost_model is not None and self.cost_model.prefers_swap(num_tokens, num_blocks)

    def swap_out(self, request_id: str, device_block_ids: Sequence[int], state_slot: int = 0) -> bool:
        """Record device -> host copies of a victim's blocks (and of its state slot, when not 0).
        False (nothing changes) if the host pool is too full."""
        assert request_id not in self.req_to_host_blocks, f"{request_id!r} is already swapped out"
        if state_slot and not self.states.has_room():
            return False
        host_blocks = self.pool.allocate(len(device_block_ids))
        if host_blocks is None:
            return False
        for device_id, host_block in zip(device_block_ids, host_blocks):
            self._swap_out[host_block.block_id] = device_id
        self.req_to_host_blocks[request_id] = host_blocks
        if state_slot:
            self.states.swap_out(request_id, state_slot)
        self.num_swapped_out += 1
        return True

    def swap_in(self, request_id: str, device_block_ids: Sequence[int], state_slot: int = 0) -> None:
        """Record host -> device copies into the first blocks of ``device_block_ids`` (and into
        ``state_slot``); the host blocks are freed when this step's copies are taken."""
        host_blocks = self.req_to_host_blocks.pop(request_id)
        assert len(device_block_ids) >= len(host_blocks), "swap-in needs a device block per host block"
        for host_block, device_id in zip(host_blocks, device_block_ids):
            self._to_device[device_id] = (host_block.block_id, True)
        self._pinned.extend(host_blocks)  # already referenced once: released in take_copies
        self.states.swap_in(request_id, state_slot)  # its host slot is free again once copies are taken
        self.num_swapped_in += 1

    def free_request(self, request_id: str) -> None:
        """Drop a swapped-out request's host blocks (it finished or was aborted while waiting)."""
        host_blocks = self.req_to_host_blocks.pop(request_id, None)
        if host_blocks:
            self.pool.free(host_blocks)
        self.states.free_request(request_id)

    # Prefix tier ---------------------------------------------------------------------

    def on_device_evict(self, block: KVCacheBlock) -> None:
        """``BlockPool.on_evict`` hook: a cached device block is about to lose its hash (and, with
        ``kv_write_through``, ``on_free_cached``: its last request freed it; it stays cached on the
        device, and the copy runs before the device block can be reused, as for an eviction)."""
        if not self.enable_prefix_tier or block.group_idx != 0:
            return
        host_block = self.pool.store_cached(block.block_hash, block.token_ids)
        if host_block is not None:
            self._swap_out[host_block.block_id] = block.block_id
            self.num_offloaded_blocks += 1
            if self.file_tiers is not None:  # write-through: the files get what the CPU tier gets
                self.file_tiers.record_write(host_block.block_id, block.block_hash, block.token_ids)

    def lookup_prefix(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int,
                      max_blocks: int) -> list[KVCacheBlock]:
        """Host blocks continuing a device prefix hit of ``start`` blocks. Pure, but where the
        file tiers continue the hit: their blocks are loaded into host blocks (promoted) this step.

        Args:
            block_hashes: the request's block hashes.
            token_ids: the request's tokens (compared on a hit, like the device tier).
            start: blocks already hit on the device.
            max_blocks: the cap on the whole hit (the last token is always computed).
        """
        if not self.enable_prefix_tier:
            return []
        size = self.block_size
        hit = []
        end = min(max_blocks, len(block_hashes))
        for i in range(start, end):
            block = self.pool.get_cached_block(block_hashes[i])
            if block is None or list(block.token_ids) != list(token_ids[i * size : (i + 1) * size]):
                break
            hit.append(block)
        if self.file_tiers is not None and start + len(hit) < end:
            found = list(hit)
            self.pool.touch(found)  # promotions must not evict the hit found so far
            hit += self.file_tiers.promote(self.pool, block_hashes, token_ids, start + len(found), end)
            self.pool.free(found)
        return hit

    def pin(self, host_blocks: Sequence[KVCacheBlock]) -> None:
        """Keep ``host_blocks`` from reuse while the scheduler tries to admit their request."""
        self.pool.touch(host_blocks)

    def unpin(self, host_blocks: Sequence[KVCacheBlock]) -> None:
        self.pool.free(host_blocks)

    def copy_back(self, host_blocks: Sequence[KVCacheBlock], device_block_ids: Sequence[int]) -> None:
        """Record host -> device copies of pinned prefix hits; unpinned when copies are taken."""
        for host_block, device_id in zip(host_blocks, device_block_ids, strict=True):
            self._to_device[device_id] = (host_block.block_id, False)
        self._pinned.extend(host_blocks)
        self.prefix_cache_hits_host += len(host_blocks) * self.block_size

    def restore_state(self, host_slot: KVCacheBlock, device_slot: int, num_tokens: int, num_host_tokens: int) -> None:
        """Record the host -> device copy of a pinned state checkpoint into a request's new
        working slot (``kv.host_states``); ``num_host_tokens``: hit tokens it alone made usable
        (beyond the copied-back blocks), counted as host hits."""
        self.states.restore(host_slot, device_slot, num_tokens)
        self.prefix_cache_hits_host += num_host_tokens

    # Step boundary -------------------------------------------------------------------

    @property
    def has_pending_copies(self) -> bool:
        """Copies recorded after the last step (a write-through on free): one more step runs them."""
        return bool(self._swap_out)

    def take_copies(self) -> tuple[BlockPairs, BlockPairs, BlockPairs]:
        """This step's (swap_out, swap_in, copy_back) pairs as (src, dst); clears them and
        releases the host blocks pinned for reading."""
        swap_out = [(src, dst) for dst, src in self._swap_out.items()]
        swap_in = [(src, dst) for dst, (src, is_swap_in) in self._to_device.items() if is_swap_in]
        copy_back = [(src, dst) for dst, (src, is_swap_in) in self._to_device.items() if not is_swap_in]
        self._swap_out, self._to_device = {}, {}
        pinned, self._pinned = self._pinned, []
        self.pool.free(pinned)
        return swap_out, swap_in, copy_back

    def take_file_copies(self) -> tuple[list, list]:
        """This step's (writes, loads) of the file tiers by host block id (``FileTiers.take``)."""
        return self.file_tiers.take() if self.file_tiers is not None else ([], [])

    def take_state_copies(self) -> tuple[BlockPairs, BlockPairs]:
        """This step's state slot copies: (device -> host, host -> device) as (src, dst)."""
        return self.states.take_copies()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.states.reset_prefix_cache()


class NoHostTier:
    """The host tier of an engine without one: every question gets the "no tier" answer."""

    is_enabled = has_pending_copies = False
    num_swapped_out = num_swapped_in = num_offloaded_blocks = prefix_cache_hits_host = 0
    num_blocks = num_free_blocks = 0
    cost_model: Optional[SwapCostModel] = None

    def __init__(self) -> None:
        self.states = HostStates(None, 1, False)  # no slots: finds nothing, offloads nothing

    def is_swapped_out(self, request_id: str) -> bool:  # noqa: ARG002
        return False

    def wants_swap(self, num_tokens: int, num_blocks: int) -> bool:  # noqa: ARG002
        return False

    def swap_out(self, request_id: str, device_block_ids: Sequence[int], state_slot: int = 0) -> bool:  # noqa: ARG002
        return False

    def swap_in(self, request_id: str, device_block_ids: Sequence[int], state_slot: int = 0) -> None:
        raise AssertionError("no host tier: nothing is swapped out")

    def free_request(self, request_id: str) -> None:
        pass

    def lookup_prefix(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int,
                      max_blocks: int) -> list[KVCacheBlock]:  # noqa: ARG002
        return []

    def pin(self, host_blocks: Sequence[KVCacheBlock]) -> None:
        pass

    unpin = pin

    def copy_back(self, host_blocks: Sequence[KVCacheBlock], device_block_ids: Sequence[int]) -> None:
        assert not host_blocks, "no host tier: nothing to copy back"

    def restore_state(self, host_slot: KVCacheBlock, device_slot: int, num_tokens: int, num_host_tokens: int) -> None:
        raise AssertionError("no host tier: no state checkpoint to restore")

    def take_copies(self) -> tuple[BlockPairs, BlockPairs, BlockPairs]:
        return [], [], []

    def take_state_copies(self) -> tuple[BlockPairs, BlockPairs]:
        return [], []

    def take_file_copies(self) -> tuple[list, list]:
        return [], []

    def reset_prefix_cache(self) -> None:
        pass


HostTier = Union[KVOffloadManager, NoHostTier]


def make_host_tier(num_host_blocks: int, block_size: int, preemption_mode: str,
                   cost_model: Optional[SwapCostModel], enable_prefix_tier: bool,
                   num_host_state_slots: int = 0, file_tiers: Optional[FileTiers] = None) -> HostTier:
    """A ``KVOffloadManager`` with ``num_host_blocks`` host blocks, or ``NoHostTier`` for 0."""
    if num_host_blocks <= 0:
        assert file_tiers is None, "the file tiers sit below a CPU tier"
        return NoHostTier()
    return KVOffloadManager(num_host_blocks, block_size, preemption_mode, cost_model, enable_prefix_tier,
                            num_host_state_slots, file_tiers)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)

