"""The KV cache manager: block tables per request on top of the block pool.

A request's block table covers its computed tokens plus the tokens scheduled this step;
block ``j`` holds token positions ``[j * block_size, (j + 1) * block_size)``. The manager
owns the tables (which blocks each live request holds); everything else about a request
lives on the ``Request``.

Prefix caching: a full block is *cached* (entered in the pool's hash map) once all of
its tokens are computed (``cache_blocks``, called after each step), including blocks
filled by output tokens. A waiting request looks up the longest run of its block hashes
that are cached (``get_computed_blocks``), comparing tokens as well as hashes, and
shares those blocks (reference counted) instead of recomputing them. The hit is capped
so at least one token is still computed: the step must produce logits to sample from.

Beam search (``request_groups.beam_search``) forks a request: ``fork`` gives the child the parent's
block table by reference (each shared block's count goes up, no KV is copied) except the
last, partly filled block, which the child is about to write into: that one is copied
(copy-on-write, a device copy queued for the next step, ``take_copies``), or, when no
block is free, left out so the child recomputes those few tokens. Freeing a beam drops
one reference per block, so only blocks it alone held return to the pool.

Running out of blocks is expected: ``allocate_slots`` returns ``None`` and changes
nothing; the scheduler then preempts.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagoda.engine.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.engine.request import Request


class KVCacheManager:
    """Args:
    block_pool: the blocks.
    block_size: tokens per block.
    enable_caching: look up and share cached prefix blocks.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool = True) -> None:
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching and block_pool.enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks already passed to cache_full_blocks
        self.prefix_cache_queries = 0  # tokens looked up (vLLM counts tokens)
        self.prefix_cache_hits = 0  # tokens found
        self._copies: list[tuple[int, int]] = []  # (src, dst) device block copies of forks, for the next step

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``'s full blocks (a pure lookup).

        Returns:
            (blocks, num_computed_tokens), ``num_computed_tokens == len(blocks) *
            block_size``; ``([], 0)`` without caching. The last token of the request is
            never part of the hit. Record the outcome with ``record_prefix_lookup`` once
            the request is actually admitted, so retries do not inflate the counters.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        hit: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None or list(block.token_ids) != tokens[i * self.block_size : (i + 1) * self.block_size]:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup, in tokens."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_loaded_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow ``request``'s block table to hold its computed tokens plus ``num_new_tokens``.

        Args:
            request: a request with ``num_computed_tokens`` not yet including the hit.
            num_new_tokens: tokens to compute this step (> 0).
            new_computed_blocks: a prefix hit from ``get_computed_blocks`` (only for a
                request that holds no blocks yet); they are shared, not copied.
            num_loaded_blocks: prefix blocks after ``new_computed_blocks`` found in the
                CPU tier (``kv.host_tier``): new blocks, counted as computed, whose contents
                the caller copies in before the step; they are cached (hashed) at once.
        Returns:
            The newly allocated blocks (possibly empty; the loaded ones first), or
            ``None`` when the pool cannot supply them; then nothing changed.
        """
        assert num_new_tokens > 0, f"num_new_tokens must be positive, got {num_new_tokens}"
        blocks = self.req_to_blocks.get(request.request_id, [])
        assert not (blocks and (new_computed_blocks or num_loaded_blocks)), \
            "a prefix hit only applies to a request holding no blocks"
        num_hit_blocks = len(new_computed_blocks) + num_loaded_blocks
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Reviving free cached blocks takes them out of the free queue too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None
        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = blocks
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if num_loaded_blocks:
            self.block_pool.cache_full_blocks(request, blocks, len(new_computed_blocks), num_hit_blocks,
                                              self.block_size)
            self.num_cached_blocks[request.request_id] = num_hit_blocks
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: Optional[int] = None) -> None:
        """Cache ``request``'s blocks that became full of computed tokens.

        Args:
            num_computed_tokens: tokens whose KV is known to be written (default:
                ``request.num_computed_tokens``). The scheduler passes what the applied
                step computed, since ``num_computed_tokens`` may already count a step
                that is still running.
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full, self.block_size)
            self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (tail first, so its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def fork(self, parent: Request, child: Request, num_computed_tokens: int) -> int:
        """Give ``child`` (holding no blocks) ``parent``'s KV for its first ``num_computed_tokens``
        tokens: full blocks shared, the partial last block copied (or recomputed when no block
        is free). Returns how many of ``child``'s tokens are computed."""
        assert child.request_id not in self.req_to_blocks, "a fork target holds no blocks"
        blocks = self.req_to_blocks[parent.request_id]
        num_full, num_partial = divmod(num_computed_tokens, self.block_size)
        table = list(blocks[:num_full])
        self.block_pool.touch(table)
        if num_partial and self.block_pool.num_free_blocks > 0:
            copy = self.block_pool.get_new_blocks(1)[0]
            self._copies.append((blocks[num_full].block_id, copy.block_id))
            table.append(copy)
        else:
            num_partial = 0  # recompute the partial block's tokens (they join a fresh block)
        self.req_to_blocks[child.request_id] = table
        self.num_cached_blocks[child.request_id] = min(self.num_cached_blocks.get(parent.request_id, 0), num_full)
        return num_full * self.block_size + num_partial

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) device block copies queued by forks since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table as ids ([] for an unknown request)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
