"""The router's flow control, deterministic: the fair queue (bands, bounds, virtual token
counters), the waiting room (saturation, deadlines, cancellation, requeue) and its metrics,
and the gate's ``choose`` with a turn (docs/reliability.md, "Flow control")."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagoda.fleet.api.routed_request import as_released, kept_deadline
from pagoda.fleet.gate.fair_queue import NUM_STANDINGS, FairQueue, QueueFull, QueueRefused, Turn
from pagoda.fleet.gate.flow_control import FlowControl, FlowOptions, Saturation
from pagoda.fleet.gate.gate import Gate
from pagoda.fleet.routing.replicas import ReplicaSet
from pagoda.fleet.routing.router import Router
from pagoda.serving.wire import WireRequest


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def turn(tenant: str, cost: int = 100, priority: int = 0, deadline: float = 1e9) -> Turn:
    return Turn(tenant, priority, cost, arrival=0.0, deadline=deadline)


def drain(queue: FairQueue) -> list[str]:
    order = []
    while (t := queue.pop()) is not None:
        order.append(t.tenant)
    return order


def replica_set(*ids: str) -> ReplicaSet:
    replicas = ReplicaSet("static")
    replicas.set_members([(i, {"grpc": f"h:{n}", "http": f"h:{n + 100}"}) for n, i in enumerate(ids)])
    return replicas


# ---------------------------------------------------------------- the fair queue
def test_a_tenant_is_served_by_tokens_not_by_requests():
    """Both backlogged: a tenant whose requests cost 3x as many tokens gets a third as many releases."""
    queue = FairQueue(queue_size=100)
    for _ in range(12):
        queue.push(turn("big", cost=300))
        queue.push(turn("small", cost=100))
    order = drain(queue)[:16]
    assert order.count("small") == 12 and order.count("big") == 4, order
    served = {"big": 0, "small": 0}
    for tenant in order:  # at every point, neither tenant is ahead by more than one big request
        served[tenant] += 300 if tenant == "big" else 100
        assert abs(served["big"] - served["small"]) <= 300, order


def test_a_flood_delays_a_quiet_tenant_by_at_most_one_request():
    """A flooder keeps 20 long requests queued; a quiet tenant sends one short request at a
    time (the next once the last was released): each is released before the flooder's next
    but one, never after the flood."""
    queue = FairQueue(queue_size=100)
    for _ in range(20):
        queue.push(turn("flood", cost=600))
    assert queue.pop().tenant == "flood"  # it was alone
    for _ in range(8):
        queue.push(turn("quiet", cost=60))
        ahead = 0
        while (released := queue.pop()).tenant != "quiet":
            ahead += 1
            queue.push(turn("flood", cost=600))  # the flood never ebbs
        assert ahead <= 1
    assert queue.depth("flood") == 19


def test_idle_time_banks_no_credit():
    """A tenant that becomes backlogged is lifted to the lowest counter of those waiting, so it
    alternates with them rather than taking every release until it catches up."""
    queue = FairQueue(queue_size=100)
    for _ in range(10):
        queue.push(turn("a"))
    for _ in range(5):
        assert queue.pop().tenant == "a"  # a alone: its counter grows to 500
    for _ in range(4):
        queue.push(turn("b"))
    # b starts level with a (500), not at 0: they alternate (b first: a was served last)
    assert drain(queue)[:6] == ["b", "a", "b", "a", "b", "a"]


def test_higher_bands_first_whatever_the_counters():
    queue = FairQueue(queue_size=100)
    queue.push(turn("a", priority=1))
    queue.push(turn("b", priority=5))
    queue.push(turn("a", priority=0, cost=10_000))
    queue.push(turn("a", priority=0, cost=10_000))
    queue.push(turn("b", priority=1))
    order = [(t.tenant, t.priority) for t in iter(queue.pop, None)]
    assert order == [("a", 0), ("a", 0), ("a", 1), ("b", 1), ("b", 5)]


def test_a_tenant_queue_is_bounded_and_other_tenants_are_not():
    queue = FairQueue(queue_size=3)
    for priority in (0, 1, 2):  # the bound is per tenant over every band
        queue.push(turn("a", priority=priority))
    with pytest.raises(QueueFull, match=r"tenant 'a' has 3 requests waiting at the router, at most 3 "
                                        r"\(router --queue-size-per-tenant\)") as info:
        queue.push(turn("a"))
    assert info.value.retry_after_s >= 1 and info.value.reason == "queue_full"
    queue.push(turn("b"))
    assert queue.depth("a") == 3 and queue.depth("b") == 1 and len(queue) == 4


def test_remove_frees_the_place_and_charges_nothing():
    queue = FairQueue(queue_size=2)
    first, second = turn("a", cost=1000), turn("a", cost=1000)
    queue.push(first)
    queue.push(second)
    assert queue.remove(first) and not queue.remove(first)
    queue.push(turn("a"))  # the place is free again
    queue.push(turn("b"))
    assert queue.pop() is second  # a's counter was not charged for the removed one: tie, a first


def test_a_requeued_turn_goes_first_with_its_cost_given_back():
    queue = FairQueue(queue_size=2)
    x, y = turn("a", cost=500), turn("a", cost=500)
    z1, z2 = turn("b", cost=100), turn("b", cost=100)
    for t in (x, y, z1, z2):
        queue.push(t)
    assert queue.pop() is x and x.admitted
    queue.requeue(x)  # a replica refused it as full; the bound (2, held by x and y) does not refuse it
    assert queue.depth("a") == 2 and not x.admitted
    # its 500 given back: a (0) goes right after b's first (100), and x before y
    assert [queue.pop() for _ in range(4)] == [z1, x, z2, y]


def test_expired_lists_the_turns_past_their_deadline():
    queue = FairQueue(queue_size=5)
    early, late = turn("a", deadline=10.0), turn("b", deadline=20.0)
    queue.push(early)
    queue.push(late)
    assert queue.expired(9.9) == [] and queue.expired(10.0) == [early]


# ---------------------------------------------------------------- saturation
def test_saturation_reads_in_flight_overload_memory_and_heartbeats():
    replicas = replica_set("a", "b")
    full: list[str] = []
    saturation = Saturation(FlowOptions(queue_size=4, max_in_flight_per_replica=2, saturation_waiting=3,
                                        saturation_kv_usage=0.9), lambda: full)
    a, b = replicas.get("a"), replicas.get("b")
    a.in_flight, b.in_flight = 2, 1
    assert saturation.room(replicas, 0) and not saturation.room(replicas, 1)  # one slot: taken by a released turn
    full.append("b")
    assert not saturation.room(replicas, 0)
    full.clear()
    b.heartbeat_ts, b.waiting = 1.0, 3
    assert not saturation.room(replicas, 0)
    b.waiting, b.kv_usage = 0, 0.95
    assert not saturation.room(replicas, 0)
    b.kv_usage = 0.5
    assert saturation.room(replicas, 0)
    b.draining = True  # draining replicas count only when no other is left
    assert not saturation.room(replicas, 0)
    a.draining = True
    assert saturation.room(replicas, 0)
    unbounded = Saturation(FlowOptions(queue_size=4), lambda: [])
    a.in_flight = 1000
    assert unbounded.room(replicas, 50)
    for replica in (a, b):  # no replica at all: nothing to wait for (routing answers 503 at once)
        replicas.mark_unhealthy(replica, "test")
    assert saturation.room(replicas, 0) and saturation.capacity(replicas) == 0


# ---------------------------------------------------------------- the waiting room
def flow_control(clock: FakeClock, **options) -> FlowControl:
    options = FlowOptions(**{"queue_size": 4, "max_in_flight_per_replica": 1, "poll_s": 0.001, **options})
    return FlowControl(options, Saturation(options, lambda: []), clock)


def test_waiting_turns_are_released_fairly_as_slots_free():
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, queue_size=8)
        replica = replicas.get("r")
        replica.in_flight = 1  # saturated
        order: list[str] = []

        async def one(tenant, cost):
            t = flow.turn(tenant, 0, cost, None)
            await flow.wait(t, replicas)
            order.append(tenant)
            flow.routed(t)

        tasks = [asyncio.create_task(one("flood", 500)) for _ in range(6)]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(one("quiet", 50)) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert order == [] and flow.queue.depth("flood") == 6 and flow.queue.depth("quiet") == 2
        for _ in range(8):
            replica.in_flight = 0  # a request ended: one slot
            clock.now += 0.5
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return order, flow

    order, flow = asyncio.run(scenario())
    # flood was backlogged first (ties go to it), then quiet's 50-token requests come before
    # flood's next 500-token one
    assert order[:3] == ["flood", "quiet", "quiet"], order
    assert flow.released[("quiet", 0)] == 2 and flow.released[("flood", 0)] == 6
    lines = "\n".join(flow.metric_lines())
    assert 'pagoda_router_queue_released_total{tenant="flood",priority="0"} 6' in lines
    assert 'pagoda_router_queue_depth{tenant="quiet",priority="0"} 0' in lines
    assert 'pagoda_router_queue_wait_seconds_count{tenant="quiet",priority="0"} 2' in lines
    assert 'pagoda_router_queue_wait_seconds_bucket{tenant="flood",priority="0",le="+Inf"} 6' in lines


def test_a_released_turn_holds_its_slot_until_it_is_routed():
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, max_in_flight_per_replica=1)
        replicas.get("r").in_flight = 1
        turns = [flow.turn("a", 0, 10, None) for _ in range(3)]
        waiters = [asyncio.create_task(flow.wait(t, replicas)) for t in turns]
        await asyncio.sleep(0.005)
        replicas.get("r").in_flight = 0
        await asyncio.sleep(0.01)
        released = [t.admitted for t in turns]
        assert released == [True, False, False] and flow.num_unrouted == 1  # not three at once
        flow.routed(turns[0])
        replicas.get("r").in_flight = 1  # it was routed there
        await asyncio.sleep(0.01)
        assert [t.admitted for t in turns] == [True, False, False]
        for w in waiters[1:]:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        return flow

    flow = asyncio.run(scenario())
    assert len(flow.queue) == 0 and flow.num_unrouted == 0


def test_a_turn_that_cannot_wait_is_refused_naming_the_limit():
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, queue_size=1, max_wait_s=5.0)
        replicas.get("r").in_flight = 1
        waiting = asyncio.create_task(flow.wait(flow.turn("a", 0, 10, None), replicas))
        await asyncio.sleep(0.005)
        with pytest.raises(QueueFull, match="--queue-size-per-tenant"):
            await flow.wait(flow.turn("a", 0, 10, None), replicas)
        short = asyncio.create_task(flow.wait(flow.turn("b", 0, 10, 2.0), replicas))
        clock.now += 2.0
        with pytest.raises(QueueRefused, match=r"its timeout \(2 s\) would pass before a replica had room"):
            await short
        clock.now += 3.0
        with pytest.raises(QueueRefused, match=r"waited 5.0 s, the longest a request may wait "
                                               r"\(router --queue-max-wait 5\)"):
            await waiting
        return flow

    flow = asyncio.run(scenario())
    assert flow.refused == {("a", 0, "queue_full"): 1, ("b", 0, "timeout"): 1, ("a", 0, "max_wait"): 1}
    assert len(flow.queue) == 0
    lines = flow.metric_lines()
    assert 'pagoda_router_queue_refused_total{tenant="a",priority="0",reason="max_wait"} 1' in lines
    # every reason has a row for each tenant and band seen, zero until it happens (dashboards query them)
    assert 'pagoda_router_queue_refused_total{tenant="b",priority="0",reason="queue_full"} 0' in lines
    assert sum(line.startswith("pagoda_router_queue_refused_total{") for line in lines) == 2 * 3


def test_a_cancelled_waiter_frees_its_place():
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, queue_size=1)
        replicas.get("r").in_flight = 1
        waiting = asyncio.create_task(flow.wait(flow.turn("a", 0, 10, None), replicas))
        await asyncio.sleep(0.005)
        assert flow.queue.depth("a") == 1
        waiting.cancel()  # its client hung up
        await asyncio.gather(waiting, return_exceptions=True)
        assert flow.queue.depth("a") == 0
        again = asyncio.create_task(flow.wait(flow.turn("a", 0, 10, None), replicas))  # not refused as full
        await asyncio.sleep(0.005)
        assert flow.queue.depth("a") == 1
        replicas.get("r").in_flight = 0
        await asyncio.wait_for(again, 1.0)
        return flow

    flow = asyncio.run(scenario())
    assert flow.released[("a", 0)] == 1 and flow.num_unrouted == 1


def test_a_turn_refused_by_a_full_replica_waits_again_within_its_deadline():
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, max_wait_s=10.0)
        t = flow.turn("a", 0, 10, 4.0)
        await flow.wait(t, replicas)  # room: at once
        flow.routed(t)
        assert t.admitted and t.waited_s == 0.0
        replicas.get("r").in_flight = 1
        assert flow.requeue(t)  # the replica answered "overloaded": back to the queue
        waiting = asyncio.create_task(flow.wait(t, replicas))
        await asyncio.sleep(0.005)
        assert flow.queue.depth("a") == 1
        clock.now += 1.5
        replicas.get("r").in_flight = 0
        await asyncio.wait_for(waiting, 1.0)
        clock.now += 10
        return t, flow

    t, flow = asyncio.run(scenario())
    assert t.admitted and t.waited_s == pytest.approx(1.5) and t.remaining_timeout() == pytest.approx(2.5)
    assert not flow.requeue(t)  # past its deadline: the refusal goes to the client
    off = FlowControl(FlowOptions(), Saturation(FlowOptions(), lambda: []))
    assert not off.enabled and not off.requeue(t) and off.metric_lines() == []


async def routed_turn(flow, router, replicas, tenant: str):
    """One request of ``tenant`` through the flow control and the router: waits its turn, is
    routed, and returns the router's decision (``router.release`` ends it)."""
    t = flow.turn(tenant, 0, 100, None)
    await flow.wait(t, replicas)
    decision = await router.choose(None)
    flow.started(t, decision)
    flow.routed(t)
    return decision


