"""The KV cache manager: a request's block tables, one per KV cache group.

A model's layers are grouped by cache spec (``kv.layout``); each group has a manager that
keeps its tables (``kv.group_managers`` for paged groups, ``kv.state_manager`` for the
recurrent-state group) and this class coordinates them, so the scheduler asks one object
one question per request. A group's table ``j``-th entry holds positions
``[j * block_size, (j + 1) * block_size)`` (the state group's table is its working slot).
A single-group model (every layer full attention) has one table, as before groups.

Prefix caching: a full block is *cached* (entered in its group's hash map) once all of
its tokens are computed (``cache_blocks``, after each step), including blocks filled by
output tokens. A waiting request looks up its hit (``find_cache_hit``) in every group,
and **a hit counts only where every group has it**: group 0 (full attention) offers the
longest cached run from the start, a sliding-window group the last position whose window
blocks are cached, the state group the last checkpoint; the hit is shortened until all
agree (vLLM's hybrid coordinator's fixed point), then the request shares those blocks
(reference counted) and resumes the state checkpoint instead of recomputing. The hit is
capped so at least one token is still computed: the step must produce logits. Groups
evict independently (LRU in their pools); a hit never uses a group's blocks without the
others'. ``cache_salt`` and the LoRA adapter are in every block hash, so they isolate
every group alike.

Sliding windows: before each allocation a running request's blocks outside its next
query's window are freed (``remove_skipped``): they are reused by anyone (they count as
free for the allocation that freed them), so a long generation holds a window's worth.

Beam search (``request_groups.beam_search``) forks a request: ``fork`` gives the child the parent's
tables by reference (each shared block's count goes up, no KV is copied) except the last,
partly filled block, which the child is about to write into: that one is copied
(copy-on-write, a device copy queued for the next step, ``take_copies``), or, when no
block is free, left out so the child recomputes those few tokens. A model with a state
group does not fork (``EngineConfig`` refuses beam search for it).

Running out of blocks (or state slots) is expected: ``allocate_slots`` returns ``None``
and allocates nothing; the scheduler then preempts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from pagoda.contracts.kv_events import KVEventBuffer
from pagoda.engine.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.engine.kv.file_tier import FileTiers, check_layout, emit_events
from pagoda.engine.kv.group_managers import MANAGERS, PagedGroupManager
from pagoda.engine.kv.host_states import HostStates
from pagoda.engine.kv.host_tier import BlockPairs, HostTier, make_host_tier
from pagoda.engine.kv.swap_cost import SwapCostModel
from pagoda.engine.kv.layout import KVCacheLayout, single_group_layout
from pagoda.engine.kv.specs import SlidingWindowSpec
from pagoda.engine.kv.state_manager import StateGroupManager
from pagoda.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass
class CacheHit:
    """A waiting request's prefix hit: per group, its table for the hit (null entries where a
    group needs nothing; the state group's table ends with the checkpoint); ``num_tokens``
    hit in every group; ``num_attention_tokens`` group 0's own hit (the junction)."""

    blocks: list[list[KVCacheBlock]] = field(default_factory=list)
    num_tokens: int = 0
    num_attention_tokens: int = 0

    @property
    def device_blocks(self) -> list[KVCacheBlock]:
        """Group 0's blocks (the table the host tier continues)."""
        return self.blocks[0] if self.blocks else []


