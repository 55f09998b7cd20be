"""Speculative tokens in the scheduler: scheduled inside the budget, rolled back when
rejected, never cached, never a cause of preemption. Runner outputs are faked."""

from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig

EOS = 2


def make_scheduler(**overrides):
    values = dict(num_blocks=65, max_model_len=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                  model_id="m")
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def make_request(rid, num_prompt, max_tokens=32):
    prompt = [100 + i for i in range(num_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=frozenset({EOS}))


def prefill(scheduler, token=7):
    out = scheduler.schedule()
    tokens = {s.request.request_id: [token] for s in out.scheduled if s.is_sampling}
    scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, tokens))


def test_drafts_are_scheduled_tokens_and_rejections_roll_back():
    scheduler = make_scheduler()
    request = make_request("a", 6)
    scheduler.add_request(request)
    prefill(scheduler)  # 6 prompt tokens computed, token 7 sampled
    assert (request.num_computed_tokens, request.num_tokens) == (6, 7)

    out = scheduler.schedule({"a": [50, 51, 52]})
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.is_sampling) == (6, 4, True)
    # Token 7 is the runner's own sample: only the drafts travel, the runner puts 7 first.
    assert item.token_ids == [50, 51, 52] and item.spec_token_ids == [50, 51, 52] and item.num_runner_tokens == 1
    assert out.total_num_scheduled_tokens == 4
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) * 4 >= 10
    # 50 accepted, 51 rejected and replaced by 60: positions 6 (token 7) and 7 (50) keep KV.
    (update,) = scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, {"a": [50, 60]}))
    assert update.new_token_ids == [50, 60]
    assert request.all_token_ids[-3:] == [7, 50, 60]
    assert (request.num_computed_tokens, request.num_tokens) == (8, 9)
    # Block 1 holds positions 4..7 = [104, 105, 7, 50]: computed and accepted, so cached.
    # Block 2 got KV for the rejected 51/52 at positions 8, 9: never cached.
    pool = scheduler.block_pool
    blocks = scheduler.kv_cache_manager.get_blocks("a")
    assert blocks[1].token_ids == (104, 105, 7, 50)
    assert blocks[2].block_hash is None and len(pool.cached_block_hash_to_block) == 2

    # All accepted: the bonus token is appended too, num_computed catches up to num_tokens - 1.
    out = scheduler.schedule({"a": [61, 62]})
    (update,) = scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, {"a": [61, 62, 63]}))
    assert update.new_token_ids == [61, 62, 63] and request.num_computed_tokens == request.num_tokens - 1 == 11
    assert blocks[2].block_hash is None  # [60, 61, 62, 63] is full, but the bonus 63 has no KV yet
    cached = {b.block_id: b.token_ids for b in pool.cached_block_hash_to_block.values()}
    tokens = request.all_token_ids
    for i, block in enumerate(blocks):
        if block.block_id in cached:
            assert cached[block.block_id] == tuple(tokens[4 * i : 4 * i + 4])
            assert 4 * (i + 1) <= request.num_computed_tokens


def test_budget_cuts_drafts_and_prefill_shares_the_step():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 4))
    prefill(scheduler)
    scheduler.add_request(make_request("b", 20))
    out = scheduler.schedule({"a": [1, 2, 3]})  # decode + 3 drafts, then a chunk of b's prompt
    a, b = out.scheduled
    assert (a.num_new_tokens, a.spec_token_ids) == (4, [1, 2, 3])
    assert (b.request.request_id, b.num_new_tokens, b.is_sampling) == ("b", 4, False)
    scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, {"a": [1, 9]}))
    out = scheduler.schedule({"a": list(range(10, 20))})  # a runs first: its draft is cut to the budget
    (a,) = out.scheduled
    assert a.spec_token_ids == list(range(10, 17)) and out.total_num_scheduled_tokens == 8


def test_drafts_ignored_for_prefills_and_never_preempt():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)  # 4 usable blocks
    scheduler.add_request(make_request("a", 3, max_tokens=5))
    scheduler.add_request(make_request("b", 3, max_tokens=5))
    out = scheduler.schedule({"a": [9, 9], "b": [9, 9]})  # both still prefilling: drafts ignored
    assert [s.spec_token_ids for s in out.scheduled] == [[], []]
    scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, {"a": [7], "b": [7]}))
    # Each holds 1 block (4 slots for 4 tokens); 2 blocks free for 2 running requests.
    out = scheduler.schedule({"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 5]})
    assert scheduler.num_preemptions_total == 0
    first, second = out.scheduled
    assert first.spec_token_ids == [1, 2, 3, 4, 5]  # positions 3..8: 2 more blocks, 2 free >= 2 running
    assert second.spec_token_ids == [] and second.num_new_tokens == 1  # 0 free < 2 running: the draft yields
    scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, {"a": [1], "b": [8]}))
    assert scheduler.requests["a"].num_computed_tokens == 4 and scheduler.requests["b"].num_computed_tokens == 4


def test_stop_inside_accepted_drafts_truncates_and_frees():
    scheduler = make_scheduler()
    request = Request("a", [100, 101, 102, 103, 104], SamplingParams(max_tokens=32, stop_token_ids=[55]),
                      eos_token_ids=frozenset({EOS}))
    scheduler.add_request(request)
    prefill(scheduler)
    out = scheduler.schedule({"a": [54, 55, 56]})
    (update,) = scheduler.update_from_output(ModelRunnerOutput.from_tokens(out.step_id, {"a": [54, 55, 56, 57]}))
    assert update.finished and update.new_token_ids == [54, 55] and request.stop_reason == 55
    assert scheduler.num_free_blocks == 64