def test_a_tenant_at_its_share_leaves_the_last_slot_to_an_active_tenant():
    """Capacity 2 (one replica, two in flight), two active tenants: a share each. The flooder,
    holding one, is passed over while the quiet tenant (its last request ended within the
    window) holds none, so the quiet tenant's next request finds the slot free at once; once
    the quiet tenant has been idle past the window, the flooder takes both again."""
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, queue_size=8, max_in_flight_per_replica=2, share_window_s=1.0)
        router = Router(replicas, tokenizer=None, hash_model_id="m", policy_name="round_robin")

        def routed(tenant):
            return routed_turn(flow, router, replicas, tenant)

        quiet = await routed("quiet")
        flood = [await routed("flood")]
        router.release(quiet)  # quiet's request ended; it stays active for the window
        waiting = [asyncio.create_task(routed("flood")) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert flow.over_share(replicas) == {"flood"} and flow.queue.depth("flood") == 3
        assert replicas.get("r").in_flight == 1  # the free slot is kept for quiet
        quiet = await asyncio.wait_for(routed("quiet"), 1.0)  # at once, ahead of the flood's queue
        router.release(quiet)
        clock.now += 1.5  # quiet idle past the window: no longer active
        flood.append(await asyncio.wait_for(waiting[0], 1.0))
        assert flow.in_flight == {"flood": 2} and flow.over_share(replicas) == set()
        for decision in flood:
            router.release(decision)
        flood += await asyncio.wait_for(asyncio.gather(*waiting[1:]), 1.0)
        for decision in flood[2:]:
            router.release(decision)
        return flow

    flow = asyncio.run(scenario())
    assert not flow.in_flight and flow.num_unrouted == 0
    assert flow_control(FakeClock(), max_in_flight_per_replica=0).over_share(replica_set("r")) == set()


def test_two_slots_freed_at_once_leave_one_for_the_active_tenant():
    """Both tenants' requests end in the same pump round (two slots free): the flooder's first
    release counts toward its share before it is routed, so the pump does not give it the
    quiet tenant's slot too."""
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, queue_size=8, max_in_flight_per_replica=2, share_window_s=1.0, poll_s=0.05)
        router = Router(replicas, tokenizer=None, hash_model_id="m", policy_name="round_robin")

        def routed(tenant):
            return routed_turn(flow, router, replicas, tenant)

        quiet = await routed("quiet")
        flood = await routed("flood")
        waiting = [asyncio.create_task(routed("flood")) for _ in range(3)]
        await asyncio.sleep(0.01)
        router.release(quiet)  # both end before the pump's next round
        router.release(flood)
        await asyncio.sleep(0.2)
        in_flight = dict(flow.in_flight)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return in_flight

    assert asyncio.run(scenario()) == {"flood": 1}


