"""The scheduler under pipeline parallelism's batch queue (``SchedulerConfig.micro_batches`` > 1).

Runner outputs are faked (CPU, no model), as in test_async_scheduler.py: steps are scheduled
while earlier ones are unapplied, and each test asserts the exact plans: the steps share the
live requests, a request with a step in flight is not scheduled again (nor admitted back
after a preemption) until that step is applied, and every block ends free.
"""

from pagoda.engine.request import RequestStatus

from tests.engine.test_async_scheduler import _all_free, _sampled
from tests.engine.test_scheduler import make_request, make_scheduler, plan


def _prompt(first: int) -> list[int]:
    return [first + i for i in range(4)]


def test_steps_in_flight_share_the_requests_and_skip_those_in_flight():
    scheduler = make_scheduler(micro_batches=2)
    requests = [make_request(rid, _prompt(100 * (i + 1)), max_tokens=2, arrival=float(i))
                for i, rid in enumerate("abcd")]
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert plan(first) == [("a", 0, 4, True), ("b", 0, 4, True)]  # ceil(4 live / 2 steps) each
    second = scheduler.schedule()
    assert plan(second) == [("c", 0, 4, True), ("d", 0, 4, True)]
    assert plan(scheduler.schedule()) == []  # every request has a step in flight
    scheduler.update_from_output(_sampled(a=7, b=8, step_id=first.step_id))
    third = scheduler.schedule()
    assert plan(third) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert [r.num_output_placeholders for r in requests] == [1, 1, 1, 1]  # never more than one
    scheduler.update_from_output(_sampled(c=9, d=10, step_id=second.step_id))
    fourth = scheduler.schedule()
    assert plan(fourth) == [("c", 4, 1, True), ("d", 4, 1, True)]
    scheduler.update_from_output(_sampled(a=11, b=12, step_id=third.step_id))
    scheduler.update_from_output(_sampled(c=13, d=14, step_id=fourth.step_id))
    assert [r.output_token_ids for r in requests] == [[7, 11], [8, 12], [9, 13], [10, 14]]
    assert all(r.is_finished for r in requests) and _all_free(scheduler)


def test_a_request_preempted_while_in_flight_waits_for_its_step_before_readmission():
    # 2 usable blocks of 4 tokens; three steps may be in flight, one request each.
    scheduler = make_scheduler(num_blocks=3, micro_batches=3)
    a = make_request("a", _prompt(100), max_tokens=3, arrival=0.0)
    b = make_request("b", _prompt(200), max_tokens=3, arrival=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert plan(first) == [("a", 0, 4, True)] and plan(second) == [("b", 0, 4, True)]
    scheduler.update_from_output(_sampled(a=7, step_id=first.step_id))
    third = scheduler.schedule()  # a's decode needs b's block while b's step is in flight
    assert plan(third) == [("a", 4, 1, True)] and third.preempted_request_ids == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_output_placeholders) == (RequestStatus.PREEMPTED, 0, 1)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # both blocks free again
    assert plan(scheduler.schedule()) == [], "b fits, but its step is still in flight"
    (update,) = scheduler.update_from_output(_sampled(b=8, step_id=second.step_id))
    assert update.new_token_ids == [8] and b.num_output_placeholders == 0  # kept: a correct context
    assert scheduler.update_from_output(_sampled(a=9, step_id=third.step_id)) == []  # a was aborted
    fifth = scheduler.schedule()
    assert plan(fifth) == [("b", 0, 5, True)] and fifth.scheduled[0].token_ids == _prompt(200) + [8]
    scheduler.update_from_output(_sampled(b=10, step_id=fifth.step_id))
    sixth = scheduler.schedule()
    scheduler.update_from_output(_sampled(b=11, step_id=sixth.step_id))
    assert b.output_token_ids == [8, 10, 11] and b.is_finished and _all_free(scheduler)
