"""Admission control: the waiting-queue bound, priority displacement, deadlines, stop-id checks."""

from __future__ import annotations

import pytest

from pagoda import SamplingParams
from pagoda.engine.core.load_shedding import DEADLINE_PREFIX, OVERLOADED_PREFIX, Admission, EngineOverloaded
from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.request import Request

from tests.engine.driving import drain


def _request(request_id: str, num_tokens: int, priority: int = 0, arrival: float = 0.0) -> Request:
    request = Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=4),
                      arrival_time=arrival, priority=priority)
    return request


# ------------------------------------------------------------------ the constraint object
def test_bound_on_requests_and_tokens():
    admission = Admission(max_waiting_requests=2, max_waiting_prompt_tokens=100)
    assert admission.can_admit(10, 0, []).admit
    assert admission.can_admit(10, 0, [_request("a", 10)]).admit
    full = admission.can_admit(10, 0, [_request("a", 10), _request("b", 10)])
    assert not full.admit and full.reason.startswith(OVERLOADED_PREFIX) and "waiting queue is full" in full.reason
    assert "Retry after 1 s" in full.reason
    heavy = admission.can_admit(60, 0, [_request("a", 50)])
    assert not heavy.admit and "prompt tokens" in heavy.reason
    assert admission.num_refused == 2
    with pytest.raises(ValueError, match="max_waiting_prompt_tokens"):
        admission.can_admit(101, 0, [])


def test_more_urgent_request_displaces_the_least_urgent_latest_first():
    admission = Admission(max_waiting_requests=3, max_waiting_prompt_tokens=1000)
    queue = [_request("p0", 5, 0, 1.0), _request("p5-old", 5, 5, 2.0), _request("p5-new", 5, 5, 3.0)]
    verdict = admission.can_admit(5, 1, queue)
    assert verdict.admit and [v.request_id for v in verdict.victims] == ["p5-new"]
    # Equal priority never displaces: FCFS among equals.
    assert not admission.can_admit(5, 5, queue).admit
    # The most urgent waiting request is never a victim of a less urgent one.
    assert not admission.can_admit(5, 3, [_request("p0", 5, 0)] * 3).admit


def test_deadlines_pop_in_order():
    admission = Admission(8, 1000)
    admission.track_deadline("late", 20.0, 10.0)
    admission.track_deadline("early", 15.0, 5.0)
    assert admission.take_expired(14.9) == []
    assert admission.take_expired(16.0) == [("early", 5.0)]
    assert admission.take_expired(30.0) == [("late", 10.0)]


def test_capacity_bound_follows_measured_service_time():
    """Issue 25 defect 10: the queue is bounded by what the replica can serve within
    max_queue_delay_s, from its own finished requests, not by a constant alone."""
    admission = Admission(max_waiting_requests=1024, max_waiting_prompt_tokens=10**6, max_queue_delay_s=10.0, slots=4)
    queue = [_request(f"w{i}", 5) for i in range(100)]
    assert admission.can_admit(5, 0, queue, num_running=4).admit  # nothing measured yet: constants only
    for seconds in (2.0, 2.0, 2.0):
        admission.observe_service(seconds)
    assert admission.mean_service_s == pytest.approx(2.0)
    # 4 slots, 2 s each: 20 queued + the new one reach a slot in (21 - 0) / 4 x 2 = 10.5 s > 10 s.
    assert admission.can_admit(5, 0, queue[:19], num_running=4).admit  # 20 / 4 x 2 = 10 s
    verdict = admission.can_admit(5, 0, queue[:20], num_running=4)
    assert not verdict.admit and verdict.reason.startswith(OVERLOADED_PREFIX)
    assert "measured capacity" in verdict.reason and "max_queue_delay_s" in verdict.reason and "10 s" in verdict.reason
    assert admission.can_admit(5, 0, queue[:20], num_running=2).admit  # two free slots: (21 - 2) / 4 x 2 = 9.5 s
    # Slower requests: the queue it allows shrinks (EWMA towards 8 s).
    for _ in range(30):
        admission.observe_service(8.0)
    assert not admission.can_admit(5, 0, queue[:5], num_running=4).admit  # 6 / 4 x 8 = 12 s
    assert admission.can_admit(5, 0, queue[:4], num_running=4).admit  # 5 / 4 x 8 = 10 s
    # A more urgent request still displaces less urgent waiting ones to fit.
    low = [_request(f"l{i}", 5, priority=9, arrival=float(i)) for i in range(5)]
    verdict = admission.can_admit(5, 0, low, num_running=4)
    assert verdict.admit and [v.request_id for v in verdict.victims] == ["l4"]
    off = Admission(1024, 10**6, max_queue_delay_s=0.0, slots=4)
    for _ in range(5):
        off.observe_service(100.0)
    assert off.can_admit(5, 0, queue, num_running=4).admit and off.expected_wait_s(101) is None


