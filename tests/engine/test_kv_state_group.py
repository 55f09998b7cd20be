"""The recurrent-state group: working slots, checkpoints at block boundaries, restores, swaps."""

from pagoda.contracts.kv_events import BlockStored, KVEventBuffer
from pagoda.engine.kv.block_pool import BlockPool
from pagoda.engine.kv.host_tier import KVOffloadManager
from pagoda.engine.kv.kv_cache_manager import KVCacheManager
from pagoda.engine.kv.layout import group_layers, plan_capacity
from pagoda.engine.kv.specs import FullAttentionSpec, RecurrentStateSpec
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams

BS = 4
FULL = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype_bytes=4)
STATE = RecurrentStateSpec(conv_shape=(24, 3), ssm_shape=(2, 8, 8), conv_dtype_bytes=4, ssm_dtype_bytes=4)


def make(num_blocks=40, num_slots=6, interval=0, events=None):
    layout = plan_capacity(group_layers([STATE, STATE, FULL], BS), 0, max_num_seqs=2, num_blocks=num_blocks,
                           num_state_slots=num_slots)
    pool = BlockPool(num_blocks, event_buffer=events)
    state_pool = BlockPool(num_slots, event_buffer=pool.event_buffer)
    return KVCacheManager(pool, BS, layout=layout, state_pool=state_pool, checkpoint_interval=interval)


def make_request(rid, tokens, salt=None):
    request = Request(rid, list(tokens), SamplingParams(max_tokens=64), cache_salt=salt)
    request.init_block_hashes(BS, "m")
    return request


def run_prompt(manager, request, budget=1000):
    """Schedule a prompt as the scheduler does: chunks cut at checkpoints; returns the chunks and copies."""
    chunks, copies = [], []
    while request.num_computed_tokens < request.num_tokens:
        num = min(request.num_tokens - request.num_computed_tokens, budget)
        num = manager.cut_at_checkpoint(request, request.num_computed_tokens, num)
        assert manager.allocate_slots(request, num) is not None
        copies.append(manager.take_state_copies())
        request.num_computed_tokens += num
        manager.cache_blocks(request)
        chunks.append(num)
    return chunks, copies


def test_a_prompt_checkpoints_at_its_last_block_boundary_and_a_repeat_resumes_there():
    events = KVEventBuffer()
    manager = make(events=events)
    a = make_request("a", range(14))
    chunks, copies = run_prompt(manager, a)
    assert chunks == [12, 2]  # cut at the last boundary before the prompt's end (12)
    slot = manager.state.slot_id("a")
    (before, after), _ = copies
    assert before == [] and len(after) == 1 and after[0][0] == slot  # working slot -> checkpoint, after the forward
    checkpoint = after[0][1]
    stored = [e.event for e in events.take() if isinstance(e.event, BlockStored) and e.event.group_idx == 1]
    assert [(e.kv_cache_spec_kind, e.block_hashes) for e in stored] == [("mamba", [a.block_hashes[2].hex()])]
    manager.free(a)

    b = make_request("b", range(14))
    hit = manager.find_cache_hit(b)
    assert hit.num_tokens == 12 and hit.blocks[1][-1].block_id == checkpoint
    assert manager.allocate_slots(b, 2, hit) is not None
    before, after = manager.take_state_copies()
    assert before == [(checkpoint, manager.state.slot_id("b"))] and after == []
    assert (manager.state.num_restored, manager.state.num_restored_tokens) == (1, 12)


def test_no_checkpoint_no_hit_even_when_attention_blocks_are_cached():
    manager = make()
    a = make_request("a", range(14))
    assert manager.allocate_slots(a, 14) is not None  # one chunk: no step ended at a checkpoint
    manager.take_state_copies()
    a.num_computed_tokens = 14
    manager.cache_blocks(a)
    b = make_request("b", list(range(14)) + [5])
    hit = manager.find_cache_hit(b)
    assert (hit.num_tokens, hit.num_attention_tokens) == (0, 12)


def test_a_shared_prefix_leaves_a_checkpoint_at_the_junction():
    manager = make()
    system = list(range(100, 110))  # 10 tokens: blocks 0, 1 full
    a = make_request("a", system + [1, 2, 3, 4, 5])
    run_prompt(manager, a)  # checkpoint at 12 (its prompt end), not at 8
    b = make_request("b", system + [7, 7, 7, 7])
    hit = manager.find_cache_hit(b)
    assert (hit.num_tokens, hit.num_attention_tokens) == (0, 8)  # attention would hit 8; no state there
    assert manager.cut_at_checkpoint(b, 0, 14, hit) == 8
    assert manager.allocate_slots(b, 8, hit) is not None
    b.num_computed_tokens = 8  # the first chunk ended at the junction
    manager.cache_blocks(b)
    manager.take_state_copies()
    c = make_request("c", system + [9, 9, 9])
    assert manager.find_cache_hit(c).num_tokens == 8  # the third request sharing the prefix resumes it