def test_the_replica_gets_the_timeout_less_the_wait():
    wire = WireRequest.from_json({"text_input": "hi", "sampling_parameters": {"timeout": 4.0}})
    t = Turn("a", 0, 10, arrival=0.0, timeout_s=4.0)
    assert kept_deadline(wire, t) is wire  # no wait: unchanged
    t.waited_s = 1.25
    assert kept_deadline(wire, t).options.timeout == pytest.approx(2.75)
    assert kept_deadline(WireRequest.from_json({"text_input": "hi"}), t).options.timeout is None


def test_a_released_turn_is_ranked_at_the_replica_by_its_tenants_standing():
    """A tenant still waiting in its band when a turn of its is released (above its fair share)
    ranks after one that is not, within the band; the band stays first."""
    async def scenario():
        clock, replicas = FakeClock(), replica_set("r")
        flow = flow_control(clock, queue_size=8)
        replica = replicas.get("r")
        replica.in_flight = 1  # saturated
        released: list[Turn] = []

        async def one(tenant, cost, priority=0):
            t = flow.turn(tenant, priority, cost, None)
            await flow.wait(t, replicas)
            released.append(t)
            flow.started(t, SimpleNamespace())  # in flight until the end of the test: its tenant stays active
            flow.routed(t)

        async def alone(t):
            await flow.wait(t, replicas)
            flow.routed(t)

        solo = [flow.turn("solo", 0, 10, None) for _ in range(3)]  # a lone tenant is at its share: all 0
        waiters = [asyncio.create_task(alone(t)) for t in solo]
        await asyncio.sleep(0.01)
        replica.in_flight = 0
        await asyncio.gather(*waiters)
        assert [t.backlogged for t in solo] == [False] * 3 and not flow.released_backlogged
        replica.in_flight = 1
        tasks = [asyncio.create_task(one("flood", 500)) for _ in range(3)]
        tasks += [asyncio.create_task(one("quiet", 50)), asyncio.create_task(one("flood", 500, priority=2))]
        await asyncio.sleep(0.01)
        for _ in range(5):
            replica.in_flight = 0  # a request ended: one slot
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return released, flow

    released, flow = asyncio.run(scenario())
    ranks = [(t.tenant, t.priority, t.backlogged, t.replica_priority) for t in released]
    # flood's first two left with more of theirs waiting in band 0; its last and quiet's did not;
    # band 2's one was alone in its band (its tenant's band-0 requests do not count)
    assert ranks == [("flood", 0, True, 1), ("quiet", 0, False, 0), ("flood", 0, True, 1),
                     ("flood", 0, False, 0), ("flood", 2, False, 2 * NUM_STANDINGS)], ranks
    assert flow.released_backlogged == {("flood", 0): 2}
    lines = flow.metric_lines()
    assert 'pagoda_router_queue_released_backlogged_total{tenant="flood",priority="0"} 2' in lines
    assert 'pagoda_router_queue_released_backlogged_total{tenant="quiet",priority="0"} 0' in lines