def test_config_validates_bounds():
    with pytest.raises(ValueError, match="max_waiting_requests"):
        EngineConfig(max_waiting_requests=0)
    with pytest.raises(ValueError, match="max_waiting_prompt_tokens"):
        EngineConfig(max_waiting_prompt_tokens=-1)
    for bad in (-1.0, float("inf"), float("nan"), "30", True):
        with pytest.raises(ValueError, match="max_queue_delay_s"):
            EngineConfig(max_queue_delay_s=bad)
    assert EngineConfig().max_queue_delay_s == 0.0  # the engine never refuses its own work by default
    from pagoda.serving.model_config import engine_config_from_parameters

    assert engine_config_from_parameters({}).max_queue_delay_s == 30.0  # a server protects itself
    assert engine_config_from_parameters({"max_queue_delay_s": "0"}).max_queue_delay_s == 0.0


def test_a_burst_is_bounded_by_the_replicas_measured_capacity(model_path):
    """A 200-request burst on one replica: with the constants alone all 200 queue; the
    capacity bound admits what 2 slots serve within the budget (1 s here), refuses the rest
    at once, and every admitted request finishes."""
    engine = LLMEngine(EngineConfig(model=model_path, max_num_seqs=2, max_queue_delay_s=1.0))
    for i in range(4):  # measure: requests that run to their natural end (32 tokens: a service time of steps)
        engine.add_request(f"warm{i}", [5, 6, 7 + i], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    drain(engine)
    service = engine.admission.mean_service_s
    assert engine.admission.num_service_samples == 4 and service > 0
    admitted, refused = [], []
    for i in range(200):
        try:
            engine.add_request(f"b{i}", [5, 6, 7, 8, i % 50 + 10], GREEDY)
            admitted.append(f"b{i}")
        except EngineOverloaded as exc:
            refused.append(str(exc))
    # The queue it keeps is what 2 free slots take at once plus what they drain in 1 s.
    expected = int(1.0 / service * 2) + 2
    assert abs(len(admitted) - expected) <= 2 and len(admitted) + len(refused) == 200, (len(admitted), service)
    assert refused and all("measured capacity" in r for r in refused)
    finals = drain(engine)
    assert sorted(finals) == sorted(admitted) and all(o.error is None for o in finals.values())
    assert engine.get_stats().num_free_blocks == engine.scheduler.block_pool.num_usable_blocks


# ------------------------------------------------------------------ in the engine
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_engine_refuses_past_the_bound_and_keeps_serving(model_path):
    engine = LLMEngine(EngineConfig(model=model_path, max_num_seqs=2, max_waiting_requests=3))
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7, 8 + i], GREEDY)
    with pytest.raises(EngineOverloaded, match="waiting queue is full") as info:
        engine.add_request("r3", [5, 6, 7, 9], GREEDY)
    assert info.value.retry_after_s >= 1 and engine.get_stats().num_admission_refused == 1
    finals = drain(engine)
    assert sorted(finals) == ["r0", "r1", "r2"] and all(o.error is None for o in finals.values())
    assert engine.get_stats().num_free_blocks == engine.scheduler.block_pool.num_usable_blocks
    engine.add_request("r3", [5, 6, 7, 9], GREEDY)  # room again
    assert drain(engine)["r3"].outputs[0].finish_reason == "length"


