"""KV cache manager: allocation, prefix hits (capped, token-checked), sharing, freeing."""

import pytest

from pagoda.engine.kv.block_pool import BlockPool
from pagoda.engine.kv.kv_cache_manager import KVCacheManager
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams

BS = 4


def make(num_blocks=9, caching=True):
    pool = BlockPool(num_blocks, enable_caching=caching)
    return pool, KVCacheManager(pool, BS, enable_caching=caching)


def make_request(rid, tokens, salt=None):
    request = Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)
    request.init_block_hashes(BS, "m")
    return request


def compute(manager, request, num_tokens):
    """What the scheduler does: allocate, then advance and cache after the step."""
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens
    manager.cache_blocks(request)


def test_allocate_grows_block_table_and_returns_none_when_full():
    pool, manager = make(num_blocks=4)  # 3 usable
    request = make_request("a", list(range(6)))
    new = manager.allocate_slots(request, 6)
    assert [b.block_id for b in new] == [1, 2] and manager.get_block_ids("a") == [1, 2]
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2) == []  # still fits in block 2
    assert manager.allocate_slots(request, 7) is None  # needs 2 more, 1 free
    assert manager.get_block_ids("a") == [1, 2] and pool.num_free_blocks == 1
    manager.free(request)
    assert pool.num_free_blocks == 3 and manager.get_block_ids("a") == []
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [3, 2, 1]


def test_prefix_hit_is_shared_and_capped():
    pool, manager = make()
    a = make_request("a", list(range(8)))
    compute(manager, a, 8)
    # Fully cached prompt: the last token is recomputed, so only the first block hits.
    b = make_request("b", list(range(8)))
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4 and hit.device_blocks == manager.get_blocks("a")[:1]
    assert manager.allocate_slots(b, 4, hit) is not None
    assert manager.get_block_ids("b")[0] == manager.get_block_ids("a")[0]
    assert manager.get_blocks("a")[0].ref_cnt == 2
    # A longer prompt hits both blocks.
    c = make_request("c", list(range(8)) + [99])
    assert manager.get_computed_blocks(c)[1] == 8
    # Queries and hits are recorded only when asked (at admission), in tokens.
    manager.record_prefix_lookup(c.num_tokens, 8)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (9, 8)


def test_free_cached_blocks_are_revived_and_counted_against_free_space():
    pool, manager = make(num_blocks=4)  # 3 usable
    a = make_request("a", list(range(8)))
    compute(manager, a, 8)
    manager.free(a)
    assert pool.num_free_blocks == 3
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    # 2 revived + 2 new > 3 free: refused without side effects.
    assert manager.allocate_slots(b, 5, hit) is None
    assert pool.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in hit.device_blocks)
    assert manager.allocate_slots(b, 4, hit) is not None  # 2 revived + 1 new
    assert pool.num_free_blocks == 0


def test_different_salts_never_share():
    pool, manager = make()
    a = make_request("a", list(range(12)), salt="tenant-1")
    compute(manager, a, 12)
    assert manager.get_computed_blocks(make_request("b", list(range(12)), salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", list(range(12))))[1] == 0
    assert manager.get_computed_blocks(make_request("d", list(range(12)), salt="tenant-1"))[1] == 8


def test_output_token_blocks_are_cached():
    pool, manager = make()
    a = make_request("a", [1, 2, 3])
    compute(manager, a, 3)
    a.append_output_token_ids([4])
    compute(manager, a, 1)  # now 4 computed tokens: block 0 full and cached
    assert pool.get_cached_block(a.block_hashes[0]) is manager.get_blocks("a")[0]


def test_hit_requires_matching_tokens():
    pool, manager = make()
    a = make_request("a", list(range(9)))
    compute(manager, a, 9)
    manager.get_blocks("a")[0].token_ids = (9, 9, 9, 9)  # simulate a hash collision
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_caching_disabled():
    pool, manager = make(caching=False)
    a = make_request("a", list(range(9)))
    compute(manager, a, 9)
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    manager.record_prefix_lookup(9, 0)
    assert manager.prefix_cache_queries == 0


def test_allocate_rejects_nonpositive():
    _, manager = make()
    with pytest.raises(AssertionError):
        manager.allocate_slots(make_request("a", [1]), 0)
