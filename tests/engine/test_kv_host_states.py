"""The CPU tier's state slots (``kv.host_states``): evicted state checkpoints kept on the host and
restored, beside group 0's blocks, so a hybrid's prefix evicted from the device is not recomputed."""

from pagoda.contracts.kv_events import KVEventBuffer
from pagoda.engine.kv.kv_cache_manager import make_kv_cache
from pagoda.engine.kv.layout import group_layers, plan_capacity

from tests.engine.test_kv_state_group import BS, FULL, STATE, make_request, run_prompt


def make(num_blocks=12, num_slots=4, num_host_state_slots=3):
    layout = plan_capacity(group_layers([STATE, STATE, FULL], BS), 0, max_num_seqs=2, num_blocks=num_blocks,
                           num_state_slots=num_slots)
    return make_kv_cache(layout, True, KVEventBuffer(), num_host_blocks=16,
                         num_host_state_slots=num_host_state_slots, preemption_mode="recompute")


def evict(pool):
    """Take every free block of ``pool`` (evicting the cached ones) and give them back."""
    blocks = pool.get_new_blocks(pool.num_free_blocks)
    pool.free_blocks(blocks)


def lookup(manager, tier, request):
    hit = manager.find_cache_hit(request)
    host = tier.lookup_prefix(request.block_hashes, request.all_token_ids, hit.num_attention_tokens // BS,
                              (request.num_tokens - 1) // BS)
    return hit, host, manager.usable_loaded_blocks(hit, len(host), request, tier.states)


def test_an_evicted_checkpoint_goes_to_the_host_and_comes_back_with_the_blocks():
    manager, tier = make()
    a = make_request("a", range(14))
    run_prompt(manager, a)  # blocks 0-2 cached, the state checkpointed at 12
    checkpoint = manager.state.pool.get_cached_block(a.block_hashes[2], 1)
    manager.free(a)
    evict(manager.state.pool)
    evict(manager.block_pool)
    state_out, state_in = tier.take_state_copies()
    assert len(state_out) == 1 and state_out[0][0] == checkpoint.block_id and state_in == []
    assert tier.states.num_offloaded == 1 and tier.num_offloaded_blocks == 3
    tier.take_copies()

    b = make_request("b", list(range(14)) + [1])
    hit, host, (extended, num_host, host_state) = lookup(manager, tier, b)
    assert hit.num_tokens == 0 and len(host) == 3
    assert num_host == 3 and host_state is not None and extended.blocks[1] == []
    tier.pin(host[:num_host])
    tier.states.pin(host_state)
    new_blocks = manager.allocate_slots(b, 3, extended, num_host)
    assert new_blocks is not None
    tier.copy_back(host, [blk.block_id for blk in new_blocks[:3]])
    tier.restore_state(host_state, manager.working_slot("b"), 12, 0)
    assert tier.take_state_copies() == ([], [(host_state.block_id, manager.working_slot("b"))])
    assert len(tier.take_copies()[2]) == 3 and tier.prefix_cache_hits_host == 12
    assert tier.states.num_restored == 1 and tier.states.num_free_slots == 3  # unpinned once copies are taken
    manager.free(b)


def test_a_host_checkpoint_makes_the_device_blocks_usable_again():
    """The attention blocks stayed on the device, only the checkpoint was evicted: the hit is the
    device blocks plus the host state (counted as a host hit), not zero."""
    manager, tier = make()
    a = make_request("a", range(14))
    run_prompt(manager, a)
    manager.free(a)
    evict(manager.state.pool)
    tier.take_state_copies()
    b = make_request("b", list(range(14)) + [1])
    hit, host, (extended, num_host, host_state) = lookup(manager, tier, b)
    assert hit.num_tokens == 0 and hit.num_attention_tokens == 12 and host == []
    assert num_host == 0 and host_state is not None and len(extended.blocks[0]) == 3
    assert extended.num_tokens == 12


def test_a_swap_takes_the_slot_of_a_cached_host_checkpoint():
    manager, tier = make(num_host_state_slots=1)
    a = make_request("a", range(14))
    run_prompt(manager, a)
    manager.free(a)
    evict(manager.state.pool)
    tier.take_state_copies()
    assert tier.states.num_free_slots == 1  # cached but free: a swap may take it
    assert tier.swap_out("victim", [], 3)
    assert tier.states.pool.get_cached_block(a.block_hashes[2]) is None  # the checkpoint gave way
    assert tier.take_state_copies() == ([(3, 0)], [])
    tier.free_request("victim")
    assert tier.states.num_free_slots == 1


def test_without_a_host_tier_nothing_is_found_or_offloaded():
    layout = plan_capacity(group_layers([STATE, FULL], BS), 0, max_num_seqs=2, num_blocks=12, num_state_slots=4)
    manager, tier = make_kv_cache(layout, True, KVEventBuffer())
    a = make_request("a", range(14))
    run_prompt(manager, a)
    manager.free(a)
    evict(manager.state.pool)
    hit, host, (extended, num_host, host_state) = lookup(manager, tier, make_request("b", list(range(14)) + [1]))
    assert (extended.num_tokens, num_host, host_state) == (0, 0, None)
