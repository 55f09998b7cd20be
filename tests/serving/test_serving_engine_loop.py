"""EngineLoop + ResponseSender against a fake engine: one final per request, aborts, faults."""

import threading
import time
from types import SimpleNamespace

import pytest

from pagoda.engine.admission import EngineOverloaded, overload_message
from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.engine_loop import EngineLoop, ResponseSender, ServingRequest
from pagoda.serving.triton_io import ParsedRequest


class FakeEngine:
    """One token ("t") per step per request; ``fail_next_step`` raises once from step()."""

    def __init__(self):
        self.requests = {}
        self.aborted = []
        self.fail_next_step = False
        self.num_steps = 0
        self.thread_ids = set()

    def add_request(self, request_id, prompt, params, *, arrival_time=None, priority=0, cache_salt=None,
                    lora_name=None, timeout=None):
        self.thread_ids.add(threading.get_ident())
        if prompt == "too long":
            raise ValueError("prompt: 9000 tokens exceed max_model_len 8192")
        if prompt == "overload":
            raise EngineOverloaded(overload_message("this replica's waiting queue is full"))
        self.requests[request_id] = {"params": params, "tokens": 0, "abort": False,
                                     "metrics": RequestMetrics(arrival_time=arrival_time)}

    def abort_request(self, request_ids):
        self.thread_ids.add(threading.get_ident())
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.requests:
                self.requests[rid]["abort"] = True
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("device fell over")
        self.num_steps += 1
        outputs = []
        for rid, r in list(self.requests.items()):
            if r["abort"]:
                reason = "abort"
            else:
                r["tokens"] += 1
                reason = "length" if r["tokens"] >= r["params"].max_tokens else None
            n = r["tokens"]
            outputs.append(RequestOutput(
                request_id=rid, prompt="p", prompt_token_ids=[1], finished=reason is not None, metrics=r["metrics"],
                outputs=[CompletionOutput(index=0, text="t" * n, token_ids=[7] * n, delta_text="" if r["abort"] else "t",
                                          delta_token_ids=[] if r["abort"] else [7], finish_reason=reason)]))
            if reason is not None:
                del self.requests[rid]
        return outputs

    def get_stats(self):
        return SimpleNamespace(num_steps=self.num_steps, last_step_num_decode_seqs=len(self.requests))


class Collector:
    """Records delivered responses per handle; can be told to fail deliveries."""

    def __init__(self):
        self.responses = {}
        self.lock = threading.Lock()
        self.final = threading.Condition(self.lock)
        self.failing = set()

    def deliver(self, handle, response):
        with self.lock:
            self.responses.setdefault(handle, []).append(response)
            self.final.notify_all()
        if handle in self.failing:
            raise ConnectionError("client gone")

    def wait_final(self, handles, timeout=10.0):
        deadline = time.monotonic() + timeout
        with self.lock:
            while not all(any(r.is_final for r in self.responses.get(h, [])) for h in handles):
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no final response for some of {handles}: {self.responses}"
                self.final.wait(remaining)


@pytest.fixture
def loop_parts():
    engine, collector = FakeEngine(), Collector()
    holder = {}
    sender = ResponseSender(collector.deliver, on_failure=lambda rid: holder["loop"].abort(rid))
    loop = EngineLoop(engine, sender, cancel_poll_interval_s=0.0, idle_wait_s=0.01)
    holder["loop"] = loop
    sender.start()
    loop.start()
    yield engine, collector, loop, sender
    loop.stop()
    sender.stop()
    assert not loop.is_alive


def request(rid, max_tokens=3, stream=True, prompt="p", cancelled=lambda: False):
    return ServingRequest(rid, ParsedRequest(prompt=prompt, params=SamplingParams(max_tokens=max_tokens), stream=stream),
                          handle=rid, is_cancelled=cancelled)


def finals(collector, handle):
    return [r for r in collector.responses[handle] if r.is_final]


def test_streams_deltas_with_exactly_one_final(loop_parts):
    engine, collector, loop, _ = loop_parts
    for i in range(4):
        loop.submit(request(f"r{i}", max_tokens=3 + i))
    collector.wait_final([f"r{i}" for i in range(4)])
    for i in range(4):
        responses = collector.responses[f"r{i}"]
        assert [r.tensors["text_output"].tolist() for r in responses] == [[b"t"]] * (3 + i)
        assert [r.is_final for r in responses] == [False] * (2 + i) + [True]
    assert len(engine.thread_ids) == 1, "only the loop thread may touch the engine"