class KVCacheManager:
    """Args:
    block_pool: the blocks of the paged groups.
    block_size: tokens per block.
    enable_caching: look up and share cached prefix blocks (and state checkpoints).
    layout: the groups (default: one full-attention group).
    state_pool: the state slots, when ``layout`` has a state group.
    checkpoint_interval: tokens between periodic state checkpoints (``kv.state_manager``).
    """

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool = True,
                 layout: Optional[KVCacheLayout] = None, state_pool: Optional[BlockPool] = None,
                 checkpoint_interval: int = 0) -> None:
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching and block_pool.enable_caching
        self.layout = layout or single_group_layout(block_pool.num_blocks, block_size)
        self.paged: list[PagedGroupManager] = [
            MANAGERS[g.spec.manager_kind](g, block_pool, block_size, self.enable_caching)
            for g in self.layout.paged_groups]
        state_group = self.layout.state_group
        self.state: Optional[StateGroupManager] = None
        if state_group is not None:
            assert state_pool is not None, "a state group needs a state pool"
            self.state = StateGroupManager(state_group, state_pool, block_size, self.enable_caching,
                                           checkpoint_interval)
        if self.layout.num_groups > 1:  # events name each group's kind (vLLM's hybrid form)
            tags = {g.index: (g.spec.kind, g.spec.window if isinstance(g.spec, SlidingWindowSpec) else None)
                    for g in self.layout.groups}
            for pool in (block_pool, state_pool):
                if pool is not None:
                    pool.group_tags = tags
        self.prefix_cache_queries = 0  # tokens looked up (vLLM counts tokens)
        self.prefix_cache_hits = 0  # tokens found
        self._copies: list[tuple[int, int]] = []  # (src, dst) device block copies of forks, for the next step

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's tables by request id (every request holding blocks has one there)."""
        return self.paged[0].req_to_blocks

    # Prefix lookup --------------------------------------------------------------------

    def find_cache_hit(self, request: Request) -> CacheHit:
        """The longest prefix every group has cached (a pure lookup; see the module docstring).

        The last token of the request is never part of the hit. Record the outcome with
        ``record_prefix_lookup`` once the request is actually admitted.
        """
        num_groups = self.layout.num_groups
        if not self.enable_caching:
            return CacheHit([[] for _ in range(num_groups)])
        max_blocks = (request.num_tokens - 1) // self.block_size
        managers = self._managers()
        tables = [m.find_hit(request, max_blocks) for m in managers]
        attention = len(tables[0]) * self.block_size
        while len({len(t) for t in tables}) > 1:  # shorten until every group hits at the same end
            max_blocks = min(len(t) for t in tables)
            tables = [t if len(t) == max_blocks else m.find_hit(request, max_blocks) for m, t in zip(managers, tables)]
        return CacheHit(tables, len(tables[0]) * self.block_size, attention)

    def get_computed_blocks(self, request: Request) -> tuple[CacheHit, int]:
        """``find_cache_hit`` and its length in tokens."""
        hit = self.find_cache_hit(request)
        return hit, hit.num_tokens

    def usable_loaded_blocks(self, hit: CacheHit, num_host_blocks: int, request: Request,
                             host_states: Optional[HostStates] = None) -> tuple[CacheHit, int, Optional[KVCacheBlock]]:
        """How much of a prefix continued by ``num_host_blocks`` host-tier blocks every group can
        follow. The host blocks continue group 0's own device hit (``hit.num_attention_tokens``).
        One paged group without state: all of them. With a state group: up to the last state
        checkpoint, on the device or in ``host_states`` (``kv.host_states``), past the device hit;
        group 0's table and the host blocks are cut there. More paged groups: none.

        Returns:
            (the hit with group 0's and the state group's tables updated, usable host blocks, the
            host checkpoint to restore into the working slot, or None: the state table has it).
        """
        if len(self.paged) > 1 or (self.state is None and num_host_blocks == 0):
            return hit, 0, None
        if self.state is None:
            return hit, num_host_blocks, None
        attention_end = hit.num_attention_tokens // self.block_size
        end, start = attention_end + num_host_blocks, len(hit.device_blocks)
        if end <= start:
            return hit, 0, None
        state_table = self.state.find_hit(request, end)
        host_end, host_slot = (0, None) if host_states is None else host_states.find_checkpoint(
            request.block_hashes, request.all_token_ids, max(start, len(state_table)), end)
        best = max(len(state_table), host_end)
        if best <= start:
            return hit, 0, None
        tables = list(hit.blocks)
        tables[0] = self.paged[0].find_hit(request, min(best, attention_end))
        tables[self.state.group_idx] = state_table if len(state_table) == best else []
        restored = CacheHit(tables, len(tables[0]) * self.block_size, hit.num_attention_tokens)
        return restored, max(0, best - attention_end), None if len(state_table) == best else host_slot

    def working_slot(self, request_id: str) -> int:
        """The request's recurrent-state working slot (0: none, or no state group)."""
        return self.state.slot_id(request_id) if self.state is not None else 0

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup, in tokens."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    # Allocation -----------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: Optional[CacheHit] = None,
                       num_loaded_blocks: int = 0) -> Optional[list[KVCacheBlock]]:
        """Grow ``request``'s tables to hold its computed tokens plus ``num_new_tokens``.

        Args:
            request: a request with ``num_computed_tokens`` not yet including the hit.
            num_new_tokens: tokens to compute this step (> 0).
            hit: from ``find_cache_hit`` (only for a request holding no blocks); shared,
                not copied (the state checkpoint is copied into a new working slot).
            num_loaded_blocks: group 0 blocks after the hit found in the CPU tier
                (``kv.host_tier``): new blocks, counted as computed, whose contents the
                caller copies in before the step; they are cached (hashed) at once.
        Returns:
            Group 0's newly allocated blocks (possibly empty; the loaded ones first), or
            ``None`` when the pools cannot supply them; then nothing was allocated (blocks
            of a sliding window outside the next query's window are freed either way).
        """
        assert num_new_tokens > 0, f"num_new_tokens must be positive, got {num_new_tokens}"
        request_id = request.request_id
        tables = hit.blocks if hit is not None else [[] for _ in range(self.layout.num_groups)]
        num_hit_tokens = (hit.num_tokens if hit is not None else 0) + num_loaded_blocks * self.block_size
        assert not (request_id in self.paged[0].req_to_blocks and num_hit_tokens), \
            "a prefix hit only applies to a request holding no blocks"
        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        for manager in self.paged:
            manager.remove_skipped(request_id, request.num_computed_tokens)
        num_blocks = sum(m.num_new_blocks(request_id, num_tokens, tables[m.group_idx]) for m in self.paged)
        if num_blocks > self.block_pool.num_free_blocks:
            return None
        state_hit = tables[self.state.group_idx] if self.state is not None else []
        if self.state is not None and self.state.num_new_slots(request_id, state_hit) > self.state.pool.num_free_blocks:
            return None
        for manager in self.paged:
            manager.take_hit(request_id, tables[manager.group_idx])
        if self.state is not None:
            self.state.allocate(request, state_hit, hit.num_attention_tokens if hit is not None else 0)
        new_blocks = [m.allocate(request_id, num_tokens) for m in self.paged]
        if num_loaded_blocks:
            self.paged[0].mark_cached(request, len(tables[0]) + num_loaded_blocks)
        if self.state is not None:
            self.state.plan_checkpoint(request, num_tokens - num_new_tokens, num_new_tokens)
        return new_blocks[0]

    def cut_at_checkpoint(self, request: Request, start: int, num_new_tokens: int,
                          hit: Optional[CacheHit] = None) -> int:
        """``num_new_tokens`` shortened to end at the next state checkpoint position (no state:
        unchanged); ``hit``: a waiting request's, whose junction counts before it is admitted."""
        if self.state is None:
            return num_new_tokens
        junction = hit.num_attention_tokens if hit is not None and hit.num_attention_tokens > hit.num_tokens else 0
        return self.state.next_cut(request, start, num_new_tokens, junction)

    def cache_blocks(self, request: Request, num_computed_tokens: Optional[int] = None) -> None:
        """Cache ``request``'s blocks (and state checkpoints) that hold computed tokens.

        Args:
            num_computed_tokens: tokens whose KV is known to be written (default:
                ``request.num_computed_tokens``). The scheduler passes what the applied
                step computed, since ``num_computed_tokens`` may already count a step
                that is still running.
        """
        if not self.enable_caching:
            return
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        for manager in self._managers():
            manager.cache(request, num_computed_tokens)

    def undo(self, request: Request) -> None:
        """A step of ``request`` will not be applied: its pending state checkpoints are void."""
        if self.state is not None:
            self.state.drop_pending(request.request_id)

    def free(self, request: Request) -> None:
        """Release every block (and slot) of ``request`` (tail first, so its tail is evicted first)."""
        for manager in self._managers():
            manager.free(request.request_id)

    def fork(self, parent: Request, child: Request, num_computed_tokens: int) -> int:
        """Give ``child`` (holding no blocks) ``parent``'s KV for its first ``num_computed_tokens``
        tokens: full blocks shared, the partial last block copied (or recomputed when no block
        is free). Returns how many of ``child``'s tokens are computed."""
        assert self.state is None, "recurrent states do not fork (beam search is refused for such models)"
        num_child = num_computed_tokens
        for manager in self.paged:
            num, copy = manager.fork(parent.request_id, child.request_id, num_computed_tokens)
            num_child = min(num_child, num)
            if copy is not None:
                self._copies.append(copy)
        return num_child

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) device block copies queued by forks since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def state_stats(self) -> dict[str, int]:
        """The state group's counters (``EngineStats.num_state_*``); empty without one."""
        if self.state is None:
            return {}
        state, pool = self.state, self.state.pool
        return dict(num_state_restores=state.num_restored, num_state_restored_tokens=state.num_restored_tokens,
                    num_state_checkpoints=state.num_checkpoints, num_state_slots=pool.num_usable_blocks,
                    num_free_state_slots=pool.num_free_blocks)

    def take_state_copies(self) -> tuple[BlockPairs, BlockPairs]:
        """This step's state slot copies: (before the forward: restores; after: checkpoints)."""
        return self.state.take_copies() if self.state is not None else ([], [])

    # Tables ---------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Group 0's table."""
        return self.paged[0].req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of group 0's table as ids ([] for an unknown request)."""
        return [b.block_id for b in self.get_blocks(request_id)]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's table as ids, in group order (the state group's: ``[working slot]``)."""
        tables = [[b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.paged]
        if self.state is not None:
            slot = self.state.slot_id(request_id)
            tables.insert(self.state.group_idx, [slot] if slot else [])
        return tuple(tables)

    def get_swap_block_ids(self, request: Request) -> tuple[list[int], int]:
        """What a swap moves for ``request`` at its ``num_computed_tokens``: the paged groups'
        live blocks holding them (sliding windows' out-of-window blocks freed first), in group
        order, and the state slot (0: none). After a later ``allocate_slots`` at the same
        ``num_computed_tokens`` the same call lists the new blocks in the same order."""
        num_computed, request_id = request.num_computed_tokens, request.request_id
        num_blocks = -(-num_computed // self.block_size)
        ids = []
        for manager in self.paged:
            manager.remove_skipped(request_id, num_computed)
            ids += [b.block_id for b in manager.req_to_blocks.get(request_id, ())[:num_blocks] if not b.is_null]
        return ids, self.state.slot_id(request_id) if self.state is not None else 0

    def _managers(self) -> list:
        managers: list = list(self.paged)
        if self.state is not None:
            managers.insert(self.state.group_idx, self.state)
        return managers

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.state is not None:
            self.state.reset()
        return True


def make_kv_cache(layout: KVCacheLayout, enable_caching: bool, event_buffer: KVEventBuffer,
                  checkpoint_interval: int = 0, num_host_blocks: int = 0, num_host_state_slots: int = 0,
                  preemption_mode: str = "auto", cost_model: Optional[SwapCostModel] = None,
                  file_tiers: Optional[FileTiers] = None) -> tuple[KVCacheManager, HostTier]:
    """The scheduler's KV cache: pools sized by ``layout``, the manager over them, and the host
    tier (``kv.host_tier``; ``NoHostTier`` for 0 host blocks) receiving evicted cached blocks.
    The host tier's prefix side needs one paged group (its module docstring says why); a
    layout with more keeps the tier for swaps only, and logs so."""
    block_pool = BlockPool(layout.num_blocks, enable_caching, event_buffer)
    state_pool = BlockPool(layout.num_state_slots, enable_caching, event_buffer) if layout.state_group else None
    manager = KVCacheManager(block_pool, layout.block_size, enable_caching, layout, state_pool, checkpoint_interval)
    prefix_tier = enable_caching and len(layout.paged_groups) == 1
    if num_host_blocks and enable_caching and not prefix_tier:
        logger.warning("KV offload: the CPU tier holds swapped requests only, no evicted prefix blocks: the model's "
                       "%d paged KV cache groups (sliding-window layers) need their windows' blocks beside the "
                       "full-attention ones for a hit, which the tier does not track", len(layout.paged_groups))
    if file_tiers is not None:
        check_layout(layout)
        emit_events(file_tiers, event_buffer, layout.block_size)
    host_tier = make_host_tier(num_host_blocks, layout.block_size, preemption_mode, cost_model, prefix_tier,
                               num_host_state_slots, file_tiers)
    if host_tier.is_enabled:  # evicted cached blocks go to the host tier instead of away
        block_pool.on_evict = host_tier.on_device_evict
        if state_pool is not None and prefix_tier:  # and evicted state checkpoints (kv.host_states)
            state_pool.on_evict = host_tier.states.on_device_evict
        if file_tiers is not None and file_tiers.write_through:  # and freed ones at once, on to the files
            block_pool.on_free_cached = host_tier.on_device_evict
    return manager, host_tier
