"""KV transfer of hybrid models (pure parts): which layouts a connector serves, and an offer that
carries a recurrent-state checkpoint (``Offer.has_state``). The engine-level check, a prompt moved
between two replicas and hit there, is ``test_hybrid_engine.py``."""

import pytest

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.engine.kv.layout import group_layers, plan_capacity
from pagoda.engine.kv.specs import SlidingWindowSpec
from pagoda.engine.kv_transfer.connector import check_layout
from pagoda.engine.kv_transfer.offer import Offer, check_offer

from tests.engine.test_kv_state_group import BS, FULL, STATE

LAYOUT = {"dtype": "float32", "block_bytes": 64, "state_bytes": 1000}


def _layout(specs):
    return plan_capacity(group_layers(specs, BS), 0, max_num_seqs=2, num_blocks=8, num_state_slots=4)


def test_connectors_serve_a_hybrid_only_when_they_carry_states_and_never_a_sliding_window():
    hybrid = _layout([STATE, FULL])
    check_layout(hybrid, carries_states=True)
    with pytest.raises(ValueError, match=r"2 groups \(full_attention, mamba\).*moves no recurrent-state checkpoint"):
        check_layout(hybrid, carries_states=False)
    window = SlidingWindowSpec(num_kv_heads=2, head_dim=8, dtype_bytes=4, window=8)
    for carries in (True, False):
        with pytest.raises(ValueError, match="window's blocks.*kv_cache_layout='uniform'"):
            check_layout(_layout([window, FULL]), carries_states=carries)


def test_an_offer_with_a_state_round_trips_and_sizes_its_payloads():
    tokens = list(range(3 * BS))
    offer = Offer("t", "m", BS, LAYOUT, hash_prompt_blocks(tokens, BS, "m"),
                  [tokens[i:i + BS] for i in range(0, len(tokens), BS)], has_state=True)
    again = Offer.from_json(offer.to_json())
    assert again == offer and again.num_payloads == 4
    assert [again.payload_bytes(i) for i in range(4)] == [64, 64, 64, 1000]
    assert check_offer(again, "m", BS, LAYOUT) is None
    assert "has_state" not in Offer.from_json({**offer.to_json(), "has_state": False}).to_json()
    no_state = {"dtype": "float32", "block_bytes": 64}
    stray = Offer("t", "m", BS, no_state, offer.block_hashes, offer.token_ids, has_state=True)
    assert "carries a recurrent state" in check_offer(stray, "m", BS, no_state)


def test_blocks_taken_for_a_commit_drop_what_they_evict_instead_of_offloading_it():
    """A received block is written at once, between steps; the CPU tier's copy of a block it
    evicts would run only at the next step, after the write, so the commit drops evicted blocks."""
    from pagoda.engine.kv.block_pool import BlockPool
    from pagoda.engine.kv_transfer.tcp_receiver import new_blocks_dropping_evicted

    from tests.engine.test_kv_state_group import make_request

    pool = BlockPool(3)
    offered = []
    pool.on_evict = offered.append
    request = make_request("a", range(2 * BS))
    blocks = pool.get_new_blocks(2)
    for i, block in enumerate(blocks):
        assert pool.cache_block(request, block, i, BS)
    pool.free_blocks(blocks)
    taken = new_blocks_dropping_evicted(pool, 2)
    assert offered == [] and pool.on_evict == offered.append
    assert pool.get_cached_block(request.block_hashes[0]) is None  # evicted, and gone
    pool.free_blocks(taken)
    pool.get_new_blocks(1)
    assert offered == []  # freed uncached: nothing left to offer