def test_periodic_checkpoints_cut_long_prompts():
    manager = make(interval=8)
    a = make_request("a", range(21))
    chunks, _ = run_prompt(manager, a)
    assert chunks == [8, 8, 4, 1]  # 8 and 16 (interval), 20 (the prompt's last boundary)
    assert manager.state.num_checkpoints == 3


def test_salts_isolate_checkpoints():
    manager = make()
    run_prompt(manager, make_request("a", range(14), salt="t1"))
    assert manager.find_cache_hit(make_request("b", range(14), salt="t2")).num_tokens == 0
    assert manager.find_cache_hit(make_request("c", range(14), salt="t1")).num_tokens == 12


def test_without_free_slots_a_checkpoint_is_skipped_and_admission_waits():
    manager = make(num_slots=3)  # null + 2
    a = make_request("a", range(14))
    b = make_request("b", range(50, 64))
    assert manager.allocate_slots(a, 12) is not None  # working slot + checkpoint slot
    assert manager.allocate_slots(b, 4) is None  # no slot left for b's working state
    manager.take_state_copies()
    a.num_computed_tokens = 12
    manager.cache_blocks(a)  # the checkpoint is applied: free and cached
    assert manager.allocate_slots(b, 12) is not None  # b evicts a's checkpoint for its working slot
    assert manager.state.pool.num_free_blocks == 0
    assert manager.take_state_copies() == ([], [])  # b's checkpoint at 12 was skipped: no slot


def test_a_request_freed_in_its_step_leaves_no_copy_behind():
    manager = make()
    a = make_request("a", range(14))
    assert manager.allocate_slots(a, 12) is not None
    manager.free(a)  # preempted in the same step: its slots may be handed out again at once
    assert manager.take_state_copies() == ([], [])
    assert manager.state.pool.num_free_blocks == manager.state.pool.num_usable_blocks


def test_swap_moves_the_state_slot_with_the_blocks():
    manager = make()
    tier = KVOffloadManager(num_host_blocks=8, block_size=BS, preemption_mode="swap", num_host_state_slots=2)
    a = make_request("a", range(10))
    assert manager.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    blocks, slot = manager.get_swap_block_ids(a)
    assert len(blocks) == 3 and slot == manager.state.slot_id("a")
    assert tier.swap_out("a", blocks, slot)
    manager.free(a)
    assert tier.take_state_copies() == ([(slot, 0)], [])
    assert manager.allocate_slots(a, 1) is not None
    new_blocks, new_slot = manager.get_swap_block_ids(a)
    tier.swap_in("a", new_blocks, new_slot)
    assert tier.take_state_copies() == ([], [(0, new_slot)])
    assert tier.states.num_free_slots == 2
    assert tier.swap_out("b", [], 5) and tier.swap_out("c", [], 6)
    assert not tier.swap_out("d", [], 7)  # no host state slot left: the victim recomputes instead


def test_decode_keeps_only_its_latest_checkpoint_and_the_next_turn_resumes_it():
    manager = make()
    a = make_request("a", range(6))
    run_prompt(manager, a)  # checkpoint at 4 (the prompt's last boundary)
    for t in range(11):  # decode to 17 tokens: boundaries 8, 12 and 16 reached by decode steps
        a.append_output_token_ids(100 + t)
        assert manager.allocate_slots(a, 1) is not None
        manager.take_state_copies()
        a.num_computed_tokens += 1
        manager.cache_blocks(a)
    cached = {i for i, h in enumerate(a.block_hashes) if manager.state.pool.get_cached_block(h, 1) is not None}
    assert cached == {0, 3}  # the prompt's (position 4) and the latest decode one (16); 8 and 12 forgotten
    manager.free(a)
    turn2 = make_request("b", a.all_token_ids + [7, 7, 7])
    assert manager.find_cache_hit(turn2).num_tokens == 16


def test_host_tier_blocks_extend_a_hit_only_up_to_a_checkpoint():
    """Group 0's blocks from the CPU tier continue the device hit; the state group follows
    only to its last checkpoint among them (or not at all)."""
    manager = make()
    a = make_request("a", range(14))
    run_prompt(manager, a)  # checkpoint at 12
    b = make_request("b", list(range(14)) + [1])
    hit = manager.find_cache_hit(b)
    assert hit.num_tokens == 12
    device_only = manager.find_cache_hit(make_request("c", list(range(14)) + [1]))
    device_only.blocks[0] = device_only.blocks[0][:1]  # as if blocks 1-2 now lived in the host tier
    device_only.num_attention_tokens = 4
    extended, num_host, host_state = manager.usable_loaded_blocks(device_only, 2, b)
    assert num_host == 2 and len(extended.blocks[1]) == 3 and host_state is None  # up to the checkpoint at 12
    assert manager.usable_loaded_blocks(device_only, 1, b)[1] == 0  # no checkpoint at 8: no host blocks


def test_a_prompt_shorter_than_a_block_takes_no_checkpoint():
    manager = make()
    a = make_request("a", range(3))
    chunks, copies = run_prompt(manager, a)
    assert chunks == [3] and copies == [([], [])]
