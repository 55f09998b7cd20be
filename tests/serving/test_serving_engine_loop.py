"""EngineLoop + ResponseSender against a fake engine: one final per request, aborts, faults,
LoRA control requests (load off the loop thread, register / unload / list on it), step
observers (one guarded loop, called before a step's responses are sent; the fleet
publisher's drain flag)."""

import inspect
import json
import threading
import time
from types import SimpleNamespace

import pytest

from pagoda.engine.core.load_shedding import EngineOverloaded, overload_message
from pagoda.engine.client import EngineClient
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.engine.request import EngineRequest
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.commands import ServingRequest
from pagoda.serving.engine_loop import EngineLoop
from pagoda.serving.response_sender import ResponseSender
from pagoda.contracts.request_options import RequestOptions
from pagoda.serving.dialects.pagoda import LoRAControl
from pagoda.serving.wire import OutputOptions, WireRequest


class FakeEngine:
    """An ``EngineClient``: one token ("t") per step per request; ``fail_next_step`` raises
    once from step(); each step emits one block event."""

    def __init__(self):
        self.requests = {}
        self.aborted = []
        self.fail_next_step = False
        self.num_steps = 0
        self.thread_ids = set()
        self.loras = {}  # name -> path
        self.lora_load_thread_ids = set()
        self.tokenize_thread_ids = set()
        self.prompt_token_ids = {}

    def tokenize_prompt(self, text, params=None):
        self.tokenize_thread_ids.add(threading.get_ident())
        if text == "cannot fit":
            raise ValueError("prompt: 9000000 characters cannot fit max_model_len 8192")
        return [len(text)]

    def add(self, request: EngineRequest):
        self.thread_ids.add(threading.get_ident())
        self.prompt_token_ids[request.request_id] = request.prompt_token_ids
        if request.prompt == "cannot fit":
            raise ValueError("prompt: 9000000 characters cannot fit max_model_len 8192")
        if request.prompt == "too long":
            raise ValueError("prompt: 9000 tokens exceed max_model_len 8192")
        if request.prompt == "overload":
            raise EngineOverloaded(overload_message("this replica's waiting queue is full"))
        if request.options.lora_name is not None and request.options.lora_name not in self.loras:
            raise ValueError(f"lora_name: unknown adapter {request.options.lora_name!r}")
        self.requests[request.request_id] = {"params": request.params, "tokens": 0, "abort": False,
                                             "lora": request.options.lora_name,
                                             "metrics": RequestMetrics(arrival_time=request.arrival_time)}

    # LoRA, shaped like LLMEngine's: load_lora may run on any thread, the rest on the loop's.
    def load_lora(self, name, path):
        self.lora_load_thread_ids.add(threading.get_ident())
        if not path.startswith("/adapters/"):
            raise ValueError(f"LoRA adapter {name!r}: {path} is not a folder")
        if name in self.loras:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
        return SimpleNamespace(name=name, path=path)

    def register_lora(self, adapter):
        self.thread_ids.add(threading.get_ident())
        if adapter.name in self.loras:
            raise ValueError(f"lora_name: an adapter named {adapter.name!r} is already loaded")
        self.loras[adapter.name] = adapter.path

    def remove_lora(self, name):
        self.thread_ids.add(threading.get_ident())
        if name not in self.loras:
            raise ValueError(f"lora_name: unknown adapter {name!r}")
        if any(r["lora"] == name for r in self.requests.values()):
            raise ValueError(f"lora_name: adapter {name!r} is in use by running or waiting requests")
        del self.loras[name]

    def list_loras(self):
        return sorted(self.loras)

    def lora_paths(self):
        self.thread_ids.add(threading.get_ident())
        return dict(sorted(self.loras.items()))

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
                outputs=[CompletionOutput(index=0, text="t" * n, token_ids=[7] * n,
                                          delta_text="" if r["abort"] else "t",
                                          delta_token_ids=[] if r["abort"] else [7], finish_reason=reason)]))
            if reason is not None:
                del self.requests[rid]
        return outputs

    def get_stats(self):
        return SimpleNamespace(num_steps=self.num_steps, last_step_num_decode_seqs=len(self.requests))

    def take_block_events(self):
        events, self.num_events_taken = list(range(self.num_events_taken, self.num_steps)), self.num_steps
        return events

    num_events_taken = 0


def test_the_fake_engine_has_the_engine_clients_methods_with_llm_engines_signatures():
    """The loop reaches the engine only through EngineClient; the fake must match the real one."""
    members = [name for name in dir(EngineClient) if not name.startswith("_")]
    assert {"add", "abort_request", "step", "get_stats", "take_block_events", "load_lora"} <= set(members)
    assert isinstance(FakeEngine(), EngineClient)
    for name in members:
        expected = list(inspect.signature(getattr(EngineClient, name)).parameters)
        assert list(inspect.signature(getattr(LLMEngine, name)).parameters) == expected, name
        assert list(inspect.signature(getattr(FakeEngine, name)).parameters) == expected, name


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