def test_the_replica_gets_the_rank_and_bands_keep_their_order():
    wire = WireRequest.from_json({"text_input": "hi", "sampling_parameters": {"priority": 3}})
    assert as_released(wire, None) is wire  # flow control off: the client's priority as it came
    t = Turn("a", 3, 10, arrival=0.0)
    assert as_released(wire, t).options.priority == 3 * NUM_STANDINGS
    t.backlogged = True
    assert as_released(wire, t).options.priority == 3 * NUM_STANDINGS + 1
    ranks = {(band, backlogged): Turn("a", band, 1, 0.0, backlogged=backlogged).replica_priority
             for band in (-2, 0, 1, 7) for backlogged in (False, True)}
    for (band, _), rank in ranks.items():  # every rank of a band comes before every rank of a later band
        assert all(rank < other for (later, _), other in ranks.items() if later > band)
    # as a replica reads it, from the gRPC request the upstream client builds
    from pagoda.fleet.api.routed_request import RoutedRequest
    from pagoda.fleet.triton_wire import infer_inputs, request_parameters

    message = RoutedRequest("id", wire, turn=t).infer_request()
    read = WireRequest.from_triton_inputs(infer_inputs(message).get, request_parameters(message))
    assert read.options.priority == 3 * NUM_STANDINGS + 1


