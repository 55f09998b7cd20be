"""Step observers on a live EngineLoop (fake engine): the order of events, one guarded loop
(a failing observer fails nothing), the metrics adapter, and the fleet publisher's life
cycle and drain flag."""

import threading
from types import SimpleNamespace

from pagoda.serving.engine_loop import EngineLoop
from pagoda.serving.metrics import ServingMetrics
from pagoda.serving.observers import MetricsObserver, PublisherObserver, StepObserver, make_observers
from pagoda.serving.response_sender import ResponseSender

from tests.serving.test_serving_engine_loop import Collector, FakeEngine, finals, request, wait_for_drain_done
from tests.serving.test_serving_metrics_unit import FakeMetricFamily, stats, value


class Recorder(StepObserver):
    """Appends every event it hears to a shared log (``on_drain``/``on_refresh`` inherit the no-op)."""

    def __init__(self, log, name="rec"):
        self.log, self.name = log, name

    def on_start(self):
        self.log.append((self.name, "start"))

    def on_output(self, request, output):
        self.log.append((self.name, "output", output.request_id, output.finished))

    def on_step(self, stats, block_events):
        self.log.append((self.name, "step", tuple(block_events)))

    def on_stop(self):
        self.log.append((self.name, "stop"))


class Broken(StepObserver):
    def on_output(self, request, output):
        raise RuntimeError("observer fell over")

    def on_step(self, stats, block_events):
        raise RuntimeError("observer fell over")


class FakePublisher:
    """A ``FleetPublisher`` that records calls."""

    def __init__(self):
        self.calls = []
        self.marked = threading.Event()

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")

    def submit_events(self, events):
        self.calls.append(("events", tuple(events)))

    def submit_stats(self, stats):
        self.calls.append(("stats", stats.num_steps))

    def mark_draining(self, ttl_s):
        self.calls.append(("draining", ttl_s))
        self.marked.set()


def run_loop(observers, *requests, log=None):
    """Serve ``requests`` to their finals on a fresh loop; deliveries are appended to ``log``."""
    engine, collector = FakeEngine(), Collector()
    log = [] if log is None else log

    def deliver(handle, response):
        log.append(("deliver", handle, response.is_final))
        collector.deliver(handle, response)

    sender = ResponseSender(deliver)
    loop = EngineLoop(engine, sender, observers, idle_wait_s=0.01)
    sender.start()
    loop.start()
    try:
        for r in requests:
            loop.submit(r)
        collector.wait_final([r.request_id for r in requests])
    finally:
        loop.stop()
        sender.stop()
    return collector


def test_observers_hear_each_output_then_the_step_before_its_responses_are_sent():
    log = []
    run_loop([Recorder(log)], request("a", max_tokens=2), log=log)
    assert [entry for entry in log if entry[0] == "rec"] == [
        ("rec", "start"),
        ("rec", "output", "a", False), ("rec", "step", (0,)),
        ("rec", "output", "a", True), ("rec", "step", (1,)),
        ("rec", "stop"),
    ]
    # The sender runs on its own thread, but a step's responses are put after its on_step.
    assert log.index(("rec", "step", (0,))) < log.index(("deliver", "a", False))
    assert log.index(("rec", "step", (1,))) < log.index(("deliver", "a", True)) < log.index(("rec", "stop"))


def test_a_failing_observer_fails_no_request_and_the_next_observer_still_hears():
    log = []
    collector = run_loop([Broken(), Recorder(log)], request("a", max_tokens=2), request("b", max_tokens=1))
    assert all(finals(collector, rid)[0].error is None for rid in ("a", "b"))
    assert ("rec", "output", "a", True) in log and ("rec", "step", (1,)) in log


def test_metrics_observer_refreshes_on_refresh_and_counts_steps_only_on_step():
    FakeMetricFamily.created = {}
    metrics = ServingMetrics(SimpleNamespace(MetricFamily=FakeMetricFamily), {"model_name": "pagoda"})
    observer = MetricsObserver(metrics)
    observer.on_refresh(stats(num_steps=3, last_step_num_decode_seqs=2))
    assert value("vllm:num_requests_running") == 2 and value("pagoda:batched_decode_steps_total") == 0
    observer.on_step(stats(num_steps=4, last_step_num_decode_seqs=2, num_running=3), [])
    assert value("vllm:num_requests_running") == 3 and value("pagoda:batched_decode_steps_total") == 1


def test_publisher_is_started_fed_each_step_and_stopped_with_the_loop():
    publisher = FakePublisher()
    run_loop(make_observers(publisher=publisher), request("a", max_tokens=2))
    assert publisher.calls == ["start", ("events", (0,)), ("stats", 1), ("events", (1,)), ("stats", 2), "stop"]


def test_block_events_emitted_while_idle_reach_the_publisher_without_a_step():
    """The KV file tiers' writer thread emits its events after the step that queued the write:
    the idle loop hands them over (``on_block_events``), no step is counted."""
    publisher, engine = FakePublisher(), FakeEngine()
    loop = EngineLoop(engine, ResponseSender(lambda handle, response: None), make_observers(publisher=publisher),
                      idle_wait_s=0.01)
    loop.start()
    try:
        engine.num_steps = 1  # as if a writer thread emitted one event, no request in flight
        deadline = threading.Event()
        for _ in range(500):
            if ("events", (0,)) in publisher.calls:
                break
            deadline.wait(0.01)
    finally:
        loop.stop()
    assert publisher.calls == ["start", ("events", (0,)), "stop"]


def test_drain_has_the_publisher_set_the_drain_flag_before_it_stops(tmp_path):
    """The drain flag is the publisher's (``FleetPublisher.mark_draining``), set off the loop
    thread when the drain file appears, and set before the publisher stops (deregisters)."""
    publisher = FakePublisher()
    engine, collector = FakeEngine(), Collector()
    sender = ResponseSender(collector.deliver)
    drain = tmp_path / "drain"
    loop = EngineLoop(engine, sender, make_observers(publisher=publisher), idle_wait_s=0.01, drain_path=str(drain))
    sender.start()
    loop.start()
    try:
        drain.touch()
        assert publisher.marked.wait(5), "the drain flag was never set"
        wait_for_drain_done(tmp_path)
    finally:
        loop.stop()
        sender.stop()
    assert publisher.calls == ["start", ("draining", PublisherObserver.DRAIN_FLAG_TTL_S), "stop"]
