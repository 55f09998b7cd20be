"""The thread that owns the engine, and the thread that sends responses.

``LLMEngine`` is not thread-safe, so exactly one thread (``EngineLoop``) touches it.
Triton's ``execute()`` runs on other threads; it only *submits* commands through a queue.
The loop:

1. drains the command queue (``add`` / ``abort``), blocking briefly only when idle;
2. every ``cancel_poll_interval_s`` asks each in-flight request ``is_cancelled()`` and
   aborts the cancelled ones in the engine (their KV blocks are freed at once);
3. while work exists, runs ``engine.step()``, turns each ``RequestOutput`` into a
   ``Response`` (``triton_io.make_response``) and hands it to the ``ResponseSender``;
4. after each step, refreshes the metrics from ``engine.get_stats()`` before handing that
   step's responses over, so a client that got its final response reads current metrics.
5. with a ``drain_path`` (``pagoda serve`` sets one), once that file exists the loop is
   *draining*: new requests get an UNAVAILABLE error saying so, those in flight run to
   their end, and when none is left it creates ``<drain_path>.done``. The launcher then
   unloads the model (tritonserver's own unload would cut decoupled streams short). With
   a fleet publisher the replica also has it set its Redis drain flag (routers send it
   nothing new; it expires after ``DRAIN_FLAG_TTL_S`` should the process die); the
   publisher clears it when it deregisters on stop.

LoRA control requests (``control()``, docs/lora.md) share the loop: see
``serving.lora_control`` (a load reads the adapter off this thread, then registers on it).

The sender thread calls the adapter's ``deliver(handle, response)``, so a slow client
socket never stalls the engine. A failed delivery (client gone) comes back to the loop as
an abort command.

Invariants:
- every request gets exactly one response with ``is_final`` (its last output, an error,
  or the shutdown error); a request leaves ``_in_flight`` exactly when that is queued;
- a bad request (``ValueError`` from ``add_request``) gets an error and nothing else; a
  request admission control refuses (``EngineOverloaded``) gets an ``UNAVAILABLE`` error;
- an engine exception fails every in-flight request with an error and aborts them in the
  engine; the loop keeps running, so the model keeps answering new requests;
- ``stop()`` sets the stop event, fails what is in flight, joins the loop and loader
  threads, and answers commands still queued (requests, control requests) with the
  shutdown error.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from pagoda.engine.core.admission import EngineOverloaded
from pagoda.serving.lora_control import SHUTDOWN_MESSAGE, LoRAController
from pagoda.serving.triton_io import Response, make_error_response, make_response

logger = logging.getLogger(__name__)

_STOP = object()


class FleetPublisher(Protocol):
    """What the loop needs of the fleet's KV-event publisher (``pagoda.fleet.index.publisher``):
    serving imports nothing of the fleet; the Triton adapter composes the two."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def submit_events(self, events: Sequence[Any]) -> None: ...
    def submit_stats(self, stats: Any) -> None: ...
    def mark_draining(self, ttl_s: float) -> None: ...


@dataclass
class ServingRequest:
    """One request as the engine loop tracks it."""

    request_id: str
    parsed: Any  # a ParsedRequest (generation) or a LoRAControl (control request)
    handle: Any  # the adapter's response sender, opaque here
    is_cancelled: Callable[[], bool] = lambda: False
    arrival_time: float = field(default_factory=time.time)
    traceparent: Optional[str] = None  # W3C trace context from the router (serving/tracing.py)


class ResponseSender:
    """Delivers responses in order from its own thread.

    Args:
        deliver: ``deliver(handle, response)`` sends one response; raising means the
            client is gone.
        on_failure: called with the request id when a non-final delivery fails, so the
            engine can abort that request.
    """

    def __init__(self, deliver: Callable[[Any, Response], None],
                 on_failure: Callable[[str], None] = lambda request_id: None) -> None:
        self._deliver = deliver
        self._on_failure = on_failure
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pagoda-response-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, request: ServingRequest, response: Response) -> None:
        self._queue.put((request, response))

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        """Send what is queued, then end the thread and join it."""
        self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            request, response = item
            try:
                self._deliver(request.handle, response)
            except Exception as exc:  # noqa: BLE001 - any failure means the client is unreachable
                logger.info("response to %s not delivered: %s", request.request_id, exc)
                if not response.is_final:
                    self._on_failure(request.request_id)


