"""KV cache groups: specs, grouping, capacity, sliding-window freeing and prefix hits across groups."""

import pytest

from pagoda.contracts import vllm_kv_events as wire
from pagoda.contracts.kv_events import BlockRemoved, BlockStored, KVEventBuffer
from pagoda.engine.kv.block_pool import BlockPool
from pagoda.engine.kv.kv_cache_manager import KVCacheManager
from pagoda.engine.kv.layout import group_layers, plan_capacity
from pagoda.engine.kv.specs import (FullAttentionSpec, MLALatentSpec, RecurrentStateSpec, SharedKVSpec,
                                    SlidingWindowSpec)
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams

BS = 4
FULL = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype_bytes=4)
SLIDE = SlidingWindowSpec(num_kv_heads=2, head_dim=8, dtype_bytes=4, window=6)
STATE = RecurrentStateSpec(conv_shape=(24, 3), ssm_shape=(2, 8, 8), conv_dtype_bytes=4, ssm_dtype_bytes=4)


def make_request(rid, tokens, salt=None):
    request = Request(rid, list(tokens), SamplingParams(max_tokens=64), cache_salt=salt)
    request.init_block_hashes(BS, "m")
    return request


def make_manager(specs, num_blocks, events=None):
    layout = plan_capacity(group_layers(specs, BS), 0, max_num_seqs=4, num_blocks=num_blocks, num_state_slots=8)
    pool = BlockPool(num_blocks, event_buffer=events)
    state_pool = BlockPool(layout.num_state_slots, event_buffer=pool.event_buffer) if layout.state_group else None
    return pool, KVCacheManager(pool, BS, layout=layout, state_pool=state_pool)


def step(manager, request, num_tokens):
    """What the scheduler does for one step: allocate, advance, cache (the step applied)."""
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens
    manager.cache_blocks(request)


# Specs and grouping ---------------------------------------------------------------------

