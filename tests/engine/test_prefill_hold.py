"""The priority policy inside a replica's batch, as the router's flow control uses it
(docs/reliability.md, "Flow control": rank at the replica): a more urgent short prompt is not
slowed by a less urgent long prompt's prefill chunks, preempts a strictly less urgent running
request for a slot (never an equal one), and nothing leaks (``core.sched.prefill_hold``)."""

from pagoda.engine.core.sched.prefill_hold import PrefillHold, is_prefilling
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.test_scheduler import make_request, make_scheduler, plan, step


def run_to_end(scheduler, max_steps=200):
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("requests still unfinished")


def flooded(policy, **overrides):
    """A long, less urgent prompt (the flooder's: rank 1) prefilling at 4 tokens a step."""
    values = dict(policy=policy, max_num_seqs=2, max_num_batched_tokens=16, long_prefill_token_threshold=4)
    values.update(overrides)
    scheduler = make_scheduler(**values)
    scheduler.add_request(make_request("flood", 40, max_tokens=2, priority=1, arrival=1.0))
    step(scheduler)
    step(scheduler)  # 8 of its 40 prompt tokens computed
    return scheduler


def test_a_more_urgent_prompt_runs_without_the_less_urgent_prefill_chunk():
    scheduler = flooded("priority")
    free_at_start = make_scheduler().num_free_blocks
    scheduler.add_request(make_request("quiet", 3, max_tokens=2, priority=0, arrival=2.0))
    out, _ = step(scheduler)
    # the quiet prompt's step holds only its own tokens: the flood's chunk waits
    assert plan(out) == [("quiet", 0, 3, True)]
    assert scheduler.get_request("flood").num_computed_tokens == 8
    out, _ = step(scheduler)  # quiet decodes: the flood's prefill goes on beside it
    assert plan(out) == [("flood", 8, 4, False), ("quiet", 3, 1, True)]
    run_to_end(scheduler)
    assert scheduler.num_free_blocks == free_at_start  # no block leaked


def test_fcfs_and_equal_priorities_share_the_step():
    for policy, priority in (("fcfs", 0), ("priority", 1)):
        scheduler = flooded(policy)
        scheduler.add_request(make_request("quiet", 3, max_tokens=2, priority=priority, arrival=2.0))
        out, _ = step(scheduler)
        assert plan(out) == [("flood", 8, 4, False), ("quiet", 0, 3, True)], policy


def test_a_held_chunk_runs_when_the_urgent_prompt_cannot_be_admitted():
    """The waiting head is more urgent but gets no LoRA slot (max_loras 1, another adapter
    running): nothing prefills ahead of the flood, so its chunk is scheduled after all (no
    deadlock: the flood holds the slot the head waits for)."""
    scheduler = make_scheduler(policy="priority", max_num_seqs=2, max_num_batched_tokens=16,
                               long_prefill_token_threshold=4, max_loras=1)
    sampling = SamplingParams(max_tokens=2)
    scheduler.add_request(Request("flood", [100 + i for i in range(20)], sampling, priority=1, adapter_id="x"))
    step(scheduler)
    scheduler.add_request(Request("quiet", [5, 6, 7], sampling, priority=0, arrival_time=1.0, adapter_id="y"))
    out, _ = step(scheduler)
    assert plan(out) == [("flood", 4, 4, False)] and scheduler.num_waiting == 1
    run_to_end(scheduler)
    assert scheduler.get_request("quiet") is None and scheduler.num_running == 0


def test_a_more_urgent_request_preempts_a_less_urgent_one_for_a_slot_an_equal_one_does_not():
    scheduler = make_scheduler(policy="priority", max_num_seqs=2, max_num_batched_tokens=16,
                               long_prefill_token_threshold=4)
    free_at_start = scheduler.num_free_blocks
    for n, rid in enumerate(("flood-a", "flood-b")):
        scheduler.add_request(make_request(rid, 40, max_tokens=2, priority=1, arrival=float(n)))
    step(scheduler)
    scheduler.add_request(make_request("equal", 3, max_tokens=2, priority=1, arrival=5.0))
    out, _ = step(scheduler)
    assert out.preempted_request_ids == [] and scheduler.num_waiting == 1  # equal: waits its turn
    scheduler.add_request(make_request("quiet", 3, max_tokens=2, priority=0, arrival=6.0))
    out, _ = step(scheduler)
    # the latest of the least urgent goes back to the queue; the quiet prompt runs alone
    assert out.preempted_request_ids == ["flood-b"] and plan(out) == [("quiet", 0, 3, True)]
    assert scheduler.get_request("flood-b").status == RequestStatus.PREEMPTED
    run_to_end(scheduler)
    assert scheduler.num_free_blocks == free_at_start and not scheduler.requests


def test_the_bar_and_the_release():
    long_ = make_request("long", 10, priority=3)
    short = make_request("short", 3, priority=0)
    assert is_prefilling(long_)
    long_.num_computed_tokens = 9  # one token left: a decode, never held
    assert not is_prefilling(long_)
    long_.num_computed_tokens = 4
    long_.status = RequestStatus.RUNNING
    hold = PrefillHold([long_], short)
    assert hold.bar == 0 and hold.holds(long_) and hold.held == [long_]
    assert hold.take_released([short]) == [] and hold.held == []  # the urgent prompt is in the step
    hold = PrefillHold([long_], short)
    hold.holds(long_)
    assert hold.take_released([]) == [long_]  # it was not admitted: the chunk runs after all
    assert PrefillHold([long_], None).bar == 3 and not PrefillHold([long_], None).holds(long_)
    assert PrefillHold([long_], short, busy={"short"}).bar == 3  # a busy request counts for nothing
