"""Scheduler: one token budget, chunked prefill, prefix hits, preemption, stops, aborts.

Runner outputs are faked: tests pass sampled tokens to ``update_from_output`` as a ``ModelRunnerOutput``.
"""

import random
from collections import Counter

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.contracts.kv_events import BlockRemoved, BlockStored
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig

EOS = 2


def make_scheduler(**overrides):
    values = dict(num_blocks=65, max_model_len=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def make_request(rid, prompt, max_tokens=4, arrival=0.0, priority=0, salt=None, **params):
    if isinstance(prompt, int):
        prompt = [100 + i for i in range(prompt)]
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, prompt, sampling, eos_token_ids=frozenset({EOS}), arrival_time=arrival, priority=priority,
                   cache_salt=salt)


def step(scheduler, token=7, tokens=None):
    """One engine step with a fake runner sampling ``token`` (or ``tokens[id]``)."""
    output = scheduler.schedule()
    sampled = {s.request.request_id: [(tokens or {}).get(s.request.request_id, token)]
               for s in output.scheduled if s.is_sampling}
    return output, scheduler.update_from_output(ModelRunnerOutput.from_tokens(output.step_id, sampled))


def plan(output):
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.is_sampling) for s in output.scheduled]


# Admission checks ----------------------------------------------------------------------


def test_rejects_requests_that_can_never_run():
    scheduler = make_scheduler(num_blocks=9, max_model_len=64)  # 8 usable blocks = 32 tokens
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(make_request("a", []))
    with pytest.raises(ValueError, match=r"60 tokens \+ max_tokens 10 = 70 exceeds max_model_len 64"):
        scheduler.add_request(make_request("b", 60, max_tokens=10))
    with pytest.raises(ValueError, match="needs 10 KV blocks .* whole cache has 8"):
        scheduler.add_request(make_request("c", 30, max_tokens=10))
    with pytest.raises(ValueError, match="no room to generate"):
        scheduler.add_request(make_request("d", 64, max_tokens=None))
    with pytest.raises(ValueError, match="needs 16 KV blocks for 64 tokens"):
        scheduler.add_request(make_request("e", 20, max_tokens=None))  # resolves to 44
    scheduler.add_request(make_request("f", 20, max_tokens=12))  # exactly the whole cache
    assert scheduler.num_waiting == 1 and scheduler.get_request("a") is None


def test_max_tokens_none_resolves_to_model_len():
    scheduler = make_scheduler(num_blocks=65, max_model_len=32)
    request = make_request("a", 20, max_tokens=None)
    scheduler.add_request(request)
    assert request.max_tokens == 12


def test_config_refuses_long_prompts_without_chunking():
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        SchedulerConfig(num_blocks=10, max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(num_blocks=10, max_model_len=128, policy="lifo")
    config = SchedulerConfig.from_engine_config(EngineConfig(scheduling_policy="priority"), 100, 512, "m")
    assert (config.policy, config.num_blocks, config.max_model_len, config.block_size) == ("priority", 100, 512, 16)


# Batching ------------------------------------------------------------------------------


def test_chunked_prefill_mixes_with_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", 3, max_tokens=10))
    out, _ = step(scheduler)
    assert plan(out) == [("a", 0, 3, True)]
    scheduler.add_request(make_request("b", 25))
    out, _ = step(scheduler)  # a decodes, b gets a 9-token chunk
    assert plan(out) == [("a", 3, 1, True), ("b", 0, 9, False)]
    assert out.total_num_scheduled_tokens == 10
    assert out.scheduled[1].token_ids == list(range(100, 109))
    assert out.scheduled[1].is_new and len(out.scheduled[1].new_block_ids[0]) == 3  # ceil(9 / 4)
    out, _ = step(scheduler)
    assert plan(out) == [("a", 4, 1, True), ("b", 9, 9, False)]
    out, updates = step(scheduler)
    assert plan(out) == [("a", 5, 1, True), ("b", 18, 7, True)]
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("a", [7]), ("b", [7])]
    assert scheduler.get_request("b").num_computed_tokens == 25