def test_specs_count_their_bytes():
    assert FULL.page_bytes(16) == 2 * 16 * 2 * 8 * 4
    assert SLIDE.page_bytes(16) == FULL.page_bytes(16)  # same page: they share the block pool
    assert STATE.slot_bytes() == (24 * 3 + 2 * 8 * 8) * 4
    assert MLALatentSpec(kv_lora_rank=512, rope_dim=64, dtype_bytes=2).page_bytes(16) == 16 * 576 * 2
    # A sliding window's worst case is bounded by the window and the chunk, not the length.
    assert SLIDE.max_live_blocks(10_000, BS, max_chunk=8) == -(-(6 - 1 + 8) // BS) + 1
    assert FULL.max_live_blocks(10_000, BS, max_chunk=8) == 2500
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(2, 8, 4, window=0)


def test_gemma3_pattern_groups_share_tensors_by_position():
    specs = [FULL if (i + 1) % 6 == 0 else SLIDE for i in range(12)]  # layers 5 and 11 global
    layout = group_layers(specs, BS)
    assert layout.group_size == 2
    assert [(g.spec.kind, g.layer_ids) for g in layout.groups] == [
        ("full_attention", (5, 11)), ("sliding_window", (0, 1)), ("sliding_window", (2, 3)),
        ("sliding_window", (4, 6)), ("sliding_window", (7, 8)), ("sliding_window", (9, 10))]
    assert layout.layer_slots[11] == (0, 1) and layout.layer_slots[6] == (3, 1)
    assert layout.block_bytes == 2 * FULL.page_bytes(BS)  # one page per shared tensor
    uniform = group_layers(specs, BS, uniform=True)
    assert [g.layer_ids for g in uniform.groups] == [tuple(range(12))] and uniform.group_size == 12


def test_hybrid_groups_put_states_in_their_own_pool():
    specs = [STATE, STATE, STATE, FULL] * 2
    layout = plan_capacity(group_layers(specs, BS), budget_bytes=10_000_000, max_num_seqs=4)
    assert [(g.spec.kind, g.layer_ids) for g in layout.groups] == [("full_attention", (3, 7)),
                                                                   ("mamba", (0, 1, 2, 4, 5, 6))]
    assert layout.num_state_slots == 9  # a working slot and a checkpoint per sequence, and the null slot
    assert layout.slot_bytes == 6 * STATE.slot_bytes()
    left = 10_000_000 - 9 * layout.slot_bytes
    assert layout.num_blocks == left // layout.block_bytes
    # A tight budget: at most half of it goes to states.
    tight = plan_capacity(group_layers(specs, BS), budget_bytes=40 * layout.slot_bytes, max_num_seqs=64)
    assert tight.num_state_slots == 20
    with pytest.raises(ValueError, match="recurrent-state slots"):
        plan_capacity(group_layers(specs, BS), budget_bytes=layout.slot_bytes, max_num_seqs=4)


def test_unequal_pages_are_padded_to_the_largest():
    """Gemma 4's shape: sliding layers of head_dim 8 beside full ones of 16 share the pool; the
    sliding group's pages are padded (two sub-blocks per block id), the block takes the largest."""
    wide = FullAttentionSpec(num_kv_heads=2, head_dim=16, dtype_bytes=4)
    layout = plan_capacity(group_layers([SLIDE, SLIDE, wide, SharedKVSpec(0), SharedKVSpec(2)], BS), 10_000, 4)
    assert [(g.spec.kind, g.layer_ids, g.page_stride) for g in layout.groups] == [
        ("full_attention", (2,), 1), ("sliding_window", (0,), 2), ("sliding_window", (1,), 2)]
    assert layout.is_padded and layout.page_bytes == wide.page_bytes(BS) == 2 * SLIDE.page_bytes(BS)
    assert layout.block_bytes == wide.page_bytes(BS)  # group_size 1: one tensor position
    assert layout.num_blocks == 10_000 // layout.block_bytes
    assert layout.layer_slots[3:] == ((1, 0), (0, 0))  # the shared layers read their targets' slots
    assert not group_layers([FULL, SLIDE], BS).is_padded


def test_grouping_refuses_what_cannot_share_the_pool():
    odd = FullAttentionSpec(num_kv_heads=3, head_dim=8, dtype_bytes=4)
    with pytest.raises(ValueError, match="which every page must divide"):
        group_layers([FULL, odd], BS)
    with pytest.raises(ValueError, match="layer 1 shares layer 2's cache, which has none"):
        group_layers([FULL, SharedKVSpec(2), SharedKVSpec(0)], BS)
    with pytest.raises(ValueError, match="without an attention layer"):
        group_layers([STATE, STATE], BS)
    layout = group_layers([FULL, SharedKVSpec(0), FULL], BS)
    assert layout.layer_slots == ((0, 0), (0, 0), (0, 1))  # layer 1 reads layer 0's cache


# Sliding windows ------------------------------------------------------------------------

def test_sliding_window_memory_stays_bounded_over_a_long_generation():
    pool, manager = make_manager([SLIDE, SLIDE], num_blocks=8)  # 7 usable blocks: 28 tokens without freeing
    request = make_request("a", range(5))
    step(manager, request, 5)
    live = []
    for t in range(200):  # decode far past what the pool could hold without freeing
        request.append_output_token_ids(1000 + t)
        step(manager, request, 1)
        live.append(pool.num_usable_blocks - pool.num_free_blocks)
    assert max(live) <= SLIDE.max_live_blocks(10_000, BS, max_chunk=1) == 3
    table = manager.get_blocks("a")
    assert len(table) == -(-request.num_computed_tokens // BS)  # the table keeps positions
    start = request.num_computed_tokens - 1  # the last allocation freed what its query could not read
    first_needed = (start - SLIDE.window + 1) // BS
    assert all(b.is_null for b in table[:first_needed]) and not any(b.is_null for b in table[first_needed:])
    manager.free(request)
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_sliding_window_hit_needs_only_the_window_and_is_found_from_the_right():
    pool, manager = make_manager([SLIDE], num_blocks=16)
    a = make_request("a", range(20))
    step(manager, a, 20)  # blocks 0..4 full and cached
    manager.free(a)
    b = make_request("b", list(range(20)) + [7])
    hit = manager.find_cache_hit(b)
    assert hit.num_tokens == 20
    # The next query (position 20) reads keys 15..19: blocks 3 and 4; the rest are null.
    assert [blk.is_null for blk in hit.blocks[0]] == [True, True, True, False, False]
    # Evict block 1 (not in the window): the hit does not change; evict block 3: it shrinks.
    pool.hash_map(0).pop(b.block_hashes[1])
    assert manager.find_cache_hit(b).num_tokens == 20
    pool.hash_map(0).pop(b.block_hashes[3])
    # No two cached blocks end a window any more; block 0 alone still serves position 4.
    assert manager.find_cache_hit(b).num_tokens == 4


def test_hit_counts_only_where_every_group_has_it():
    events = KVEventBuffer()
    pool, manager = make_manager([FULL, SLIDE], num_blocks=20, events=events)
    a = make_request("a", range(24), salt="t")
    step(manager, a, 24)
    manager.free(a)
    b = make_request("b", list(range(24)) + [9], salt="t")
    assert manager.find_cache_hit(b).num_tokens == 24
    pool.hash_map(1).pop(b.block_hashes[5])  # the sliding group lost its last block
    hit = manager.find_cache_hit(b)
    # The full group alone would hit 24; the window (blocks 3, 4 before position 20) holds at 20.
    assert (hit.num_tokens, hit.num_attention_tokens) == (20, 24)
    assert len(hit.blocks[0]) == len(hit.blocks[1]) == 5
    assert manager.find_cache_hit(make_request("c", list(range(24)) + [9], salt="u")).num_tokens == 0
    stored = [e.event for e in events.take() if isinstance(e.event, BlockStored)]
    assert {(e.group_idx, e.kv_cache_spec_kind, e.sliding_window) for e in stored} == {
        (0, "full_attention", None), (1, "sliding_window", 6)}


def test_group_events_keep_vllms_wire_form():
    stored = BlockStored(["ab" * 32], None, [1, 2, 3, 4], 4, group_idx=1, kv_cache_spec_kind="sliding_window",
                         sliding_window=6)
    removed = BlockRemoved(["ab" * 32], group_idx=1)
    batch = wire.decode_batch(wire.encode_batch(wire.make_batch(
        [KVEventBuffer().emit(stored), KVEventBuffer().emit(removed)], ts=1.0)))
    assert (batch.events[0].group_idx, batch.events[0].kv_cache_spec_kind,
            batch.events[0].kv_cache_spec_sliding_window) == (1, "sliding_window", 6)
    assert batch.events[1].group_idx == 1
    assert stored.to_dict()["group_idx"] == 1 and "group_idx" not in BlockStored([], None, [], 4).to_dict()


def test_evictions_name_their_group():
    events = KVEventBuffer()
    pool, manager = make_manager([FULL, SLIDE], num_blocks=5, events=events)  # 4 usable
    a = make_request("a", range(8))
    step(manager, a, 8)  # 2 blocks per group, cached
    manager.free(a)
    events.take()
    b = make_request("b", range(100, 115))
    assert manager.allocate_slots(b, 8) is not None  # evicts all four
    removed = [e.event for e in events.take() if isinstance(e.event, BlockRemoved)]
    assert sorted((e.group_idx, len(e.block_hashes)) for e in removed) == [(0, 2), (1, 2)]


def test_fork_shares_every_group_and_skips_null_blocks():
    pool, manager = make_manager([FULL, SLIDE], num_blocks=30)
    parent = make_request("p", range(30))
    step(manager, parent, 30)
    manager.allocate_slots(parent, 1)  # frees the sliding blocks before the next query's window
    child = make_request("c", range(30))
    assert manager.fork(parent, child, 30) == 30
    assert manager.get_group_block_ids("c")[1][:4] == [0, 0, 0, 0]  # null entries stay null
    assert len(manager.take_copies()) == 2  # each group copies the partial last block
    manager.free(child)
    manager.free(parent)
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_the_cpu_tier_keeps_swaps_only_when_windows_have_their_own_group(caplog):
    from pagoda.engine.kv.kv_cache_manager import make_kv_cache

    layout = plan_capacity(group_layers([FULL, SLIDE], BS), 0, max_num_seqs=4, num_blocks=8)
    with caplog.at_level("WARNING"):
        _, tier = make_kv_cache(layout, True, KVEventBuffer(), num_host_blocks=4, preemption_mode="swap")
    assert tier.is_enabled and not tier.enable_prefix_tier
    assert "holds swapped requests only" in caplog.text and "2 paged KV cache groups" in caplog.text
    single = plan_capacity(group_layers([FULL, FULL], BS), 0, max_num_seqs=4, num_blocks=8)
    assert make_kv_cache(single, True, KVEventBuffer(), num_host_blocks=4)[1].enable_prefix_tier