def test_flow_options_are_checked_naming_the_flag():
    for options, flag in ((FlowOptions(queue_size=-1), "--queue-size-per-tenant"),
                          (FlowOptions(max_wait_s=0), "--queue-max-wait"),
                          (FlowOptions(saturation_kv_usage=1.5), "--saturation-kv-usage"),
                          (FlowOptions(max_in_flight_per_replica=-2), "--max-in-flight-per-replica"),
                          (FlowOptions(share_window_s=-1), "--tenant-share-window")):
        with pytest.raises(ValueError, match=flag):
            options.check()


# ---------------------------------------------------------------- the gate
def test_gate_choose_waits_for_the_turn_then_routes():
    clock = FakeClock()
    gate = Gate(clock=clock, flow=FlowOptions(queue_size=2, max_in_flight_per_replica=1, poll_s=0.001))
    replicas = replica_set("a")
    router = Router(replicas, tokenizer=None, hash_model_id="m", policy_name="round_robin")
    params = WireRequest.from_json({"text_input": "hi", "max_tokens": 7, "priority": 2}).params

    async def scenario():
        first = gate.turn(None, None, params)
        held = await gate.choose(router, None, [], 1, first)  # room: at once; now a holds one
        assert gate.flow.num_unrouted == 0 and first.cost == 7 and first.tenant == "-"
        second = gate.turn(None, None, params)
        waiting = asyncio.create_task(gate.choose(router, None, [], 1, second))
        await asyncio.sleep(0.01)
        assert not waiting.done() and gate.flow.queue.depth("-") == 1
        router.release(held)
        decision = await asyncio.wait_for(waiting, 1.0)
        router.release(decision)
        return decision

    assert asyncio.run(scenario()).replica.replica_id == "a"
    assert Gate().turn(None, None, params) is None  # flow control off: no turn, choose as before