def test_long_prefill_token_threshold_leaves_the_step_to_the_prompts_behind():
    """vLLM's ``long_prefill_token_threshold``: no request's chunk is longer, so a short prompt
    arriving while a long one is prefilling runs in the next step, not after the long one."""
    for threshold, expected in ((0, [("long", 20, 10, False)]), (4, [("long", 20, 4, False), ("short", 0, 3, True)])):
        scheduler = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=threshold)
        scheduler.add_request(make_request("long", 40))
        while scheduler.get_request("long").num_computed_tokens < 20:
            out, _ = step(scheduler)
            assert all(s.num_new_tokens <= (threshold or 10) for s in out.scheduled)
        scheduler.add_request(make_request("short", 3))
        out, _ = step(scheduler)
        assert plan(out) == expected, threshold
    with pytest.raises(ValueError, match="long_prefill_token_threshold: must be >= 0"):
        make_scheduler(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="long_prefill_token_threshold: must be >= 0"):
        EngineConfig(long_prefill_token_threshold=-1).scheduling


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    for rid in ("a1", "a2", "a3"):
        scheduler.add_request(make_request(rid, 4, max_tokens=8))
    step(scheduler)
    scheduler.add_request(make_request("b", [9] * 30, max_tokens=2))
    out, _ = step(scheduler)
    assert plan(out) == [("a1", 4, 1, True), ("a2", 4, 1, True), ("a3", 4, 1, True)]  # 3 + 30 > 32: b waits
    scheduler.finish_requests(["a1", "a2"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(scheduler)
    assert plan(out) == [("a3", 5, 1, True), ("b", 0, 30, True)] and out.finished_request_ids == ["a1", "a2"]


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 4))
    out, _ = step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"] and scheduler.num_waiting == 1


# Prefix caching ------------------------------------------------------------------------


def test_prefix_hit_schedules_only_the_suffix():
    scheduler = make_scheduler(num_blocks=400, max_model_len=1024, block_size=16, max_num_batched_tokens=2048)
    prefix = [random.Random(0).randrange(3, 30000) for _ in range(512)]
    scheduler.add_request(make_request("a", prefix + [5, 6, 7]))
    out, _ = step(scheduler)
    assert plan(out) == [("a", 0, 515, True)]
    scheduler.add_request(make_request("b", prefix + [8, 9, 10, 11, 12]))
    out, _ = step(scheduler)
    b = scheduler.get_request("b")
    assert b.num_cached_tokens == 512
    assert plan(out)[1] == ("b", 512, 5, True)
    assert out.scheduled[1].token_ids == [8, 9, 10, 11, 12]
    tables = scheduler.kv_cache_manager.get_block_ids
    assert out.scheduled[1].new_block_ids[0][:32] == tables("a")[:32]  # shared blocks
    assert scheduler.prefix_cache_queries == 515 + 517 and scheduler.prefix_cache_hits == 512
    assert scheduler.get_request("a").num_cached_tokens == 0


def test_fully_cached_prompt_recomputes_last_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 8, max_tokens=1))
    step(scheduler)
    scheduler.add_request(make_request("b", 8))
    out, _ = step(scheduler)
    assert plan(out) == [("b", 4, 4, True)]  # the hit stops one block short


def test_different_cache_salt_never_shares_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 16, salt="tenant-1"))
    step(scheduler)
    scheduler.add_request(make_request("b", 16, salt="tenant-2"))
    scheduler.add_request(make_request("c", 16))
    out, _ = step(scheduler)
    tables = {s.request_id: set(scheduler.kv_cache_manager.get_block_ids(s.request_id)) for s in out.scheduled}
    assert not (tables["a"] & tables["b"]) and not (tables["a"] & tables["c"]) and not (tables["b"] & tables["c"])
    assert scheduler.get_request("b").num_cached_tokens == 0 and scheduler.get_request("c").num_cached_tokens == 0


def test_block_events_have_increasing_seq():
    scheduler = make_scheduler(num_blocks=5)  # 4 usable blocks
    scheduler.add_request(make_request("a", 8, max_tokens=4))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    scheduler.add_request(make_request("b", [1] * 12, max_tokens=4))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    events = scheduler.take_events()
    assert [e.seq for e in events] == list(range(len(events)))
    kinds = [type(e.event) for e in events]
    assert BlockStored in kinds and BlockRemoved in kinds
    assert scheduler.take_events() == []


