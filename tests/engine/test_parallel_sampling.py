"""Parallel sampling's fan-out on CPU: child ids, and the gate that holds siblings until
child 0's prompt is computed (no model; the engine-level behaviour is in test_engine)."""

from pagoda.engine.request_groups.parallel_sampling import SiblingGate, child_request_ids
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampling_params import SamplingParams


def children(request_id, n):
    return [Request(child_id, [1, 2, 3], SamplingParams(n=n)) for child_id in child_request_ids(request_id, n)]


def test_child_ids():
    assert child_request_ids("r", 1) == ["r"]
    assert child_request_ids("r", 3) == ["r#0", "r#1", "r#2"]


def test_siblings_wait_for_child_zeros_first_token_then_leave_once():
    gate = SiblingGate(enabled=True)
    first, *siblings = children("r", 3)
    assert gate.hold([first, *siblings]) == []
    assert gate and gate.num_held == 2 and list(gate.queued()) == siblings
    assert gate.release() == []  # child 0's prompt is not computed yet
    first.append_output_token_ids(7)
    assert gate.release() == siblings
    assert not gate and gate.num_held == 0 and gate.release() == []


def test_a_finished_child_zero_releases_its_siblings():
    gate = SiblingGate(enabled=True)
    first, sibling = children("r", 2)
    gate.hold([first, sibling])
    first.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert gate.release() == [sibling]


def test_dropping_child_zero_drops_the_group_and_dropping_a_sibling_only_it():
    gate = SiblingGate(enabled=True)
    a0, a1, a2 = children("a", 3)
    b0, b1 = children("b", 2)
    gate.hold([a0, a1, a2])
    gate.hold([b0, b1])
    gate.drop(["a#1"])
    assert list(gate.queued()) == [a2, b1]
    gate.drop(["b#0", "b#1"])
    assert list(gate.queued()) == [a2] and gate.num_held == 1


def test_nothing_is_held_without_prefix_caching_or_for_n_1():
    gate = SiblingGate(enabled=False)
    first, *siblings = children("r", 3)
    assert gate.hold([first, *siblings]) == siblings and not gate
    assert SiblingGate(enabled=True).hold(children("s", 1)) == []