def test_router_flags_make_the_flow_options():
    from pagoda.fleet.router_cli import make_parser, options_from_args

    args = make_parser().parse_args(["--queue-size-per-tenant", "4", "--queue-max-wait", "5",
                                     "--max-in-flight-per-replica", "2", "--tenant-share-window", "0.5",
                                     "--saturation-kv-usage", "0.9"])
    assert options_from_args(args).flow == FlowOptions(queue_size=4, max_wait_s=5.0, max_in_flight_per_replica=2,
                                                       share_window_s=0.5, saturation_kv_usage=0.9)
    assert not options_from_args(make_parser().parse_args([])).flow.queue_size  # off by default
    with pytest.raises(ValueError, match="--queue-max-wait: must be a number of seconds > 0"):
        options_from_args(make_parser().parse_args(["--queue-max-wait", "0"]))


class _Call:
    """A replica's ``ModelStreamInfer`` call answering from a script."""

    def __init__(self, responses):
        self.responses, self.cancelled = list(responses), False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for response in self.responses:
            yield response

    def done(self):
        return True

    def cancel(self):
        self.cancelled = True


def test_a_request_refused_as_full_waits_in_the_queue_and_is_sent_again():
    """With flow control, a replica's overload refusal sends the request back to the router's
    queue (not to the client): it goes again once the replica's overload memory expires."""
    from types import SimpleNamespace

    from tritonclient.grpc import service_pb2

    from pagoda.fleet.api.routed_request import RoutedRequest
    from pagoda.fleet.api.upstream import GrpcUpstream
    from pagoda.fleet.triton_wire import infer_inputs, request_parameters

    clock = FakeClock()
    gate = Gate(clock=clock, flow=FlowOptions(queue_size=2, max_in_flight_per_replica=2, poll_s=0.001))
    replicas = replica_set("r")
    router = Router(replicas, tokenizer=None, hash_model_id="m", policy_name="round_robin")
    refused = service_pb2.ModelStreamInferResponse(error_message="overloaded: the waiting queue is full")
    answer = service_pb2.ModelStreamInferResponse()
    answer.infer_response.parameters["triton_final_response"].bool_param = True
    calls = [_Call([refused]), _Call([answer])]
    replicas.get("r")._grpc_stub = SimpleNamespace(ModelStreamInfer=lambda messages: calls[len(sent) - 1]
                                                   if sent.append(list(messages)) is None else None)
    sent: list = []
    wire = WireRequest.from_json({"text_input": "hi", "max_tokens": 4, "sampling_parameters": {"timeout": 30}})
    request = RoutedRequest("id", wire, turn=gate.turn(None, None, wire.params, wire.options))
    from pagoda.fleet.api.tracing import RouteSpan

    span = RouteSpan()  # tracing off: no span, nothing forwarded

    async def scenario():
        upstream = GrpcUpstream(router, gate, peer_pull_min_blocks=0)
        stream = asyncio.create_task(_collect(upstream.stream(None, request, span)))
        await asyncio.sleep(0.02)
        assert len(sent) == 1 and gate.flow.queue.depth("-") == 1  # refused once: waiting, not answered
        assert replicas.get("r").in_flight == 0
        clock.now += 1.5  # the overload memory (Retry-After 1 s) expired: room again
        return await asyncio.wait_for(stream, 1.0)

    out = asyncio.run(scenario())
    assert out == [answer] and len(sent) == 2 and request.turn.waited_s == pytest.approx(1.5)
    # read as the replica reads it: the second attempt carried the timeout less the wait
    timeouts = [WireRequest.from_triton_inputs(infer_inputs(m[0]).get, request_parameters(m[0])).options.timeout
                for m in sent]
    assert timeouts == [30, pytest.approx(28.5)]
    assert gate.flow.released[("-", 0)] == 2 and gate.flow.refused == {}