# Preemption ----------------------------------------------------------------------------


def test_fcfs_preempts_latest_arrival_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)  # 4 usable blocks
    scheduler.add_request(make_request("a", 4, max_tokens=8, arrival=1.0))
    scheduler.add_request(make_request("b", 4, max_tokens=8, arrival=2.0))
    scheduler.add_request(make_request("c", 4, max_tokens=8, arrival=3.0))
    out, _ = step(scheduler)  # each holds 1 block
    assert len(out.scheduled) == 3
    out, _ = step(scheduler)  # a needs a 2nd block (1 free), b needs one: c is preempted
    assert out.preempted_request_ids == ["c"]
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    c = scheduler.get_request("c")
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert scheduler.num_preemptions_total == 1 and list(scheduler.waiting)[0] is c
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert scheduler.num_free_blocks == 4


def test_request_that_is_its_own_victim_is_preempted_and_others_proceed():
    scheduler = make_scheduler(num_blocks=3, max_model_len=8)  # 2 usable blocks
    # "a" is admitted first but arrived last, so it is the first victim.
    scheduler.add_request(make_request("a", 3, max_tokens=5, arrival=2.0))
    scheduler.add_request(make_request("b", 3, max_tokens=5, arrival=1.0))
    step(scheduler)
    step(scheduler)  # a and b each hold 1 full block; their next tokens need a 2nd block
    out, _ = step(scheduler)  # a is its own victim; b then takes the freed block
    assert out.preempted_request_ids == ["a"] and plan(out) == [("b", 4, 1, True)]
    assert scheduler.get_request("a").status == RequestStatus.PREEMPTED
    # No deadlock: everything finishes and every block is free again.
    for _ in range(50):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert not scheduler.has_unfinished_requests() and scheduler.num_free_blocks == 2


def test_priority_policy_order_and_victims():
    scheduler = make_scheduler(num_blocks=5, policy="priority", max_num_seqs=2)
    scheduler.add_request(make_request("low", 4, max_tokens=8, priority=5, arrival=1.0))
    scheduler.add_request(make_request("mid", 4, max_tokens=8, priority=1, arrival=2.0))
    out, _ = step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["mid", "low"]
    # A more urgent arrival preempts the lowest-priority running request for a seat.
    scheduler.add_request(make_request("high", 4, max_tokens=8, priority=0, arrival=3.0))
    out, _ = step(scheduler)
    assert out.preempted_request_ids == ["low"]
    assert [s.request.request_id for s in out.scheduled] == ["mid", "high"]
    assert list(scheduler.waiting)[0].request_id == "low"
    # An equally urgent arrival does not preempt.
    scheduler.add_request(make_request("mid2", 4, max_tokens=8, priority=1, arrival=4.0))
    out, _ = step(scheduler)
    assert out.preempted_request_ids == [] and [r.request_id for r in scheduler.waiting] == ["mid2", "low"]


def test_priority_preemption_on_memory_picks_lowest_priority():
    scheduler = make_scheduler(num_blocks=5, policy="priority")
    scheduler.add_request(make_request("p0", 4, max_tokens=8, priority=0, arrival=3.0))
    scheduler.add_request(make_request("p9", 4, max_tokens=8, priority=9, arrival=1.0))
    scheduler.add_request(make_request("p1", 4, max_tokens=8, priority=1, arrival=2.0))
    step(scheduler)
    out, _ = step(scheduler)
    assert out.preempted_request_ids == ["p9"]


# Stops and aborts ----------------------------------------------------------------------


def test_stop_rules():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 3, max_tokens=9))
    scheduler.add_request(make_request("ign", 3, max_tokens=2, ignore_eos=True))
    scheduler.add_request(make_request("min", 3, max_tokens=9, min_tokens=2))
    scheduler.add_request(make_request("stp", 3, max_tokens=9, stop_token_ids=[42]))
    tokens = {"eos": EOS, "ign": EOS, "min": EOS, "stp": 42}
    _, updates = step(scheduler, tokens=tokens)
    done = {u.request.request_id: u.request for u in updates if u.finished}
    assert set(done) == {"eos", "stp"}
    assert done["eos"].finish_reason == "stop" and done["eos"].stop_reason is None
    assert done["stp"].finish_reason == "stop" and done["stp"].stop_reason == 42
    _, updates = step(scheduler, tokens=tokens)
    done = {u.request.request_id: u.request for u in updates if u.finished}
    assert done["ign"].finish_reason == "length" and done["min"].finish_reason == "stop"
    assert done["min"].output_token_ids == [EOS, EOS]


