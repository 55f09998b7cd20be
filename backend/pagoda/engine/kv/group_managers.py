"""Block tables of one paged KV cache group: full attention and sliding window.

A ``PagedGroupManager`` keeps, per request, the group's block table (``req_to_blocks``):
entry ``j`` holds positions ``[j * block_size, (j + 1) * block_size)``. The coordinator
(``kv.kv_cache_manager``) asks every group the same questions, and each answers by its
spec:

- ``find_hit(request, max_blocks)``: the longest usable prefix hit of at most
  ``max_blocks`` blocks, as the group's table for it (null blocks where the group needs
  nothing). Full attention scans left to right and stops at the first miss. A sliding
  window needs only the blocks its next query reads: the ``cdiv(window - 1, block_size)``
  blocks before the hit's end, found scanning right to left (vLLM's
  ``SlidingWindowManager``), the ones before them null; a hit shorter than that needs
  every block from the start. Tokens are compared as well as hashes.
- ``remove_skipped(request_id, num_computed_tokens)``: a sliding window frees the blocks
  wholly before ``num_computed_tokens - window + 1`` (the first key the next query reads)
  and puts the null block in their place; the table keeps its length, so block ``j``
  still means positions of block ``j``. A freed block stays cached (free but findable
  by its hash) until the pool hands it out again, so a request sharing the prefix can
  still hit it.
- ``num_new_blocks`` / ``allocate``: blocks to add so the table covers ``num_tokens``.
- ``cache``: enter the blocks that became full in the group's hash map (null entries
  are skipped).
- ``free`` (tail first) and ``fork`` (beam search: full blocks shared, the partial last
  block copied).

No torch; the block pool is shared with the other paged groups (``kv.layout``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagoda.engine.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.engine.kv.layout import KVCacheGroup
from pagoda.engine.kv.specs import SlidingWindowSpec, blocks_for
from pagoda.engine.request import Request


class PagedGroupManager:
    """Full attention (and MLA): every block of a request is kept until it ends.

    Args:
        group: the group (its index keys its hash map and its events).
        block_pool: the shared block pool.
        block_size: tokens per block.
        enable_caching: look up, share and cache full blocks.
    """

    def __init__(self, group: KVCacheGroup, block_pool: BlockPool, block_size: int, enable_caching: bool) -> None:
        self.group = group
        self.group_idx = group.index
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # table entries already passed to cache_full_blocks

    # Lookup ---------------------------------------------------------------------------

    def find_hit(self, request: Request, max_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of ``request``'s prefix, from the first, at most ``max_blocks``."""
        hit: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(request.block_hashes))):
            block = self._cached(request, i)
            if block is None:
                break
            hit.append(block)
        return hit

    def _cached(self, request: Request, index: int) -> Optional[KVCacheBlock]:
        """The cached block holding ``request``'s block ``index`` (tokens checked), or None."""
        block = self.block_pool.get_cached_block(request.block_hashes[index], self.group_idx)
        size = self.block_size
        if block is None or list(block.token_ids) != request.all_token_ids[index * size:(index + 1) * size]:
            return None
        return block

    # Allocation -----------------------------------------------------------------------

    def num_new_blocks(self, request_id: str, num_tokens: int, hit: Sequence[KVCacheBlock] = ()) -> int:
        """Pool blocks an allocation covering ``num_tokens`` takes: new blocks, plus the hit's
        blocks that are free (cached) and would leave the free queue."""
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(hit)
        revived = sum(1 for b in hit if b.ref_cnt == 0 and not b.is_null)
        return max(0, blocks_for(num_tokens, self.block_size) - num_held) + revived

    def take_hit(self, request_id: str, hit: Sequence[KVCacheBlock]) -> None:
        """Start ``request_id``'s table (if it has none) with the hit's blocks, shared. Every
        group takes its hit before any allocates: a new block must not evict a hit's block."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = len(hit)
        assert not (blocks and hit), "a prefix hit only applies to a request holding no blocks"
        self.block_pool.touch(b for b in hit if not b.is_null)
        blocks.extend(hit)

    def allocate(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """New blocks so the table (started by ``take_hit``) covers ``num_tokens``; the caller
        checked ``num_new_blocks`` against the pool. Returns the new blocks."""
        blocks = self.req_to_blocks[request_id]
        new_blocks = self.block_pool.get_new_blocks(max(0, blocks_for(num_tokens, self.block_size) - len(blocks)))
        blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no future query reads (none for full attention)."""

    # Caching and freeing --------------------------------------------------------------

    def cache(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the blocks holding ``num_computed_tokens`` written tokens in the hash map."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not self.enable_caching or not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full, self.block_size, self.group_idx)
            self.num_cached_blocks[request.request_id] = num_full

    def mark_cached(self, request: Request, num_blocks: int) -> None:
        """Cache the table's first ``num_blocks`` at once (blocks loaded from the host tier)."""
        num_cached = self.num_cached_blocks[request.request_id]
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request.request_id], num_cached, num_blocks,
                                          self.block_size, self.group_idx)
        self.num_cached_blocks[request.request_id] = max(num_cached, num_blocks)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> tuple[int, Optional[tuple[int, int]]]:
        """Give ``child_id`` the parent's table for ``num_computed_tokens`` tokens: full blocks
        shared, a partial last block copied into a new block (when one is free).

        Returns:
            (tokens the child has, the (src, dst) block copy or None).
        """
        assert child_id not in self.req_to_blocks, "a fork target holds no blocks"
        blocks = self.req_to_blocks[parent_id]
        num_full, num_partial = divmod(num_computed_tokens, self.block_size)
        table = list(blocks[:num_full])
        self.block_pool.touch(b for b in table if not b.is_null)
        copy = None
        if num_partial and self.block_pool.num_free_blocks > 0:
            block = self.block_pool.get_new_blocks(1)[0]
            copy = (blocks[num_full].block_id, block.block_id)
            table.append(block)
        else:
            num_partial = 0  # recompute the partial block's tokens (they join a fresh block)
        self.req_to_blocks[child_id] = table
        self.num_cached_blocks[child_id] = min(self.num_cached_blocks.get(parent_id, 0), num_full)
        return num_full * self.block_size + num_partial, copy


