"""KV offload: the CPU tier for preemption by swap and for evicted prefix blocks.

Scheduler bookkeeping is tested with fake runner outputs (no torch); the engine tests run
a tiny random model with a tiny device cache and compare outputs with runs that never
preempt or never hit the cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.contracts.kv_events import BlockRemoved, BlockStored
from pagoda.engine.kv.host_tier import HostBlockPool, KVOffloadManager
from pagoda.engine.kv.swap_cost import SwapCostModel
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig

from tests.engine.driving import drain


def make_scheduler(**overrides):
    values = dict(num_blocks=9, max_model_len=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                  num_host_blocks=16, preemption_mode="swap")
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def make_request(rid, prompt, max_tokens=4, arrival=0.0):
    if isinstance(prompt, int):
        prompt = [100 + i for i in range(prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival)


def step(scheduler, token=7):
    output = scheduler.schedule()
    sampled = {s.request.request_id: [token] for s in output.scheduled if s.is_sampling}
    return output, scheduler.update_from_output(ModelRunnerOutput.from_tokens(output.step_id, sampled))


def assert_all_free(scheduler):
    assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_usable_blocks
    if scheduler.host_tier.is_enabled:
        assert scheduler.host_tier.num_free_blocks == scheduler.host_tier.pool.num_blocks
        assert not scheduler.host_tier.req_to_host_blocks


# Cost model and configuration -----------------------------------------------------------


def test_cost_model_swaps_long_contexts_and_recomputes_short_ones():
    # Calibrated-looking numbers: 1 ms fixed per copy, 10 GB/s, 64 KiB blocks of 16 tokens,
    # 50 us per recomputed token. Swap = 2 * (1 ms + b * 6.6 us); recompute = n * 50 us.
    model = SwapCostModel(bytes_per_block=64 * 2**10, copy_bandwidth_bytes_per_s=10e9, copy_latency_s=1e-3,
                          prefill_s_per_token=50e-6)
    assert not model.prefers_swap(16, 1)  # 2.01 ms vs 0.8 ms
    assert not model.prefers_swap(32, 2)
    assert model.prefers_swap(2048, 128)  # 3.7 ms vs 102 ms
    assert model.swap_cost(128) == pytest.approx(2 * (1e-3 + 128 * 64 * 2**10 / 10e9))
    assert model.recompute_cost(2048) == pytest.approx(2048 * 50e-6)
    # The crossover sits between the two: find it and check it is monotone.
    choices = [model.prefers_swap(n, -(-n // 16)) for n in range(16, 4096, 16)]
    assert choices == sorted(choices) and True in choices and False in choices

    manager = KVOffloadManager(8, 16, "auto", model)
    assert manager.wants_swap(2048, 128) and not manager.wants_swap(16, 1)
    assert not manager.wants_swap(0, 0)
    assert not KVOffloadManager(8, 16, "auto", None).wants_swap(2048, 128)  # no model: recompute
    assert KVOffloadManager(8, 16, "swap").wants_swap(16, 1)
    assert not KVOffloadManager(8, 16, "recompute", model).wants_swap(2048, 128)


@pytest.mark.parametrize("field, value", [
    ("cpu_offload_bytes", -1), ("cpu_offload_bytes", 1.5), ("preemption_mode", "swap-ish"),
    ("offload_copy_bandwidth", 0.0), ("offload_copy_latency_s", -1.0), ("prefill_s_per_token", 0),
])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_swap_mode_without_a_cpu_tier_is_refused():
    with pytest.raises(ValueError, match="preemption_mode: 'swap' needs a CPU tier"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(num_blocks=9, max_model_len=64, preemption_mode="never")
    EngineConfig(preemption_mode="swap", cpu_offload_bytes=2**20)  # fine


def test_host_pool_lru_and_hash_map():
    pool = HostBlockPool(3)
    a, b, c = (pool.store_cached(h, (i,)) for i, h in enumerate((b"a", b"b", b"c")))
    assert [x.block_id for x in (a, b, c)] == [0, 1, 2]
    assert pool.store_cached(b"a", (0,)) is None  # already here: refreshed, no copy
    assert [x.block_id for x in pool.free_block_queue.get_all_free_blocks()] == [1, 2, 0]
    d = pool.store_cached(b"d", (3,))  # evicts the least recently used: b
    assert d.block_id == 1 and pool.get_cached_block(b"b") is None and pool.get_cached_block(b"d") is d
    owned = pool.allocate(2)  # a swap takes free blocks, evicting their hashes
    assert [x.block_id for x in owned] == [2, 0] and pool.get_cached_block(b"a") is None
    assert pool.allocate(2) is None and pool.num_free_blocks == 1
    pool.free(owned)
    assert pool.num_free_blocks == 3


# Scheduler bookkeeping (fake runner) ----------------------------------------------------


def test_swap_out_keeps_computed_tokens_and_swap_in_restores_them():
    scheduler = make_scheduler()  # 8 usable device blocks of 4 tokens
    scheduler.add_request(make_request("a", 8, max_tokens=20))  # 2 blocks, grows
    scheduler.add_request(make_request("b", 15, max_tokens=10, arrival=1.0))  # 4 blocks
    step(scheduler)  # a: 8 computed (2 blocks + 1), b: 15 computed
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    for _ in range(6):
        out, _ = step(scheduler)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["b"]
    assert scheduler.is_swapped_out("b") and b.status == RequestStatus.PREEMPTED
    num_computed = b.num_computed_tokens
    assert num_computed > 15  # kept, not reset
    host_ids = [blk.block_id for blk in scheduler.host_tier.req_to_host_blocks["b"]]
    assert len(host_ids) == -(-num_computed // 4)
    # The swap-out pairs are b's device blocks (as of the preemption) into its host blocks.
    assert [dst for _, dst in out.blocks_to_swap_out] == host_ids
    assert out.blocks_to_swap_in == [] and out.blocks_to_copy_back == []
    assert scheduler.num_recomputed_preemptions == 0 and scheduler.host_tier.num_swapped_out == 1

    while scheduler.is_swapped_out("b"):
        out, _ = step(scheduler)
    # Swapped back in: fresh device blocks filled from its host blocks, no recompute.
    assert [src for src, _ in out.blocks_to_swap_in] == host_ids
    assert [dst for _, dst in out.blocks_to_swap_in] == scheduler.kv_cache_manager.get_block_ids("b")[:len(host_ids)]
    scheduled_b = next(s for s in out.scheduled if s.request is b)
    assert scheduled_b.num_computed_tokens == num_computed and scheduled_b.num_new_tokens == 1
    assert scheduler.host_tier.num_swapped_in == 1
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert a.num_output_tokens == 20 and b.num_output_tokens == 10
    assert_all_free(scheduler)


def test_recompute_mode_and_full_host_pool_fall_back_to_recompute():
    for overrides in (dict(preemption_mode="recompute"), dict(num_host_blocks=1)):
        scheduler = make_scheduler(**overrides)
        scheduler.add_request(make_request("a", 8, max_tokens=20))
        scheduler.add_request(make_request("b", 15, max_tokens=10, arrival=1.0))
        preempted = []
        while scheduler.has_unfinished_requests():
            out, _ = step(scheduler)
            preempted += out.preempted_request_ids
            assert out.blocks_to_swap_in == []
        assert preempted and scheduler.num_recomputed_preemptions == len(preempted)
        assert scheduler.host_tier.num_swapped_out == 0
        assert_all_free(scheduler)


@pytest.mark.parametrize("latency_s, expect_swap", [(1e-3, True), (1.0, False)])
def test_auto_mode_follows_the_cost_model(latency_s, expect_swap):
    # b is preempted with ~17 computed tokens: 17 ms to recompute vs 2 x latency to swap.
    model = SwapCostModel(bytes_per_block=1024, copy_bandwidth_bytes_per_s=1e9, copy_latency_s=latency_s,
                          prefill_s_per_token=1e-3)
    scheduler = Scheduler(SchedulerConfig(num_blocks=9, max_model_len=256, block_size=4, max_num_batched_tokens=64,
                                          num_host_blocks=16, preemption_mode="auto"), swap_cost_model=model)
    scheduler.add_request(make_request("a", 8, max_tokens=20))
    scheduler.add_request(make_request("b", 15, max_tokens=10, arrival=1.0))
    while not scheduler.get_request("b").num_preemptions:
        step(scheduler)
    assert scheduler.is_swapped_out("b") == expect_swap
    assert scheduler.num_recomputed_preemptions == (0 if expect_swap else 1)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert_all_free(scheduler)


def test_abort_while_swapped_out_frees_host_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 8, max_tokens=20))
    scheduler.add_request(make_request("b", 15, max_tokens=10, arrival=1.0))
    while not scheduler.is_swapped_out("b"):
        step(scheduler)
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert scheduler.host_tier.num_free_blocks == 16
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert_all_free(scheduler)


def test_evicted_prefix_blocks_move_to_host_and_come_back():
    scheduler = make_scheduler(num_host_blocks=8)
    prefix = [500 + i for i in range(16)]  # 4 full blocks
    a = make_request("a", prefix + [1], max_tokens=1)
    scheduler.add_request(a)
    a_block_ids = step(scheduler)[0].scheduled[0].new_block_ids[0]  # a new request: its whole table
    assert_all_free(scheduler)
    cached = {blk.block_id for blk in scheduler.block_pool.cached_block_hash_to_block.values()}
    assert len(cached) == 4
    # b takes all 8 device blocks: the 4 cached ones are evicted and offered to the host.
    scheduler.add_request(make_request("b", 30, max_tokens=2))
    out, _ = step(scheduler)
    assert sorted(src for src, _ in out.blocks_to_swap_out) == sorted(cached)
    assert scheduler.host_tier.num_offloaded_blocks == 4
    host_of = {src: dst for src, dst in out.blocks_to_swap_out}
    # Device-tier events only: the blocks moving to the host are removed from the device.
    events = [e.event for e in scheduler.take_events()]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(h.hex() for h in a.block_hashes[:4])
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # Device tier: b's blocks were cached after a's were evicted; a's prefix is only on the host.
    scheduler.add_request(make_request("c", prefix + [2, 3], max_tokens=1))
    out, _ = step(scheduler)
    c = out.scheduled[0]
    assert c.num_computed_tokens == 16 and c.num_new_tokens == 2  # whole prefix from the host
    assert len(out.blocks_to_copy_back) == 4
    assert [src for src, _ in out.blocks_to_copy_back] == [host_of[d] for d in a_block_ids[:4]]
    assert c.is_new and [dst for _, dst in out.blocks_to_copy_back] == c.new_block_ids[0][:4]
    assert scheduler.host_tier.prefix_cache_hits_host == 16
    assert scheduler.prefix_cache_hits == 16 and c.request.num_cached_tokens == 16
    # The copied-back blocks are cached on the device again, and advertised as such.
    stored = [h for e in scheduler.take_events() if isinstance(e.event, BlockStored) for h in e.event.block_hashes]
    assert stored[:4] == [h.hex() for h in a.block_hashes[:4]]
    assert all(scheduler.block_pool.blocks[i].block_hash is not None for i in c.new_block_ids[0][:4])
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert_all_free(scheduler)
    assert scheduler.reset_prefix_cache() and not scheduler.host_tier.pool.cached_block_hash_to_block


# Engine end to end (tiny random model) ----------------------------------------------------


def _run(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finals = {rid: out.outputs[0].token_ids for rid, out in drain(engine).items()}
    return [finals[f"r{i}"] for i in range(len(prompts))]


def _assert_engine_all_free(engine):
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_free_host_blocks == stats.num_host_blocks


SWAP_PROMPTS = [[random.Random(3 + i).randrange(1000, 30000) for _ in range(40)] for i in range(3)]
SWAP_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def swap_reference(model_path):
    from pagoda.engine.llm_engine import LLMEngine

    return _run(LLMEngine(EngineConfig(model=model_path, enable_prefix_caching=False)), SWAP_PROMPTS, SWAP_PARAMS)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swapped_requests_resume_with_identical_output(model_path, swap_reference, prefix_caching):
    from pagoda.engine.llm_engine import LLMEngine

    # 6 usable blocks of 16 tokens; each request needs 4: running all three forces preemption.
    engine = LLMEngine(EngineConfig(model=model_path, num_gpu_blocks_override=7, preemption_mode="swap",
                                    cpu_offload_bytes=2**22, enable_prefix_caching=prefix_caching))
    assert _run(engine, SWAP_PROMPTS, SWAP_PARAMS) == swap_reference
    stats = engine.get_stats()
    assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert stats.num_recomputed_preemptions == 0 and stats.num_preemptions == stats.num_swapped_out
    _assert_engine_all_free(engine)


def test_prefix_hits_served_from_the_cpu_tier(model_path):
    from pagoda.engine.llm_engine import LLMEngine

    rng = random.Random(5)
    prefix = [rng.randrange(1000, 30000) for _ in range(96)]  # 6 blocks
    other = [rng.randrange(1000, 30000) for _ in range(120)]
    query = prefix + [rng.randrange(1000, 30000) for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=model_path, num_gpu_blocks_override=10, cpu_offload_bytes=2**22,
                                    preemption_mode="recompute"))
    _run(engine, [prefix], greedy)
    _run(engine, [other], greedy)  # 8 of 9 device blocks: evicts most of the prefix to the host
    stats = engine.get_stats()
    assert stats.num_offloaded_blocks >= 5
    hits_before = stats.prefix_cache_hits
    engine.add_request("q", query, greedy)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    stats = engine.get_stats()
    assert finals["q"].num_cached_tokens == 96  # device and host tiers together
    assert stats.prefix_cache_hits - hits_before == 96
    assert stats.prefix_cache_hits_host >= 5 * 16
    cold = _run(LLMEngine(EngineConfig(model=model_path, enable_prefix_caching=False)), [query], greedy)
    assert finals["q"].outputs[0].token_ids == cold[0]
    _assert_engine_all_free(engine)


def test_auto_mode_calibrates_and_too_small_a_tier_is_refused(model_path):
    from pagoda.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="cpu_offload_bytes"):
        LLMEngine(EngineConfig(model=model_path, cpu_offload_bytes=100))
    engine = LLMEngine(EngineConfig(model=model_path, num_gpu_blocks_override=20, cpu_offload_bytes=2**20))
    model = engine.scheduler.host_tier.cost_model
    assert model.copy_bandwidth_bytes_per_s > 0 and model.copy_latency_s >= 0 and model.prefill_s_per_token > 0
    assert model.bytes_per_block == engine.host_kv_cache.bytes_per_block


def test_host_cache_copies_are_exact():
    from pagoda.engine.runner.host_kv_cache import HostKVCache

    torch.manual_seed(0)
    device = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(2)]
    original = [(k.clone(), v.clone()) for k, v in device]
    host = HostKVCache(device, num_blocks=3)
    host.swap_out([(1, 2), (4, 0)])
    for (k, v), (hk, hv) in zip(original, host.host_caches):
        assert torch.equal(hk[2], k[1]) and torch.equal(hk[0], k[4]) and torch.equal(hv[2], v[1])
    host.swap_in([(2, 5), (0, 3)])
    for (k, v), (dk, dv) in zip(original, device):
        assert torch.equal(dk[5], k[1]) and torch.equal(dk[3], k[4]) and torch.equal(dv[5], v[1])
        assert torch.equal(dk[:3], k[:3])