def test_max_model_len_caps_length_and_several_tokens_per_step():
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("a", 4, max_tokens=4))
    output = scheduler.schedule()
    (update,) = scheduler.update_from_output(ModelRunnerOutput.from_tokens(output.step_id, {"a": [5, 6, 7, 8, 9]}))
    assert update.new_token_ids == [5, 6, 7, 8] and update.finished
    assert update.request.finish_reason == "length" and update.request.num_tokens == 8


def test_abort_from_any_state_frees_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6))
    step(scheduler)
    assert scheduler.num_free_blocks < 64
    scheduler.finish_requests(["b", "a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and scheduler.num_free_blocks == 64
    out = scheduler.schedule()
    assert out.is_empty and sorted(out.finished_request_ids) == ["a", "b"]
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(ModelRunnerOutput.from_tokens(output.step_id, {"a": [9]})) == []
    assert scheduler.num_free_blocks == 64


def test_missing_sampled_token_is_a_contract_violation():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    with pytest.raises(AssertionError, match="no sampled token"):
        scheduler.update_from_output(ModelRunnerOutput.from_tokens(scheduler.schedule().step_id, {}))


def test_introspection_and_no_events_without_caching():
    scheduler = make_scheduler(num_blocks=9, enable_prefix_caching=False)
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_usage == 0.0
    scheduler.add_request(make_request("a", 8, max_tokens=4))
    assert scheduler.has_unfinished_requests() and (scheduler.num_waiting, scheduler.num_running) == (1, 0)
    out, _ = step(scheduler)
    assert (scheduler.num_waiting, scheduler.num_running) == (0, 1)
    assert scheduler.kv_cache_usage == pytest.approx(2 / 8) and scheduler.num_free_blocks == 6
    assert out.scheduled[0].request.block_hashes == []
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert scheduler.take_events() == [] and scheduler.prefix_cache_queries == 0
    assert scheduler.reset_prefix_cache() is True


# Randomized simulation -----------------------------------------------------------------


def check_invariants(scheduler, output, all_requests):
    cfg = scheduler.config
    pool = scheduler.block_pool
    manager = scheduler.kv_cache_manager
    assert output.total_num_scheduled_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(scheduler.running) <= cfg.max_num_seqs
    scheduled_ids = [s.request.request_id for s in output.scheduled]
    assert len(set(scheduled_ids)) == len(scheduled_ids)
    assert not set(scheduled_ids) & set(output.preempted_request_ids)
    for s in output.scheduled:
        r = s.request
        assert r.status == RequestStatus.RUNNING and s.num_new_tokens > 0
        start = s.num_computed_tokens + s.num_runner_tokens  # a decode's token: the runner sampled it
        assert s.token_ids == r.all_token_ids[start : s.num_computed_tokens + s.num_new_tokens]
        assert s.num_runner_tokens == 0 or (not s.is_new and s.num_new_tokens == 1)
        table = manager.get_block_ids(r.request_id)
        assert len(table) * cfg.block_size >= s.num_computed_tokens + s.num_new_tokens
        assert s.new_block_ids[0] == (table if s.is_new else table[len(table) - len(s.new_block_ids[0]):])
        assert s.is_sampling == (s.num_computed_tokens + s.num_new_tokens == r.num_tokens)
    # Reference counts equal the number of block tables holding each block.
    holders = Counter()
    for r in scheduler.running:
        holders.update(b.block_id for b in manager.get_blocks(r.request_id))
    for r in scheduler.waiting:
        assert manager.get_blocks(r.request_id) == [] and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert set(manager.req_to_blocks) <= {r.request_id for r in scheduler.running}
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)
    assert pool.null_block.ref_cnt == 0 and pool.null_block not in free and 0 not in holders
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id] >= 0
    # Shared blocks only where requests agree on the block's hash.
    owners: dict[int, list[tuple]] = {}
    for r in scheduler.running:
        for i, b in enumerate(manager.get_blocks(r.request_id)):
            owners.setdefault(b.block_id, []).append((r, i))
    for block_id, users in owners.items():
        if len(users) > 1:
            block = pool.blocks[block_id]
            assert block.block_hash is not None
            assert all(r.block_hashes[i] == block.block_hash for r, i in users)
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
    # Counters equal recomputed values.
    assert scheduler.num_preemptions_total == sum(r.num_preemptions for r in all_requests)
    assert scheduler.prefix_cache_hits <= scheduler.prefix_cache_queries
    live = [r for r in all_requests if not r.is_finished]
    assert scheduler.num_waiting + scheduler.num_running == len(live) == len(scheduler.requests)
    assert scheduler.kv_cache_usage == pytest.approx(1 - pool.num_free_blocks / pool.num_usable_blocks)