class SlidingWindowManager(PagedGroupManager):
    """A sliding window: blocks before the next query's window go back to the pool."""

    def __init__(self, group: KVCacheGroup, block_pool: BlockPool, block_size: int, enable_caching: bool) -> None:
        super().__init__(group, block_pool, block_size, enable_caching)
        spec = group.spec
        assert isinstance(spec, SlidingWindowSpec), f"group {group.index} is not a sliding window"
        self.window = spec.window
        # Blocks a hit must have right before its end: the next query reads window - 1 keys back.
        self.num_window_blocks = blocks_for(self.window - 1, block_size)

    def find_hit(self, request: Request, max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_blocks`` whose last ``num_window_blocks`` blocks are
        cached (scanning right to left), earlier entries null; or the cached run from the
        first block when no such hit exists (a hit that short needs every block)."""
        max_blocks = min(max_blocks, len(request.block_hashes))
        null = self.block_pool.null_block
        if self.num_window_blocks == 0:  # a one-token window reads no cached key
            return [null] * max_blocks
        run: list[KVCacheBlock] = []  # cached blocks right to left, ending at the current candidate end
        for i in range(max_blocks - 1, -1, -1):
            block = self._cached(request, i)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= self.num_window_blocks:
                return [null] * i + run[::-1]
        return run[::-1]  # a run reaching block 0 (shorter than the window's blocks), or nothing

    def remove_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_needed = max(0, num_computed_tokens - self.window + 1) // self.block_size
        freed: list[KVCacheBlock] = []
        for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before it was nulled by an earlier call
            freed.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(freed)

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds in this group (its table less the null entries)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)


MANAGERS = {"full": PagedGroupManager, "sliding": SlidingWindowManager}
