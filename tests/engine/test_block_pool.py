"""Block pool: exact free-queue (LRU) order, reference counts, caching and events."""

import pytest

from pagoda.engine.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagoda.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBuffer
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def free_order(pool):
    return ids(pool.free_block_queue.get_all_free_blocks())


def make_request(tokens, block_size=4, rid="r", salt=None):
    request = Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)
    request.init_block_hashes(block_size, "m")
    return request


def test_free_queue_o1_operations_keep_exact_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3] and len(queue) == 2
    queue.append(blocks[4])
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 4, 0]
    assert queue.popleft() is blocks[1]
    assert blocks[1] not in queue and blocks[3] in queue
    for _ in range(3):
        queue.popleft()
    assert len(queue) == 0 and queue.get_all_free_blocks() == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    assert free_order(pool) == [1, 2, 3, 4]
    assert 0 not in ids(pool.get_new_blocks(4))
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_lru_order_after_alloc_free_touch():
    pool = BlockPool(7)  # usable blocks 1..6
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3] and free_order(pool) == [4, 5, 6]
    b = pool.get_new_blocks(2)
    assert ids(b) == [4, 5] and free_order(pool) == [6]
    pool.free_blocks(reversed(a))  # tail first: block 3 is evicted before 1
    assert free_order(pool) == [6, 3, 2, 1]
    pool.touch([a[1]])  # revive block 2 from the middle
    assert a[1].ref_cnt == 1 and free_order(pool) == [6, 3, 1]
    pool.touch([b[0]])  # shared: ref 2, no queue change
    assert b[0].ref_cnt == 2 and free_order(pool) == [6, 3, 1]
    pool.free_blocks([b[0]])
    assert b[0].ref_cnt == 1 and free_order(pool) == [6, 3, 1]
    pool.free_blocks(reversed(b))
    assert free_order(pool) == [6, 3, 1, 5, 4]
    assert ids(pool.get_new_blocks(2)) == [6, 3]
    assert free_order(pool) == [1, 5, 4]
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(0.5)


def test_reference_counts_never_go_negative():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="negative"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    with pytest.raises(AssertionError):
        pool.get_new_blocks(3)


def test_cache_full_blocks_revive_and_evict_with_events():
    events = KVEventBuffer(clock=lambda: 42.0)
    pool = BlockPool(4, enable_caching=True, event_buffer=events)  # usable 1..3
    request = make_request(list(range(10)))  # 2 full blocks of 4 + 2 tokens
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 2, 4)
    (stored,) = events.take()
    assert stored.seq == 0 and stored.timestamp == 42.0
    assert stored.event == BlockStored(
        block_hashes=[h.hex() for h in request.block_hashes[:2]],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
    )
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert blocks[1].token_ids == (4, 5, 6, 7)
    pool.free_blocks(reversed(blocks))
    assert free_order(pool) == [3, 2, 1]
    # A free cached block is revived by touch and stays cached.
    pool.touch([blocks[0]])
    assert free_order(pool) == [3, 2] and blocks[0].block_hash == request.block_hashes[0]
    # Popping a cached free block evicts its hash.
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    (removed,) = events.take()
    assert removed.seq == 1 and removed.event == BlockRemoved([request.block_hashes[1].hex()])
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]


def test_duplicate_content_keeps_first_block_and_splits_events():
    events = KVEventBuffer()
    pool = BlockPool(8, event_buffer=events)
    r1 = make_request(list(range(12)), rid="a")
    r2 = make_request(list(range(12)), rid="b")
    b1 = pool.get_new_blocks(3)
    b2 = pool.get_new_blocks(3)
    pool.cache_full_blocks(r1, b1, 0, 1, 4)  # r1 cached block 0 only so far
    pool.cache_full_blocks(r2, b2, 0, 3, 4)  # r2: block 0 duplicate, blocks 1-2 new
    assert b2[0].block_hash is None and pool.get_cached_block(r1.block_hashes[0]) is b1[0]
    first, second = events.take()
    assert [first.seq, second.seq] == [0, 1]
    assert second.event.parent_block_hash == r1.block_hashes[0].hex()
    assert second.event.block_hashes == [h.hex() for h in r2.block_hashes[1:3]]
    assert second.event.token_ids == list(range(4, 12))


def test_reset_prefix_cache():
    events = KVEventBuffer()
    pool = BlockPool(4, event_buffer=events)
    request = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 4)
    assert pool.reset_prefix_cache() is False  # blocks in use
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in pool.blocks)
    assert isinstance(events.take()[-1].event, AllBlocksCleared)


def test_no_caching_means_no_hashes_and_no_events():
    events = KVEventBuffer()
    pool = BlockPool(4, enable_caching=False, event_buffer=events)
    request = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 4)
    assert pool.cached_block_hash_to_block == {} and len(events) == 0


def test_event_buffer_bounded_and_to_dict():
    buffer = KVEventBuffer(max_events=2, clock=lambda: 1.5)
    for i in range(5):
        buffer.emit(BlockRemoved([f"{i:02x}"]))
    taken = buffer.take()
    assert [e.seq for e in taken] == [3, 4] and buffer.num_dropped == 3
    assert buffer.take() == [] and buffer.next_seq == 5
    assert taken[0].to_dict() == {"seq": 3, "ts": 1.5, "type": "BlockRemoved", "block_hashes": ["03"], "medium": "GPU"}
    stored = BlockStored(["aa"], None, [1, 2], 2).to_dict()
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None and stored["block_size"] == 2
    assert AllBlocksCleared().to_dict() == {"type": "AllBlocksCleared"}
    with pytest.raises(ValueError):
        KVEventBuffer(max_events=0)


def test_received_blocks_are_cached_under_their_hashes_with_events_split_at_held_ones():
    from pagoda.contracts.block_hash import hash_prompt_blocks

    pool = BlockPool(8)
    tokens = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    hashes = hash_prompt_blocks([t for block in tokens for t in block], 4, "m")
    held = pool.get_new_blocks(1)[0]  # block 1 already holds the middle block's content
    held.block_hash, held.token_ids = hashes[1], tuple(tokens[1])
    pool.cached_block_hash_to_block[hashes[1]] = held
    pool.event_buffer.take()

    received = pool.get_new_blocks(3)
    assert pool.cache_received_blocks(received, hashes, tokens, None, cache_salt="s") == 2
    assert [pool.get_cached_block(h) for h in hashes] == [received[0], held, received[2]]
    assert received[1].block_hash is None, "a hash already cached keeps its block"
    events = [e.event for e in pool.event_buffer.take()]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.cache_salt) for e in events] == [
        ([hashes[0].hex()], None, tokens[0], "s"), ([hashes[2].hex()], hashes[1].hex(), tokens[2], "s")]
    pool.free_blocks(reversed(received))
    assert pool.num_free_blocks == 6 and pool.get_cached_block(hashes[2]) is received[2], "free but cached"