def test_requests_waiting_outside_the_scheduler_count_against_the_bound(model_path):
    """n siblings held for their first child's prompt and a guided request waiting for its
    grammar are queued too: with room for 3, n=2 plus one guided request fill the queue;
    a more urgent request displaces the guided one (never scheduled), and all finish."""
    pytest.importorskip("xgrammar")
    from pagoda.engine.guided import GuidedDecodingParams

    engine = LLMEngine(EngineConfig(model=model_path, max_waiting_requests=3))
    engine.add_request("pair", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2))
    choice = SamplingParams(temperature=0, max_tokens=4, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    engine.add_request("guided", [5, 6, 9], choice, priority=5)
    assert len(list(engine.core.queued_requests())) == 3
    with pytest.raises(EngineOverloaded, match="waiting queue is full"):
        engine.add_request("late", [5, 6, 10], GREEDY, priority=5)
    engine.add_request("urgent", [5, 6, 11], GREEDY, priority=0)
    finals = drain(engine)
    assert finals["guided"].error.startswith(OVERLOADED_PREFIX)
    assert finals["pair"].error is None and finals["urgent"].error is None
    assert engine.get_stats().num_free_blocks == engine.scheduler.block_pool.num_usable_blocks


def test_engine_displaces_lower_priority_with_an_overload_error(model_path):
    engine = LLMEngine(EngineConfig(model=model_path, max_waiting_requests=2))
    engine.add_request("low", [5, 6, 7], GREEDY, priority=9)
    engine.add_request("mid", [5, 6, 8], GREEDY, priority=5)
    engine.add_request("urgent", [5, 6, 9], GREEDY, priority=0)
    finals = drain(engine)
    assert finals["low"].error.startswith(OVERLOADED_PREFIX) and "more urgent" in finals["low"].error
    assert finals["low"].outputs[0].finish_reason == "abort"
    assert finals["mid"].error is None and finals["urgent"].error is None
    assert engine.admission.num_displaced == 1 and engine.get_stats().num_admission_displaced == 1


def test_deadline_ends_waiting_and_running_requests_with_their_own_error(model_path):
    engine = LLMEngine(EngineConfig(model=model_path, max_num_seqs=1))
    now = [1000.0]
    engine.admission.clock = lambda: now[0]
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("running", [5, 6, 7], long, timeout=30, arrival_time=now[0])
    engine.add_request("waiting", [5, 6, 8], long, timeout=5, arrival_time=now[0])
    engine.add_request("free", [5, 6, 9], GREEDY, arrival_time=now[0])
    for _ in range(3):
        engine.step()
    now[0] += 31  # both deadlines pass while "running" is mid-generation
    finals = drain(engine)
    assert finals["waiting"].error.startswith(DEADLINE_PREFIX) and "waiting in the queue" in finals["waiting"].error
    assert finals["running"].error.startswith(DEADLINE_PREFIX) and "generated tokens" in finals["running"].error
    assert finals["free"].error is None and finals["free"].outputs[0].finish_reason == "length"
    assert engine.get_stats().num_free_blocks == engine.scheduler.block_pool.num_usable_blocks
    with pytest.raises(ValueError, match="timeout"):
        engine.add_request("bad", [5, 6], GREEDY, timeout=0)


def test_token_ids_outside_the_vocabulary_are_refused(model_path):
    engine = LLMEngine(EngineConfig(model=model_path))
    for params, name in [(SamplingParams(stop_token_ids=[99999999]), "stop_token_ids"),
                         (SamplingParams(allowed_token_ids=[5, 99999999]), "allowed_token_ids"),
                         (SamplingParams(logit_bias={99999999: 1.0}), "logit_bias")]:
        with pytest.raises(ValueError, match=f"{name}: token id 99999999 is not in the vocabulary"):
            engine.add_request("a", [5, 6], params)
    assert not engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(model_path):
    engine = LLMEngine(EngineConfig(model=model_path, max_model_len=64))
    engine.add_request("cut", list(range(5, 25)), SamplingParams(max_tokens=1, truncate_prompt_tokens=4))
    engine.add_request("max", list(range(5, 25)), SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    finals = drain(engine)
    assert finals["cut"].prompt_token_ids == [21, 22, 23, 24]
    assert finals["max"].prompt_token_ids == list(range(5, 25))  # -1: max_model_len, longer than the prompt


def test_offline_generate_feeds_a_full_queue_as_it_drains(model_path):
    from pagoda import LLM

    llm = LLM(model_path, max_num_seqs=2, max_waiting_requests=2)
    outputs = llm.generate([[5, 6, 7 + i] for i in range(9)], GREEDY, priority=[9 - i for i in range(9)])
    assert [o.request_id for o in outputs] == [str(i) for i in range(9)]
    assert all(o.finished and o.error is None and len(o.outputs[0].token_ids) == 4 for o in outputs)
