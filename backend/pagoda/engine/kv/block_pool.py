"""The block pool: KV blocks, their reference counts, the LRU free queue, the hash map.

Invariants:
- Block 0 is the *null block*: never allocated, never freed, never in the free queue.
  Padded block-table entries and padding tokens point at it, so they can never touch a
  live request's KV. ``num_usable_blocks == num_blocks - 1``.
- Every other block is either in use (``ref_cnt > 0``, one count per request holding it)
  or in the free queue (``ref_cnt == 0``); never both. Reference counts are never
  negative.
- A free block may still hold a *cached* full block (``block_hash`` set and the hash map
  pointing at it): it stays reusable until the free queue hands it out again, at which
  point its hash is evicted (``BlockRemoved``). An ``on_evict`` hook, when set, sees the
  block first (the CPU tier keeps a copy; ``kv.host_tier``).
- Blocks whose KV came from a peer (``engine.kv_transfer``) enter the hash map through
  ``cache_received_blocks`` only, under hashes the receiver recomputed itself, with the
  same ``BlockStored`` events as blocks a request filled.
- The hash map has at most one block per hash. When two requests fill blocks with the
  same content concurrently, the first one cached wins; the other block stays unhashed
  and is simply freed later.
- KV cache groups (``kv.layout``) share the pool: each group has its own hash map, since
  the same tokens hash alike in every group but a full-attention block and a
  sliding-window block of them hold different layers' KV. A cached block remembers its
  group (``group_idx``); events carry it, with the group's spec kind (``group_tags``).

Eviction order is LRU through the free queue: ``get_new_blocks`` pops from the head,
freed blocks join the tail. Callers free a request's blocks tail-first, so a request's
last blocks (least likely to be shared as a prefix) are evicted before its first ones.
``touch`` revives a free cached block in O(1) by unlinking it from the middle of the
queue, which is why the queue is an intrusive doubly linked list with dummy head and
tail nodes rather than a deque.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from pagoda.contracts.block_hash import BlockHash
from pagoda.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBuffer

if TYPE_CHECKING:
    from pagoda.engine.request import Request

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One block of KV memory. ``prev_free``/``next_free`` link it in the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_idx", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.group_idx = 0  # the KV cache group whose hash map holds it while cached
        self.token_ids: tuple[int, ...] = ()  # the block's tokens while cached (checked on a hit)
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction (LRU) order; every operation O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)  # dummy nodes: never handed out, never hashed
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __del__(self) -> None:
        # The links make the free blocks and the two dummies one reference cycle: unlinked when
        # the queue goes (with its pool, its engine), they are freed by reference counting
        # rather than at CPython's next full collection. O(n), once.
        node = self._head
        while node is not None:
            following = node.next_free
            node.prev_free = node.next_free = None
            node = following

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.next_free is not None

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block. Raises IndexError if empty."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail (the most recently freed end)."""
        assert block.next_free is None and block.prev_free is None, f"{block} is already in the free queue"
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue head to tail (for tests and debugging; O(n))."""
        blocks = []
        node = self._head.next_free
        while node is not self._tail:
            blocks.append(node)
            node = node.next_free
        return blocks


class BlockPool:
    """Owns ``num_blocks`` KV blocks (block 0 reserved as the null block).

    Args:
        num_blocks: blocks of KV memory, including the null block (so >= 2).
        enable_caching: keep full blocks findable by hash after they are freed.
        event_buffer: where ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` go;
            ``None`` creates a private buffer. No events are emitted without caching.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, event_buffer: Optional[KVEventBuffer] = None):
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.event_buffer = event_buffer if event_buffer is not None else KVEventBuffer()
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self._cached: dict[int, dict[BlockHash, KVCacheBlock]] = {0: {}}  # group index -> hash map
        # Group index -> (vLLM spec kind, sliding window) for events; set for multi-group layouts only.
        self.group_tags: dict[int, tuple[str, Optional[int]]] = {}
        # Called with each cached block about to be evicted, while it still holds its hash
        # and tokens (the KV offload tier copies it to host memory; kv/host_tier.py).
        self.on_evict: Optional[Callable[[KVCacheBlock], None]] = None
        # Called with each cached block its last holder frees (it stays cached here): the file
        # tiers' write-through (kv_write_through) copies it to the host tier and the files at once.
        self.on_free_cached: Optional[Callable[[KVCacheBlock], None]] = None

    @property
    def cached_block_hash_to_block(self) -> dict[BlockHash, KVCacheBlock]:
        """Group 0's hash map (the only one of a single-group model)."""
        return self._cached[0]

    def hash_map(self, group_idx: int) -> dict[BlockHash, KVCacheBlock]:
        """Group ``group_idx``'s hash map (created empty on first use)."""
        return self._cached.setdefault(group_idx, {})

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(m) for m in self._cached.values())

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0.0 to 1.0); free cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks, least recently freed first, each with ``ref_cnt`` 1.

        A popped block that was cached is evicted from the hash map (``BlockRemoved``).
        The caller checks ``num_free_blocks`` first; asking for more is a bug (assert).
        """
        assert num_blocks <= self.num_free_blocks, f"asked for {num_blocks} blocks, {self.num_free_blocks} free"
        blocks = []
        evicted: dict[int, list[str]] = {}  # group -> hashes, one BlockRemoved per group
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"{block} in the free queue is referenced"
            if block.block_hash is not None:
                group_idx = block.group_idx
                evicted.setdefault(group_idx, []).append(self._evict(block))
            block.ref_cnt = 1
            blocks.append(block)
        for group_idx, hashes in evicted.items():
            self.event_buffer.emit(BlockRemoved(hashes, group_idx=group_idx))
        return blocks

    def _evict(self, block: KVCacheBlock) -> str:
        """Take ``block``'s hash out of its group's map (``on_evict`` sees it first)."""
        block_hash, hash_map = block.block_hash, self.hash_map(block.group_idx)
        assert hash_map.get(block_hash) is block, f"{block} hashed but not in the hash map"
        if self.on_evict is not None:
            self.on_evict(block)
        del hash_map[block_hash]
        block.block_hash = None
        block.token_ids = ()
        return block_hash.hex()

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget ``block``'s hash now (``BlockRemoved``), whoever holds it; it stays where it is
        (held, or free in its place in the eviction order). For contents no longer worth a
        hit (``kv.state_manager``: a request's previous decode checkpoint); no lower tier is
        offered them."""
        if block.block_hash is None:
            return
        block_hash, hash_map = block.block_hash, self.hash_map(block.group_idx)
        assert hash_map.get(block_hash) is block, f"{block} hashed but not in the hash map"
        del hash_map[block_hash]
        block.block_hash, block.token_ids = None, ()
        self.event_buffer.emit(BlockRemoved([block_hash.hex()], group_idx=block.group_idx))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, reviving free (cached) ones."""
        for block in blocks:
            assert not block.is_null, "the null block is never referenced"
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue tail.

        Pass a request's blocks tail-first so its last blocks are evicted first.
        """
        for block in ordered_blocks:
            assert not block.is_null, "the null block is never freed"
            assert block.ref_cnt > 0, f"{block}: reference count would go negative"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if self.on_free_cached is not None and block.block_hash is not None:
                    self.on_free_cached(block)

    def get_cached_block(self, block_hash: BlockHash, group_idx: int = 0) -> Optional[KVCacheBlock]:
        """The block holding ``block_hash``'s contents for group ``group_idx``, or None."""
        hash_map = self._cached.get(group_idx)
        return hash_map.get(block_hash) if hash_map is not None else None

    def cache_full_blocks(
        self,
        request: "Request",
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_idx: int = 0,
    ) -> None:
        """Make ``blocks[num_cached_blocks:num_full_blocks]`` findable by their hashes.

        Args:
            request: owner of ``blocks``; supplies ``block_hashes`` and token ids.
            blocks: the request's block table in group ``group_idx`` (null entries, blocks a
                sliding window already let go, are skipped).
            num_cached_blocks: blocks already processed by an earlier call.
            num_full_blocks: blocks whose tokens are all computed now.
            block_size: tokens per block.
        Emits one ``BlockStored`` per contiguous run of newly stored blocks.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, "request block hashes lag its computed tokens"
        run: list[int] = []  # indices of the current run of newly stored blocks
        for i in range(num_cached_blocks, num_full_blocks):
            if not self.cache_block(request, blocks[i], i, block_size, group_idx, emit=False):
                # Already cached (a prefix hit), another block holds the same content, or null.
                self._emit_stored(request, run, block_size, group_idx)
                run = []
                continue
            run.append(i)
        self._emit_stored(request, run, block_size, group_idx)

    def cache_block(self, request: "Request", block: KVCacheBlock, index: int, block_size: int, group_idx: int = 0,
                    emit: bool = True) -> bool:
        """Enter ``block`` under ``request``'s hash of block ``index`` in group ``group_idx``'s map.

        Returns:
            False, changing nothing, when the block is null or hashed already, or the hash is
            held by another block; True when entered (``emit``: with its ``BlockStored``).
        """
        block_hash, hash_map = request.block_hashes[index], self.hash_map(group_idx)
        if block.is_null or block.block_hash is not None or block_hash in hash_map:
            return False
        block.block_hash, block.group_idx = block_hash, group_idx
        block.token_ids = tuple(request.all_token_ids[index * block_size:(index + 1) * block_size])
        hash_map[block_hash] = block
        if emit:
            self._emit_stored(request, [index], block_size, group_idx)
        return True

    def cache_received_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[Sequence[int]],
        parent_block_hash: Optional[BlockHash],
        lora_name: Optional[str] = None,
        cache_salt: Optional[str] = None,
        group_idx: int = 0,
    ) -> int:
        """Enter one contiguous run of blocks whose KV came from a peer (``engine.kv_transfer``).

        ``blocks[i]`` (held by the caller, written already) holds ``block_hashes[i]``'s
        tokens ``token_ids[i]``; the caller has checked the hash chain. A hash cached in
        the meantime keeps its block; the new one stays unhashed and is freed normally.
        Emits one ``BlockStored`` per contiguous run of newly stored blocks. Group ``group_idx``'s
        map: group 0's blocks, or a recurrent-state group's checkpoint slot (in the state pool;
        ``kv_transfer.connector.check_layout`` says which layouts a connector serves).

        Returns:
            How many blocks were entered in the hash map.
        """
        if not self.enable_caching:
            return 0
        run: list[int] = []  # indices of the current run of newly stored blocks
        stored = 0
        hash_map = self.hash_map(group_idx)
        keys = (block_hashes, token_ids, parent_block_hash, lora_name, cache_salt, group_idx)
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if block.block_hash is not None or block_hash in hash_map:
                self._emit_received(run, *keys)
                run = []
                continue
            block.block_hash, block.group_idx = block_hash, group_idx
            block.token_ids = tuple(token_ids[i])
            hash_map[block_hash] = block
            run.append(i)
            stored += 1
        self._emit_received(run, *keys)
        return stored

    def _emit_received(self, run, block_hashes, token_ids, parent_block_hash, lora_name, cache_salt,
                       group_idx: int) -> None:
        if not run:
            return
        first = run[0]
        parent = block_hashes[first - 1] if first > 0 else parent_block_hash
        kind, window = self.group_tags.get(group_idx, (None, None))
        self.event_buffer.emit(BlockStored(
            block_hashes=[block_hashes[i].hex() for i in run],
            parent_block_hash=parent.hex() if parent is not None else None,
            token_ids=[t for i in run for t in token_ids[i]], block_size=len(token_ids[first]),
            lora_name=lora_name, cache_salt=cache_salt, group_idx=group_idx, kv_cache_spec_kind=kind,
            sliding_window=window))

    def _emit_stored(self, request: "Request", run: list[int], block_size: int, group_idx: int = 0) -> None:
        if not run:
            return
        first, last = run[0], run[-1]
        parent = request.block_hashes[first - 1].hex() if first > 0 else None
        kind, window = self.group_tags.get(group_idx, (None, None))
        self.event_buffer.emit(
            BlockStored(
                block_hashes=[request.block_hashes[i].hex() for i in run],
                parent_block_hash=parent,
                token_ids=list(request.all_token_ids[first * block_size : (last + 1) * block_size]),
                block_size=block_size,
                lora_name=request.adapter_id,
                cache_salt=request.cache_salt,
                group_idx=group_idx,
                kv_cache_spec_kind=kind,
                sliding_window=window,
                mm_keys=[request.block_mm_keys(i) for i in run] if request.mm_features else None,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (``AllBlocksCleared``).

        Returns:
            False, changing nothing, while any block is in use (running requests would
            lose track of their cached blocks); True after a reset.
        """
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for hash_map in self._cached.values():
            for block in hash_map.values():
                block.block_hash = None
                block.token_ids = ()
            hash_map.clear()
        if self.enable_caching:
            self.event_buffer.emit(AllBlocksCleared())
        return True