def request(rid, max_tokens=3, stream=True, prompt="p", cancelled=lambda: False, lora_name=None):
    wire = WireRequest(prompt=prompt, params=SamplingParams(max_tokens=max_tokens),
                       options=RequestOptions(lora_name=lora_name), output=OutputOptions(stream=stream))
    return ServingRequest(rid, wire, handle=rid, is_cancelled=cancelled)


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


def test_prompts_are_tokenized_on_the_submitting_thread_never_the_loops(loop_parts):
    """A huge prompt's encoding (~0.5 s for 900k characters) must not stall the engine
    loop's step: submit() tokenizes on the caller's thread and the engine gets the ids."""
    engine, collector, loop, _ = loop_parts
    loop.submit(request("a", prompt="hello"))
    loop.submit(request("b", prompt="cannot fit"))
    collector.wait_final(["a", "b"])
    assert engine.tokenize_thread_ids == {threading.get_ident()}
    assert threading.get_ident() not in engine.thread_ids
    assert engine.prompt_token_ids == {"a": [5], "b": None}  # refused: the loop's add says why
    assert "cannot fit" in finals(collector, "b")[0].error


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
        deadline = time.monotonic() + 5.0
        while not loop.is_draining:  # seen on a poll (every DRAIN_POLL_INTERVAL_S); a busy machine is slower
            assert time.monotonic() < deadline, "the loop never noticed the drain file"
            time.sleep(0.01)
        loop.submit(request("new"))
        collector.wait_final(["new"])
        (refused,) = collector.responses["new"]
        assert refused.error_code == "UNAVAILABLE" and "draining" in refused.error
        # The request in flight keeps running, and the drain is not done while it does.
        num_before = len(collector.responses["old"])
        deadline = time.monotonic() + 5.0
        while len(collector.responses["old"]) <= num_before:
            assert time.monotonic() < deadline, "the request in flight stopped while draining"
            time.sleep(0.01)
        assert not finals(collector, "old")
        assert not (tmp_path / "drain.done").exists()
        loop.abort("old")  # its end (here an abort; normally its last token)
        collector.wait_final(["old"])
        wait_for_drain_done(tmp_path)
    finally:
        loop.stop()
        sender.stop()


def test_a_request_arriving_just_after_the_drain_began_is_refused(tmp_path):
    """The drain file is looked for on every new request, not only on the loop's periodic poll:
    a request submitted right after it appears (before any poll could see it) is refused."""
    engine, collector = FakeEngine(), Collector()
    sender = ResponseSender(collector.deliver)
    drain = tmp_path / "drain"
    loop = EngineLoop(engine, sender, idle_wait_s=0.01, drain_path=str(drain))
    loop.DRAIN_POLL_INTERVAL_S = 3600.0  # the periodic poll never comes round in this test
    sender.start()
    loop.start()
    try:
        loop.submit(request("before", max_tokens=2))
        collector.wait_final(["before"])
        drain.touch()
        loop.submit(request("after"))
        collector.wait_final(["after"])
        (refused,) = collector.responses["after"]
        assert refused.error_code == "UNAVAILABLE" and "draining" in refused.error and loop.is_draining
    finally:
        loop.stop()
        sender.stop()


# ------------------------------------------------------------------ LoRA control requests
@pytest.fixture
def lora_loop():
    """A loop that allows runtime LoRA updates."""
    engine, collector = FakeEngine(), Collector()
    sender = ResponseSender(collector.deliver)
    loop = EngineLoop(engine, sender, cancel_poll_interval_s=0.0, idle_wait_s=0.01, allow_runtime_lora=True)
    sender.start()
    loop.start()
    yield engine, collector, loop
    loop.stop()
    sender.stop()


def control(loop, collector, rid, action, name=None, path=None):
    """Send one control request and return its one (final) response."""
    loop.control(ServingRequest(rid, None, handle=rid, control=LoRAControl(action, name, path)))
    collector.wait_final([rid])
    (response,) = collector.responses[rid]
    assert response.is_final
    return response


def document(response):
    assert response.error is None, response.error
    return json.loads(response.tensors["text_output"][0])


def test_lora_load_reads_off_the_loop_thread_registers_on_it_then_serves(lora_loop):
    engine, collector, loop = lora_loop
    loop.submit(request("warm", max_tokens=1))  # so the loop thread is known
    collector.wait_final(["warm"])
    assert document(control(loop, collector, "l1", "load", "sql", "/adapters/sql")) == {
        "action": "load", "lora_name": "sql", "lora_path": "/adapters/sql", "loaded": ["sql"]}
    (loop_thread,) = engine.thread_ids
    assert engine.lora_load_thread_ids and loop_thread not in engine.lora_load_thread_ids
    loop.submit(request("gen", max_tokens=2, lora_name="sql"))  # the next step may use it
    collector.wait_final(["gen"])
    assert finals(collector, "gen")[0].error is None
    assert document(control(loop, collector, "l2", "list")) == {
        "action": "list", "loaded": ["sql"], "paths": {"sql": "/adapters/sql"}, "allow_runtime_lora": True}
    for rid, path, message in [("l3", "/adapters/sql", "already loaded"), ("l4", "/elsewhere", "is not a folder")]:
        error = control(loop, collector, rid, "load", "sql", path)
        assert error.error_code == "INVALID_ARG" and message in error.error
    assert len(engine.thread_ids) == 1, "only the loop thread may touch the engine's state"


