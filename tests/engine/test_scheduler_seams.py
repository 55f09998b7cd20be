"""The scheduler's seams: policy objects, the host tier's no-op default, admission constraints.

Each is an object looked up once; a new rule is a new class plugged into the list, with
no branch added to the admission loop. Runner outputs are faked, no torch.
"""

import pytest

from pagoda.engine.config import SCHEDULING_POLICIES
from pagoda.engine.core.sched.constraints import (AdmissionConstraint, Admit, BeamGroupReserve, LoRASlotLimit,
                                            SharedPrefixWait, make_constraints)
from pagoda.engine.core.sched.policy import POLICIES, FcfsPolicy, PriorityPolicy, get_policy
from pagoda.engine.core.sched.step_plan import StepPlan
from pagoda.engine.kv.host_tier import KVOffloadManager, NoHostTier, make_host_tier
from tests.engine.test_scheduler import make_request, make_scheduler, plan, step


def test_policies_are_the_configurable_ones_and_unknown_names_are_refused():
    assert tuple(POLICIES) == SCHEDULING_POLICIES
    assert isinstance(get_policy("fcfs"), FcfsPolicy) and isinstance(get_policy("priority"), PriorityPolicy)
    with pytest.raises(ValueError, match=r"policy: must be one of \('fcfs', 'priority'\), got 'lifo'"):
        get_policy("lifo")
    with pytest.raises(ValueError, match="lifo"):
        make_scheduler(policy="lifo")


def test_policy_victims_and_preemption_for_waiting():
    early, late = make_request("early", 4, arrival=1.0, priority=5), make_request("late", 4, arrival=2.0, priority=0)
    urgent = make_request("urgent", 4, arrival=3.0, priority=-1)
    fcfs, priority = get_policy("fcfs"), get_policy("priority")
    assert fcfs.victim([early, late]) is late  # latest arrival
    assert priority.victim([early, late]) is early  # least urgent
    assert not fcfs.preempts_for(urgent, late)
    assert priority.preempts_for(urgent, early) and not priority.preempts_for(late, early.__class__(
        "same", [1], early.sampling_params, priority=0))
    queue = priority.make_queue()
    for request in (early, late, urgent):
        queue.add(request)
    assert [r.request_id for r in queue] == ["urgent", "late", "early"]


def test_no_host_tier_answers_nothing_swapped_nothing_cached_no_copies():
    tier = make_host_tier(0, 4, "auto", None, enable_prefix_tier=True)
    assert isinstance(tier, NoHostTier) and not tier.is_enabled
    assert not tier.is_swapped_out("a") and not tier.wants_swap(100, 10) and not tier.swap_out("a", [1])
    assert tier.lookup_prefix([], [], 0, 10) == [] and tier.take_copies() == ([], [], [])
    assert (tier.num_blocks, tier.num_free_blocks, tier.num_swapped_out) == (0, 0, 0)
    assert isinstance(make_host_tier(8, 4, "auto", None, True), KVOffloadManager)
    scheduler = make_scheduler()
    assert isinstance(scheduler.host_tier, NoHostTier) and scheduler.block_pool.on_evict is None


def test_constraints_follow_the_config():
    assert [type(c) for c in make_constraints(0, 0, lambda: 0, 16)] == [BeamGroupReserve]
    lora, shared, beams = make_constraints(2, 128, lambda: 7, 16)
    assert isinstance(lora, LoRASlotLimit) and lora.max_loras == 2
    assert isinstance(shared, SharedPrefixWait) and shared.min_tokens == 128
    assert isinstance(beams, BeamGroupReserve) and beams.num_free_blocks() == 7
    assert [type(c) for c in make_scheduler(max_loras=0, min_shared_prefix_to_wait=0).constraints] == \
        [BeamGroupReserve]


def test_lora_slot_limit_skips_and_drains():
    running = [make_request("r1", 4)]
    limit = LoRASlotLimit(1)
    a1, a2, b = make_request("a1", 4), make_request("a2", 4), make_request("b", 4)
    for request, adapter in ((running[0], "A"), (a1, "A"), (a2, "A"), (b, "B")):
        request.adapter_id = adapter
    limit.begin_step(running)
    assert limit.before_lookup(a1) is Admit.YES  # A is resident
    assert limit.before_lookup(b) is Admit.SKIP  # B needs a slot: skipped, A drained
    assert limit.before_lookup(a2) is Admit.SKIP  # A takes no new request while B waits
    limit.begin_step(running)
    assert limit.before_lookup(a2) is Admit.YES  # a new step forgets the drain


class _HoldBack(AdmissionConstraint):
    """A made-up rule: requests whose id starts with ``hold`` stop admission."""

    def after_lookup(self, request, step, num_hit):
        return Admit.STOP if request.request_id.startswith("hold") else Admit.YES


def test_a_new_rule_is_one_class_in_the_list():
    scheduler = make_scheduler(min_shared_prefix_to_wait=0)
    scheduler.constraints.append(_HoldBack())
    for rid in ("a", "hold-b", "c"):
        scheduler.add_request(make_request(rid, 4))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 0, 4, True)]  # stops at hold-b: FCFS order holds, c waits too
    assert [r.request_id for r in scheduler.waiting] == ["hold-b", "c"]


def test_step_plan_chunk_rule():
    chunked, whole = StepPlan(10, 4, enable_chunked_prefill=True), StepPlan(10, 4, enable_chunked_prefill=False)
    assert chunked.chunk(25) == 10 and chunked.chunk(6) == 6
    assert whole.chunk(25) is None and whole.chunk(10) == 10


def test_every_engine_config_field_is_in_exactly_one_group():
    import dataclasses

    from pagoda.engine.config import GROUPS, EngineConfig

    owners = {}
    for group in GROUPS:
        for f in dataclasses.fields(group):
            owners.setdefault(f.name, []).append(group.__name__)
    flat = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(owners) == sorted(flat), "a field of EngineConfig is in no group, or a group names an unknown field"
    assert all(len(groups) == 1 for groups in owners.values()), owners
    config = EngineConfig(max_num_seqs=3, enable_lora=True, max_loras=2)
    assert config.scheduling.max_num_seqs == 3 and config.lora.max_loras == 2 and config.cache.block_size == 16
    config.device = "cpu"  # set after construction (the Triton adapter does): the groups follow
    assert config.load.device == "cpu"
    with pytest.raises(ValueError, match="max_num_seqs: must be >= 1, got 0"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="speculative decoding with LoRA"):
        EngineConfig(enable_lora=True, speculative_method="ngram")