def test_non_streaming_gets_one_response(loop_parts):
    _, collector, loop, _ = loop_parts
    loop.submit(request("a", max_tokens=4, stream=False))
    collector.wait_final(["a"])
    (response,) = collector.responses["a"]
    assert response.is_final and response.tensors["text_output"].tolist() == [b"ptttt"]


def test_rejected_request_gets_one_error_and_the_next_succeeds(loop_parts):
    _, collector, loop, _ = loop_parts
    loop.submit(request("bad", prompt="too long"))
    loop.submit(request("good"))
    collector.wait_final(["bad", "good"])
    (error,) = collector.responses["bad"]
    assert error.is_final and "max_model_len" in error.error and error.error_code == "INVALID_ARG"
    assert finals(collector, "good")[0].error is None


def test_overloaded_request_gets_one_unavailable_error(loop_parts):
    _, collector, loop, _ = loop_parts
    loop.submit(request("full", prompt="overload"))
    collector.wait_final(["full"])
    (error,) = collector.responses["full"]
    assert error.is_final and error.error_code == "UNAVAILABLE" and error.error.startswith("overloaded:")
    assert "Retry after" in error.error


def test_cancelled_request_is_aborted_once(loop_parts):
    engine, collector, loop, _ = loop_parts
    cancel = threading.Event()
    loop.submit(request("c", max_tokens=10_000, cancelled=cancel.is_set))
    while not collector.responses.get("c"):
        time.sleep(0.001)
    cancel.set()
    collector.wait_final(["c"])
    assert engine.aborted == ["c"]
    (final,) = finals(collector, "c")
    assert final.tensors["text_output"].tolist() == [b""]


def test_failed_delivery_aborts_the_request(loop_parts):
    engine, collector, loop, _ = loop_parts
    collector.failing.add("gone")
    loop.submit(request("gone", max_tokens=10_000))
    collector.wait_final(["gone"])
    assert engine.aborted == ["gone"]
    assert len(finals(collector, "gone")) == 1


def test_engine_fault_fails_in_flight_and_keeps_serving(loop_parts):
    engine, collector, loop, _ = loop_parts
    loop.submit(request("x", max_tokens=10_000))
    while not collector.responses.get("x"):
        time.sleep(0.001)
    engine.fail_next_step = True
    collector.wait_final(["x"])
    (final,) = finals(collector, "x")
    assert final.error_code == "INTERNAL" and "device fell over" in final.error
    loop.submit(request("y", max_tokens=2))
    collector.wait_final(["y"])
    assert finals(collector, "y")[0].error is None


def test_stop_fails_in_flight_requests_with_unavailable():
    engine, collector = FakeEngine(), Collector()
    sender = ResponseSender(collector.deliver)
    loop = EngineLoop(engine, sender, idle_wait_s=0.01)
    sender.start()
    loop.start()
    loop.submit(request("z", max_tokens=10_000))
    while not collector.responses.get("z"):
        time.sleep(0.001)
    loop.stop()
    sender.stop()
    assert not loop.is_alive
    (final,) = finals(collector, "z")
    assert final.error_code == "UNAVAILABLE"
    assert engine.aborted == ["z"]


def test_drain_refuses_new_requests_finishes_those_in_flight_then_marks_done(tmp_path):
    engine, collector = FakeEngine(), Collector()
    sender = ResponseSender(collector.deliver)
    drain = tmp_path / "drain"
    loop = EngineLoop(engine, sender, idle_wait_s=0.01, drain_path=str(drain))
    sender.start()
    loop.start()
    try:
        loop.submit(request("old", max_tokens=10_000_000))
        while not collector.responses.get("old"):
            time.sleep(0.001)
        drain.touch()
        time.sleep(EngineLoop.DRAIN_POLL_INTERVAL_S + 0.1)
        loop.submit(request("new"))
        collector.wait_final(["new"])
        (refused,) = collector.responses["new"]
        assert refused.error_code == "UNAVAILABLE" and "draining" in refused.error
        # The request in flight keeps running, and the drain is not done while it does.
        num_before = len(collector.responses["old"])
        time.sleep(0.1)
        assert len(collector.responses["old"]) > num_before and not finals(collector, "old")
        assert not (tmp_path / "drain.done").exists()
        loop.abort("old")  # its end (here an abort; normally its last token)
        collector.wait_final(["old"])
        deadline = time.monotonic() + 5
        while not (tmp_path / "drain.done").exists():
            assert time.monotonic() < deadline, "drain never marked done"
            time.sleep(0.01)
    finally:
        loop.stop()
        sender.stop()