class EngineLoop:
    """Owns the engine on one thread.

    Args:
        engine: an ``LLMEngine`` (or anything with its request/step/stats methods).
        sender: where responses go.
        metrics: a ``ServingMetrics`` or ``None``.
        cancel_poll_interval_s: how often in-flight requests are asked ``is_cancelled()``
            (each ask is an IPC round trip to the server, so not every step).
        idle_wait_s: how long the loop blocks on the command queue when there is no work.
        tracer: a ``serving.tracing.RequestTracer`` (or ``None``): finished requests that
            carry a ``traceparent`` get engine spans.
        publisher: a ``FleetPublisher`` (the replica's ``pagoda.fleet.index.publisher.Publisher``,
            built by the Triton adapter when ``PAGODA_REDIS_URL`` is set) fed with each
            step's block events and stats (it never blocks the loop), or ``None``.
        drain_path: a file whose appearance starts the drain (see the module doc).
        allow_runtime_lora: accept LoRA ``load``/``unload`` control requests.
    """

    DRAIN_POLL_INTERVAL_S = 0.2
    DRAIN_FLAG_TTL_S = 120

    def __init__(self, engine: Any, sender: ResponseSender, metrics: Any = None,
                 cancel_poll_interval_s: float = 0.05, idle_wait_s: float = 0.1, tracer: Any = None,
                 publisher: Optional[FleetPublisher] = None, drain_path: Optional[str] = None,
                 allow_runtime_lora: bool = False) -> None:
        self._engine = engine
        self._publisher = publisher
        self._tracer = tracer
        self._sender = sender
        self._metrics = metrics
        self._cancel_poll_interval_s = cancel_poll_interval_s
        self._idle_wait_s = idle_wait_s
        self._commands: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self._stop = threading.Event()
        self._in_flight: dict[str, ServingRequest] = {}
        self._aborting: set[str] = set()
        self._last_cancel_poll = 0.0
        self._num_failed_steps = 0
        self._drain_path = drain_path
        self._is_draining = False
        self._is_drained = False
        self._last_drain_poll = 0.0
        self._thread = threading.Thread(target=self._run, name="pagoda-engine-loop", daemon=True)
        self._lora = LoRAController(engine, sender, lambda kind, payload: self._commands.put((kind, payload)),
                                    self._stop.is_set, allow_runtime_lora)

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        if self._publisher is not None:
            self._publisher.start()
        self._thread.start()

    def submit(self, request: ServingRequest) -> None:
        """Queue a request for the engine (returns at once)."""
        self._commands.put(("add", request))

    def abort(self, request_id: str) -> None:
        """Queue an abort; the request's final response follows from the loop."""
        self._commands.put(("abort", request_id))

    def control(self, request: ServingRequest) -> None:
        """Queue a LoRA control request (``request.parsed`` is a ``LoRAControl``); returns at
        once. Its one final response follows (``serving.lora_control``)."""
        self._lora.submit(request)

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        """Stop the loop (in-flight requests get a shutdown error) and join it."""
        self._stop.set()
        self._commands.put(("wake", None))
        self._lora.shutdown()  # queued loads answer the shutdown error
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._answer_leftover_commands()
        if self._publisher is not None:
            self._publisher.stop()  # deregisters: the heartbeat and the drain flag go

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _answer_leftover_commands(self) -> None:
        """After the loop ended: what is still queued gets the shutdown error (nothing else would answer)."""
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            request = payload[0] if kind == "register" else payload
            if kind in ("add", "lora", "register"):
                self._sender.put(request, make_error_response(SHUTDOWN_MESSAGE, "UNAVAILABLE"))

    # ------------------------------------------------------- the loop thread
    def _run(self) -> None:
        self._refresh_metrics(stepped=False)
        while not self._stop.is_set():
            self._drain_commands(block=not self._engine.has_unfinished_requests())
            if self._stop.is_set():
                break
            self._poll_drain()
            self._poll_cancellations()
            if self._engine.has_unfinished_requests():
                self._step()
        self._fail_all(SHUTDOWN_MESSAGE, "UNAVAILABLE")

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._add(payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "register":
            self._lora.register(*payload)
        elif kind == "lora":
            self._lora.command(payload)

    def _add(self, request: ServingRequest) -> None:
        if self._stop.is_set():
            self._sender.put(request, make_error_response(SHUTDOWN_MESSAGE, "UNAVAILABLE"))
            return
        if self._is_draining:
            self._sender.put(request, make_error_response(
                "the replica is draining (shutting down): it finishes the requests it has and takes no new "
                "ones; retry on another replica", "UNAVAILABLE"))
            return
        parsed = request.parsed
        try:
            self._engine.add_request(request.request_id, parsed.prompt, parsed.params,
                                     arrival_time=request.arrival_time, priority=parsed.priority,
                                     cache_salt=parsed.cache_salt, lora_name=parsed.lora_name,
                                     timeout=parsed.timeout)
        except EngineOverloaded as exc:  # admission control: refused at once, retry later
            self._sender.put(request, make_error_response(str(exc), "UNAVAILABLE"))
            return
        except ValueError as exc:
            self._sender.put(request, make_error_response(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - the engine failed; this request alone fails
            logger.exception("add_request failed for %s", request.request_id)
            self._sender.put(request, make_error_response(f"engine error while adding the request: {exc}", "INTERNAL"))
            return
        self._in_flight[request.request_id] = request

    def _abort(self, request_id: str) -> None:
        if request_id in self._in_flight and request_id not in self._aborting:
            self._aborting.add(request_id)
            try:
                self._engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort_request failed for %s", request_id)
                self._finish(request_id, make_error_response("request aborted; the engine failed to abort it", "INTERNAL"))

    def _poll_drain(self) -> None:
        if self._drain_path is None or self._is_drained:
            return
        if not self._is_draining:
            now = time.monotonic()
            if now - self._last_drain_poll < self.DRAIN_POLL_INTERVAL_S:
                return
            self._last_drain_poll = now
            if not os.path.exists(self._drain_path):
                return
            self._is_draining = True
            logger.info("draining: %d request(s) in flight, no new ones", len(self._in_flight))
            threading.Thread(target=self._set_drain_flag, name="pagoda-drain-flag", daemon=True).start()
        if not self._in_flight:
            try:
                open(self._drain_path + ".done", "w").close()
            except OSError:
                logger.exception("cannot mark the drain done")
            self._is_drained = True

    def _set_drain_flag(self) -> None:
        """Tell routers (through the publisher) to send nothing new; off the loop thread (Redis may be slow)."""
        if self._publisher is None:
            return
        try:
            self._publisher.mark_draining(self.DRAIN_FLAG_TTL_S)
        except Exception:  # noqa: BLE001 - routers still get UNAVAILABLE from the loop
            logger.exception("setting the fleet drain flag failed")

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < self._cancel_poll_interval_s:
            return
        self._last_cancel_poll = now
        for request_id, request in list(self._in_flight.items()):
            try:
                cancelled = request.is_cancelled()
            except Exception:  # noqa: BLE001 - a sender we cannot ask is a client we lost
                cancelled = True
            if cancelled:
                self._abort(request_id)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:  # noqa: BLE001 - keep serving; fail only what was in flight
            logger.exception("engine step failed")
            self._num_failed_steps += 1
            self._fail_all(f"engine error: {type(exc).__name__}: {exc}", "INTERNAL")
            # A step that keeps failing would spin; back off a little each time.
            self._stop.wait(min(1.0, 0.05 * self._num_failed_steps))
            return
        self._num_failed_steps = 0
        ready: list[tuple[ServingRequest, Response]] = []
        for output in outputs:
            request = self._in_flight.get(output.request_id)
            if request is None:
                continue
            if self._metrics is not None:
                try:
                    self._metrics.record_output(output)
                except Exception:  # noqa: BLE001 - metrics must never fail a request
                    logger.exception("recording request metrics failed")
            response = make_response(request.parsed, output)
            if output.finished:
                self._trace(request, output)
                ready.append((self._take(output.request_id),
                              response or make_error_response("request finished without output", "INTERNAL")))
            elif response is not None:
                ready.append((request, response))
        # Metrics first: a client that reads /metrics after its final response sees them.
        self._refresh_metrics(stepped=True)
        for request, response in ready:
            self._sender.put(request, response)
        self._publish()

    def _publish(self) -> None:
        """Hand this step's block events and stats to the fleet publisher (non-blocking)."""
        if self._publisher is None:
            return
        try:
            self._publisher.submit_events(self._engine.take_block_events())
            self._publisher.submit_stats(self._engine.get_stats())
        except Exception:  # noqa: BLE001 - the fleet layer must never fail a step
            logger.exception("handing block events to the fleet publisher failed")

    def _trace(self, request: ServingRequest, output: Any) -> None:
        if self._tracer is None or request.traceparent is None:
            return
        try:
            self._tracer.record(request.traceparent, output)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            logger.exception("recording engine spans failed")

    def _take(self, request_id: str) -> ServingRequest:
        """Remove a request from flight; its final response must follow."""
        self._aborting.discard(request_id)
        return self._in_flight.pop(request_id)

    def _finish(self, request_id: str, response: Response) -> None:
        assert response.is_final, "a request's last response must carry the final flag"
        self._sender.put(self._take(request_id), response)

    def _fail_all(self, message: str, error_code: str) -> None:
        request_ids = list(self._in_flight)
        for request_id in request_ids:
            self._finish(request_id, make_error_response(message, error_code))
        if request_ids:
            try:
                self._engine.abort_request(request_ids)
            except Exception:  # noqa: BLE001
                logger.exception("aborting failed requests failed")
        self._refresh_metrics(stepped=False)

    def _refresh_metrics(self, stepped: bool) -> None:
        if self._metrics is None:
            return
        try:
            stats = self._engine.get_stats()
            self._metrics.update_engine(stats)
            self._metrics.update_lora(stats)
            if stepped:
                self._metrics.record_step(stats)
        except Exception:  # noqa: BLE001
            logger.exception("refreshing engine metrics failed")

