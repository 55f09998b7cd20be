"""Async scheduling in the scheduler: step N+1 is planned before step N's tokens are applied.

Runner outputs are faked; each test schedules ahead and applies outputs late, asserting
the exact plans, placeholders, late tokens dropped or kept, and that every block ends free.
"""

from pagoda.engine.request import RequestStatus
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig

from tests.engine.test_scheduler import EOS, make_request, make_scheduler, plan


def _sampled(step_id: int, **tokens) -> ModelRunnerOutput:
    return ModelRunnerOutput.from_tokens(step_id, {request_id: [t] for request_id, t in tokens.items()})


def _all_free(scheduler: Scheduler) -> bool:
    return scheduler.num_free_blocks == scheduler.block_pool.num_usable_blocks


def test_schedule_twice_then_apply_two_outputs():
    scheduler = make_scheduler()
    a = make_request("a", 6, max_tokens=3)
    scheduler.add_request(a)
    first = scheduler.schedule()
    assert plan(first) == [("a", 0, 6, True)]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (6, 1)
    second = scheduler.schedule()  # before the first step's token is known
    assert plan(second) == [("a", 6, 1, True)]
    assert second.scheduled[0].token_ids == [] and second.scheduled[0].num_runner_tokens == 1
    assert (a.num_computed_tokens, a.num_output_placeholders) == (7, 2)

    (update,) = scheduler.update_from_output(_sampled(a=50, step_id=first.step_id))
    assert update.new_token_ids == [50] and not update.finished
    third = scheduler.schedule()
    assert plan(third) == [("a", 7, 1, True)] and third.scheduled[0].token_ids == []
    (update,) = scheduler.update_from_output(_sampled(a=51, step_id=second.step_id))
    assert update.new_token_ids == [51]
    # Outputs 2 + 1 being sampled reach max_tokens=3: nothing more is scheduled for it.
    assert plan(scheduler.schedule()) == []
    (update,) = scheduler.update_from_output(_sampled(a=52, step_id=third.step_id))
    assert update.finished and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.output_token_ids == [50, 51, 52] and a.num_output_placeholders == 0
    assert _all_free(scheduler)


def test_a_request_that_stops_one_step_late_has_its_extra_token_dropped():
    scheduler = make_scheduler()
    a, b = make_request("a", 4, max_tokens=10), make_request("b", [200, 201, 202, 203, 204], max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert plan(second) == [("a", 4, 1, True), ("b", 5, 1, True)]
    updates = scheduler.update_from_output(_sampled(a=EOS, b=9, step_id=first.step_id))
    assert [(u.request.request_id, u.finished) for u in updates] == [("a", True), ("b", False)]
    assert scheduler.get_request("a") is None  # freed at once, while step 2 still computes for it
    third = scheduler.schedule()
    assert plan(third) == [("b", 6, 1, True)]
    updates = scheduler.update_from_output(_sampled(a=77, b=10, step_id=second.step_id))
    assert [u.request.request_id for u in updates] == ["b"], "a's late token is dropped"
    assert a.output_token_ids == [EOS] and b.output_token_ids == [9, 10]
    scheduler.update_from_output(_sampled(b=EOS, step_id=third.step_id))
    assert not scheduler.has_unfinished_requests() and _all_free(scheduler)


def test_abort_while_a_step_runs():
    scheduler = make_scheduler()
    a = make_request("a", 4, max_tokens=10)
    scheduler.add_request(a)
    first = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert _all_free(scheduler)
    assert scheduler.update_from_output(_sampled(a=5, step_id=first.step_id)) == []
    assert a.output_token_ids == [] and plan(scheduler.schedule()) == []


def test_a_request_preempted_while_its_step_runs_keeps_that_token_and_recomputes():
    # 2 usable blocks of 4 tokens: a's decode in step 2 needs b's block.
    scheduler = make_scheduler(num_blocks=3)
    a = make_request("a", [100, 101, 102, 103], max_tokens=3, arrival=0.0)
    b = make_request("b", [200, 201, 202, 203], max_tokens=3, arrival=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    assert plan(first) == [("a", 0, 4, True), ("b", 0, 4, True)]
    second = scheduler.schedule()
    assert plan(second) == [("a", 4, 1, True)] and second.preempted_request_ids == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_output_placeholders) == (RequestStatus.PREEMPTED, 0, 1)
    updates = scheduler.update_from_output(_sampled(a=7, b=8, step_id=first.step_id))
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("a", [7]), ("b", [8])]
    assert b.output_token_ids == [8] and b.num_output_placeholders == 0
    third = scheduler.schedule()
    assert plan(third) == [("a", 5, 1, True)], "b waits: a holds both blocks"
    scheduler.update_from_output(_sampled(a=9, step_id=second.step_id))
    assert plan(scheduler.schedule()) == []  # a is sure to finish; b still does not fit
    (update,) = scheduler.update_from_output(_sampled(a=10, step_id=third.step_id))
    assert update.finished and a.output_token_ids == [7, 9, 10]
    fifth = scheduler.schedule()
    assert plan(fifth) == [("b", 0, 5, True)], "b recomputes its prompt and its kept token"
    assert fifth.scheduled[0].token_ids == [200, 201, 202, 203, 8]
    scheduler.update_from_output(_sampled(b=11, step_id=fifth.step_id))
    sixth = scheduler.schedule()
    scheduler.update_from_output(_sampled(b=12, step_id=sixth.step_id))
    assert b.output_token_ids == [8, 11, 12] and b.is_finished and b.num_preemptions == 1
    assert _all_free(scheduler)


def test_a_request_preempted_while_its_step_runs_can_finish_from_the_waiting_queue():
    scheduler = make_scheduler(num_blocks=3)
    a = make_request("a", [100, 101, 102, 103], max_tokens=3, arrival=0.0)
    b = make_request("b", [200, 201, 202, 203], max_tokens=3, arrival=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    scheduler.schedule()  # preempts b
    updates = scheduler.update_from_output(_sampled(a=7, b=EOS, step_id=first.step_id))
    assert [(u.request.request_id, u.finished) for u in updates] == [("a", False), ("b", True)]
    assert b.status == RequestStatus.FINISHED_STOPPED and scheduler.num_waiting == 0


def test_swapped_out_while_its_step_runs_keeps_the_computed_kv():
    cfg = dict(num_blocks=3, num_host_blocks=4, preemption_mode="swap")
    scheduler = Scheduler(SchedulerConfig(max_model_len=256, block_size=4, max_num_seqs=8,
                                          max_num_batched_tokens=64, **cfg))
    a = make_request("a", [100, 101, 102, 103], max_tokens=3, arrival=0.0)
    b = make_request("b", [200, 201, 202, 203], max_tokens=3, arrival=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.blocks_to_swap_out and scheduler.is_swapped_out("b")
    assert b.num_computed_tokens == 4, "the swap copies the KV the running step writes (it runs first)"
    scheduler.update_from_output(_sampled(a=7, b=8, step_id=first.step_id))
    assert b.num_tokens == 5 and b.num_computed_tokens == 4
