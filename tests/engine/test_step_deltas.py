"""The step plan as a delta: exactly which block ids and token ids travel to the runner.

Per scheduled request the scheduler sends ``is_new``, ``new_block_ids`` (the whole table
when new) and ``token_ids`` (prompt chunks, recomputed tokens and drafts; not the token
of a decode the runner sampled itself). A fake runner (``RequestStates`` from the real
runner, fake sampled tokens, no torch) rebuilds every step's inputs from the deltas
alone, and each test checks them against the scheduler's own state: the whole block
table and the step's real tokens.
"""

from __future__ import annotations

import subprocess
import sys

from pagoda.engine.core.sched.scheduler import Scheduler
from pagoda.engine.request import RequestStatus
from pagoda.engine.runner.request_states import RequestStates
from pagoda.engine.runner.runner_output import ModelRunnerOutput

from tests.engine.test_scheduler import make_request, make_scheduler


class FakeRunner:
    """Applies each plan to ``RequestStates`` and checks the rebuilt inputs are exact."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.states = RequestStates()
        self.on_device: set[str] = set()  # async: the previous job's samples, kept on the device

    def run(self, out, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
        inputs = self.states.update(out, self.on_device)
        for item, inp in zip(out.scheduled, inputs):
            request, start = item.request, item.num_computed_tokens
            assert inp.block_ids == self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
            expected = request.all_token_ids[start:start + item.num_new_tokens - len(item.spec_token_ids)]
            expected = expected + item.spec_token_ids
            if inp.num_device_tokens:  # a placeholder: gathered on the device, unknown on the host
                assert request.request_id in self.on_device and inp.token_ids == expected[1:]
            else:
                assert inp.token_ids == expected
        sampled = {s.request_id: tokens[s.request_id] for s in out.scheduled if s.is_sampling}
        output = ModelRunnerOutput.from_tokens(out.step_id, sampled)
        self.states.record(output)
        return output


def delta(out) -> list[tuple]:
    """(id, is_new, new_block_ids, token_ids) per scheduled request."""
    return [(s.request_id, s.is_new, s.new_block_ids[0], s.token_ids) for s in out.scheduled]


def step(scheduler, runner, spec=None, **tokens):
    out = scheduler.schedule(spec)
    scheduler.update_from_output(runner.run(out, {rid: list(t) for rid, t in tokens.items()}))
    return out


def test_chunked_prefill_then_decodes_send_each_block_and_token_once():
    scheduler = make_scheduler(max_num_batched_tokens=4)  # 4-token blocks
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", 10, max_tokens=5))
    assert delta(step(scheduler, runner)) == [("a", True, [1], [100, 101, 102, 103])]
    assert delta(step(scheduler, runner)) == [("a", False, [2], [104, 105, 106, 107])]
    assert delta(step(scheduler, runner, a=[50])) == [("a", False, [3], [108, 109])]  # samples 50
    # Decodes: the runner sampled the input token; only a new block travels, when one is needed.
    out = step(scheduler, runner, a=[51])
    assert delta(out) == [("a", False, [], [])] and out.scheduled[0].num_runner_tokens == 1
    assert delta(step(scheduler, runner, a=[52])) == [("a", False, [], [])]  # position 11: block 3's last slot
    assert delta(step(scheduler, runner, a=[53])) == [("a", False, [4], [])]  # position 12: a new block
    assert runner.states.get("a").block_ids == [1, 2, 3, 4] and runner.states.get("a").last_token_id == 53


def test_a_prefix_hit_sends_the_whole_table_and_only_the_uncached_tokens():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=1))
    assert delta(step(scheduler, runner, a=[50])) == [("a", True, [1, 2, 3], list(range(100, 109)))]
    scheduler.add_request(make_request("b", 10, max_tokens=1))  # shares a's two full blocks
    out = step(scheduler, runner, b=[60])
    assert out.finished_request_ids == ["a"]
    assert delta(out) == [("b", True, [1, 2, 4], [108, 109])] and out.scheduled[0].num_computed_tokens == 8
    assert runner.states.get("a") is None  # dropped on finished_request_ids


def test_preemption_drops_the_state_and_readmission_sends_everything_again():
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=16)  # 2 usable blocks
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", 4, max_tokens=3, arrival=0.0))
    scheduler.add_request(make_request("b", [200, 201, 202, 203], max_tokens=3, arrival=1.0))
    out = step(scheduler, runner, a=[7], b=[8])
    assert delta(out) == [("a", True, [1], [100, 101, 102, 103]), ("b", True, [2], [200, 201, 202, 203])]
    out = step(scheduler, runner, a=[9])  # a needs b's block: b is preempted (recompute)
    assert out.preempted_request_ids == ["b"] and delta(out) == [("a", False, [2], [])]
    assert runner.states.get("b") is None
    out = step(scheduler, runner, a=[10])
    assert delta(out) == [("a", False, [], [])]  # a finishes (max_tokens)
    out = step(scheduler, runner, b=[11])
    assert out.finished_request_ids == ["a"]
    # b again: a new state, its fresh table, its prompt and the token it kept, recomputed.
    assert delta(out) == [("b", True, [2, 1], [200, 201, 202, 203, 8])]  # a freed its table tail first
    assert delta(step(scheduler, runner, b=[12])) == [("b", False, [], [])]
    assert len(runner.states) == 1


def test_a_finished_id_reused_is_a_new_request_in_the_same_step():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", 3, max_tokens=1))
    step(scheduler, runner, a=[7])
    scheduler.add_request(make_request("a", 5, max_tokens=1))
    out = step(scheduler, runner, a=[8])
    # Block 1 (a's, freed) is reused last: a new table [2, 3] and all five prompt tokens.
    assert out.finished_request_ids == ["a"] and delta(out) == [("a", True, [2, 3], [100, 101, 102, 103, 104])]
    assert runner.states.get("a").last_token_id == 8


def test_drafts_travel_but_the_sampled_token_before_them_does_not():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", 6, max_tokens=20, ignore_eos=True))
    step(scheduler, runner, a=[7])
    out = step(scheduler, runner, {"a": [50, 51, 52]}, a=[50, 60])  # 50 accepted, then 60
    assert delta(out) == [("a", False, [3], [50, 51, 52])] and out.scheduled[0].spec_token_ids == [50, 51, 52]
    out = step(scheduler, runner, {"a": [61]}, a=[61, 62])
    assert delta(out) == [("a", False, [], [61])]  # input 60 (the bonus token the runner sampled), then 61
    assert runner.states.get("a").last_token_id == 62


def test_an_async_placeholder_comes_from_the_device():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    first = scheduler.schedule()
    first_output = runner.run(first, {"a": [7]})
    runner.on_device = {"a"}
    second = scheduler.schedule()  # before the first step's token reaches the host
    assert delta(second) == [("a", False, [2], [])] and second.scheduled[0].num_runner_tokens == 1
    scheduler.update_from_output(first_output)
    scheduler.update_from_output(runner.run(second, {"a": [8]}))
    runner.on_device = set()  # the next job sampled nothing for it: the host copy serves
    third = scheduler.schedule()
    assert delta(third) == [("a", False, [], [])]
    (inp,) = runner.states.update(third)
    assert inp.token_ids == [8] and inp.num_device_tokens == 0


def test_an_undone_step_makes_its_requests_new_again():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    step(scheduler, runner, a=[7])
    failed = scheduler.schedule()
    assert delta(failed) == [("a", False, [2], [])]
    scheduler.undo_step(failed)  # its device job failed: the runner may or may not have applied it
    out = step(scheduler, runner, a=[8])
    assert delta(out) == [("a", True, [1, 2], [7])]
    assert scheduler.get_request("a").status == RequestStatus.RUNNING


def test_the_delta_modules_import_no_torch():
    code = ("import sys, pagoda.engine.core.sched.scheduler, pagoda.engine.runner.request_states; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