async def _collect(stream):
    return [response async for response in stream]


def test_the_http_doors_prefill_stage_waits_for_the_turn_too():
    """Disaggregated serving on the Triton HTTP door: the request's turn is taken before its
    prefill stage (it cannot skip the queue by being two-staged); one that cannot wait is refused."""
    from types import SimpleNamespace

    from pagoda.fleet.api import http_stages
    from pagoda.fleet.api.generate_request import GenerateRequest
    from pagoda.fleet.routing.replicas import parse_replicas_spec

    gate = Gate(flow=FlowOptions(queue_size=1, max_wait_s=0.05, max_in_flight_per_replica=1, poll_s=0.001))
    replicas = ReplicaSet("static")
    replicas.set_members(parse_replicas_spec("id=p,grpc=p:1,http=p:2,role=prefill;id=d,grpc=d:1,http=d:2,role=decode"))
    for replica in replicas.all():
        replica.in_flight = 1  # saturated
    router = Router(replicas, tokenizer=None, hash_model_id="m", policy_name="round_robin")
    generate = GenerateRequest.of_document({"text_input": "hi", "max_tokens": 2}, "pagoda", False)
    turn = gate.turn(None, None, generate.sampling, generate.wire.options)
    client = SimpleNamespace(path="/v2/models/pagoda/generate")
    with pytest.raises(QueueRefused, match="--queue-max-wait"):
        asyncio.run(http_stages.prefill(None, router, gate, None, generate, client, turn))
    assert gate.flow.refused[("-", 0, "max_wait")] == 1