@pytest.mark.parametrize("seed,policy,chunked,threshold", [
    (0, "fcfs", True, 0), (1, "priority", True, 0), (2, "fcfs", False, 0), (3, "priority", False, 0),
    (4, "fcfs", True, 0), (5, "fcfs", True, 5), (6, "priority", True, 8)])
def test_randomized_simulation_keeps_invariants_and_terminates(seed, policy, chunked, threshold):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=25, max_model_len=64, block_size=4, max_num_seqs=6,
                               max_num_batched_tokens=64 if not chunked else 24,
                               enable_chunked_prefill=chunked, policy=policy, long_prefill_token_threshold=threshold)
    prefixes = [[rng.randrange(3, 50) for _ in range(12)] for _ in range(3)]
    all_requests = []
    for step_index in range(5000):
        if len(all_requests) < 120 and rng.random() < 0.4:
            suffix = [rng.randrange(3, 50) for _ in range(rng.randrange(0, 30))]
            prompt = rng.choice(prefixes)[: rng.randrange(1, 13)] + suffix
            if not prompt:
                prompt = [5]
            max_tokens = rng.randrange(1, 64 - len(prompt) + 1) if len(prompt) < 64 else 1
            request = make_request(f"r{len(all_requests)}", prompt, max_tokens=max_tokens,
                                   arrival=float(step_index), priority=rng.randrange(3),
                                   salt=rng.choice([None, None, "t1"]), min_tokens=0)
            try:
                scheduler.add_request(request)
                all_requests.append(request)
            except ValueError:
                pass
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(list(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        check_invariants(scheduler, output, all_requests)
        sampled = {s.request.request_id: [EOS if rng.random() < 0.03 else rng.randrange(3, 50)]
                   for s in output.scheduled if s.is_sampling}
        scheduler.update_from_output(ModelRunnerOutput.from_tokens(output.step_id, sampled))
        if len(all_requests) >= 120 and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests(), "simulation did not drain (deadlock or livelock)"
    assert all(r.is_finished for r in all_requests)
    pool = scheduler.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert scheduler.num_preemptions_total > 0, "the tiny cache should force preemption"
    for r in all_requests:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.num_output_tokens <= r.max_tokens and r.num_tokens <= 64
    events = scheduler.take_events()
    assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + len(events)))


def test_a_burst_sharing_a_prefix_prefills_it_once():
    """Three requests sharing a 512-token prefix arrive together: the first prefills it;
    the others wait one step (their next block is being computed) and then hit it, instead
    of prefilling the same 512 tokens beside it in the same step."""
    scheduler = make_scheduler(num_blocks=400, max_model_len=1024, block_size=16, max_num_batched_tokens=2048)
    prefix = [random.Random(1).randrange(3, 30000) for _ in range(512)]
    for i, rid in enumerate("abc"):
        scheduler.add_request(make_request(rid, prefix + [5 + i, 6, 7]))
    scheduler.add_request(make_request("other", 40))  # behind them in FCFS order
    out, _ = step(scheduler)
    assert plan(out) == [("a", 0, 515, True)]
    out, _ = step(scheduler)
    assert plan(out) == [("a", 515, 1, True), ("b", 512, 3, True), ("c", 512, 3, True), ("other", 0, 40, True)]
    assert [scheduler.get_request(r).num_cached_tokens for r in "bc"] == [512, 512]
    assert scheduler.prefix_cache_hits == 1024