def test_lora_unload_refused_while_in_use_then_done(lora_loop, monkeypatch):
    from pagoda.serving import lora_control

    trims = []
    monkeypatch.setattr(lora_control, "release_free_heap", lambda: trims.append(threading.current_thread().name))
    assert lora_control.LoRAController.__module__ and callable(lora_control.release_free_heap)
    engine, collector, loop = lora_loop
    document(control(loop, collector, "l1", "load", "sql", "/adapters/sql"))
    loop.submit(request("busy", max_tokens=10_000, lora_name="sql"))
    while not collector.responses.get("busy"):
        time.sleep(0.001)
    refused = control(loop, collector, "u1", "unload", "sql")
    assert refused.error_code == "INVALID_ARG" and "in use" in refused.error
    loop.abort("busy")
    collector.wait_final(["busy"])
    assert document(control(loop, collector, "u2", "unload", "sql")) == {
        "action": "unload", "lora_name": "sql", "lora_path": "/adapters/sql", "loaded": []}
    _wait_for(lambda: trims)  # the unloaded adapter's freed heap goes back to the OS, off the loop thread
    assert trims == ["pagoda-lora-loader_0"]
    unknown = control(loop, collector, "u3", "unload", "sql")
    assert "unknown adapter 'sql'" in unknown.error
    loop.submit(request("gone", lora_name="sql"))
    collector.wait_final(["gone"])
    assert "unknown adapter 'sql'" in finals(collector, "gone")[0].error


def _wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_release_free_heap_returns_freed_heap_pages_that_free_keeps():
    """Freed chunks below a live one stay resident after ``free``; ``malloc_trim`` returns them."""
    from pagoda.serving.heap import release_free_heap

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    blobs = [bytearray(64 * 1024) for _ in range(1600)]  # 100 MiB of heap chunks (below the mmap threshold)
    pin = bytearray(64 * 1024)  # allocated last: the heap's top cannot shrink when the blobs are freed
    del blobs
    before = rss_mb()
    assert release_free_heap()
    assert before - rss_mb() > 50, "malloc_trim returned less than half of the freed 100 MiB"
    del pin


def test_lora_load_and_unload_refused_without_the_runtime_flag_list_answers(loop_parts):
    engine, collector, loop, _ = loop_parts
    for rid, action, name, path in [("l", "load", "sql", "/adapters/sql"), ("u", "unload", "sql", None)]:
        error = control(loop, collector, rid, action, name, path)
        assert error.error_code == "INVALID_ARG"
        assert "runtime LoRA updating is not enabled" in error.error and "--allow-runtime-lora" in error.error
    assert engine.loras == {} and not engine.lora_load_thread_ids
    assert document(control(loop, collector, "ls", "list")) == {
        "action": "list", "loaded": [], "paths": {}, "allow_runtime_lora": False}


def test_lora_control_after_stop_gets_the_shutdown_error():
    engine, collector = FakeEngine(), Collector()
    sender = ResponseSender(collector.deliver)
    loop = EngineLoop(engine, sender, idle_wait_s=0.01, allow_runtime_lora=True)
    sender.start()
    loop.start()
    loop.stop()
    response = control(loop, collector, "late", "load", "sql", "/adapters/sql")
    sender.stop()
    assert response.error_code == "UNAVAILABLE" and "shutting down" in response.error


def test_commands_still_queued_at_stop_get_the_shutdown_error():
    """Every command that carries a request owes it one final response, even if the loop never ran it."""
    engine, collector = FakeEngine(), Collector()
    sender = ResponseSender(collector.deliver)
    loop = EngineLoop(engine, sender, idle_wait_s=0.01)  # never started: its queue is never drained
    sender.start()
    loop.submit(request("queued"))
    loop.abort("queued")
    loop.control(ServingRequest("ls", None, handle="ls", control=LoRAControl("list")))
    loop.stop()
    collector.wait_final(["queued", "ls"])
    sender.stop()
    for handle in ("queued", "ls"):
        (response,) = collector.responses[handle]
        assert response.is_final and response.error_code == "UNAVAILABLE" and "shutting down" in response.error
    assert engine.requests == {} and engine.thread_ids == set()


def wait_for_drain_done(folder, timeout_s: float = 5.0) -> None:
    """Until the loop marks its drain done (``<drain_path>.done``, drain_path = folder/"drain")."""
    deadline = time.monotonic() + timeout_s
    while not (folder / "drain.done").exists():
        assert time.monotonic() < deadline, "drain never marked done"
        time.sleep(0.01)