def test_a_request_whose_prefix_is_not_being_computed_is_admitted_at_once():
    scheduler = make_scheduler(num_blocks=400, max_model_len=1024, block_size=16, max_num_batched_tokens=2048)
    scheduler.add_request(make_request("a", [random.Random(2).randrange(3, 30000) for _ in range(100)]))
    scheduler.add_request(make_request("b", [random.Random(3).randrange(3, 30000) for _ in range(100)]))
    out, _ = step(scheduler)
    assert [p[0] for p in plan(out)] == ["a", "b"]


def test_waiting_for_a_shared_prefix_can_be_turned_off():
    scheduler = make_scheduler(num_blocks=400, max_model_len=1024, block_size=16, max_num_batched_tokens=2048,
                               min_shared_prefix_to_wait=0)
    prefix = [random.Random(1).randrange(3, 30000) for _ in range(512)]
    for i, rid in enumerate("ab"):
        scheduler.add_request(make_request(rid, prefix + [5 + i]))
    out, _ = step(scheduler)
    assert plan(out) == [("a", 0, 513, True), ("b", 0, 513, True)]
    config = SchedulerConfig.from_engine_config(EngineConfig(min_shared_prefix_to_wait=64), 100, 512, "m")
    assert config.min_shared_prefix_to_wait == 64


# LoRA slots ----------------------------------------------------------------------------


def _lora_request(rid, adapter, prompt=8, max_tokens=4):
    # The id's bytes first: distinct ids never share a prompt block (``hash`` varies per process).
    tokens = [1000 + byte for byte in rid.encode()] + [200 + i for i in range(prompt)]
    request = make_request(rid, tokens[:max(prompt, len(rid))], max_tokens=max_tokens)
    request.adapter_id = adapter
    return request


def test_a_request_waiting_for_an_adapter_slot_does_not_block_the_queue_behind_it():
    """Two slots held by a and b: c is skipped while base-model and resident-adapter
    requests behind it run (vLLM skips too); c keeps its place at the front and runs as
    soon as a slot frees. Adapter a (fewest running, ties by name) takes nothing new."""
    scheduler = make_scheduler(max_loras=2)
    for request in (_lora_request("a1", "a", max_tokens=2), _lora_request("b1", "b", max_tokens=8)):
        scheduler.add_request(request)
    step(scheduler)
    for request in (_lora_request("c1", "c"), _lora_request("base", None), _lora_request("a2", "a"),
                    _lora_request("b2", "b")):
        scheduler.add_request(request)
    output, _ = step(scheduler)
    admitted = [s.request.request_id for s in output.scheduled if s.num_computed_tokens == 0]
    assert admitted == ["base", "b2"]
    assert [r.request_id for r in scheduler.waiting] == ["c1", "a2"], "skipped requests keep their order"
    output, _ = step(scheduler)  # a1 finished in the last step: its slot goes to c1
    admitted = [s.request.request_id for s in output.scheduled if s.num_computed_tokens == 0]
    assert admitted == ["c1"] and [r.request_id for r in scheduler.waiting] == ["a2"]


def test_a_steady_stream_for_resident_adapters_cannot_starve_a_waiting_adapter():
    """New requests for the resident adapters keep arriving every step; the waiting
    adapter still gets a slot, because the drained adapter's requests end."""
    scheduler = make_scheduler(max_loras=2, max_num_seqs=16, num_blocks=400)
    for request in (_lora_request("a0", "a", max_tokens=6), _lora_request("b0", "b", max_tokens=6)):
        scheduler.add_request(request)
    step(scheduler)
    scheduler.add_request(_lora_request("c", "c", max_tokens=2))
    for i in range(1, 40):
        scheduler.add_request(_lora_request(f"a{i}", "a", max_tokens=6))
        scheduler.add_request(_lora_request(f"b{i}", "b", max_tokens=6))
        output, _ = step(scheduler)
        if any(s.request.request_id == "c" for s in output.scheduled):
            break
    else:
        pytest.fail("the request for adapter c was starved")
    assert i <= 8, f"c waited {i} steps"
