"""The thread that owns the engine.

The engine is not thread-safe, so exactly one thread (``EngineLoop``) touches it, through
the ``EngineClient`` protocol (``pagoda.engine.client``): nothing else of the
engine is reached from here. Triton's ``execute()`` runs on other threads; it only
*submits* typed commands (``serving.commands``: ``Add``, ``Abort``, ``LoRACommand``,
``RegisterLoRA``, ``Wake``) through a queue, which the loop dispatches by type. The loop:

1. drains the command queue, blocking briefly only when idle; an ``Add`` carries a
   ``ServingRequest`` whose ``WireRequest`` becomes one ``EngineRequest`` for ``engine.add``
   (``WireRequest.to_engine_request``: token ids the router made with this engine's tokenizer
   are used as they are);
2. every ``cancel_poll_interval_s`` asks each in-flight request ``is_cancelled()`` and
   aborts the cancelled ones in the engine (their KV blocks are freed at once);
3. while work exists, runs ``engine.step()``, tells the step observers of each output,
   turns each ``RequestOutput`` into a ``Response`` (``responses.make_response``) and hands
   it to the ``ResponseSender`` (``serving.response_sender``, its own thread);
4. after each step, hands ``engine.get_stats()`` and the step's block events to the
   observers (``serving.observers``: metrics, tracer, fleet publisher) *before* handing
   that step's responses over, so a client that got its final response reads current
   metrics. Observers are called through one guarded loop: they never fail a request;
5. with a ``drain_path`` (``pagoda serve`` sets one), once that file exists the loop is
   *draining* (looked for every ``DRAIN_POLL_INTERVAL_S`` and before each new request is
   admitted): new requests get an UNAVAILABLE error saying so, those in flight run to
   their end, and when none is left it creates ``<drain_path>.done``. The launcher then
   asks the model to finalize (``serving.finalize_request``), which stops this loop
   (tritonserver's own unload would cut decoupled streams short). The
   observers hear ``on_drain``: with a fleet publisher, the publisher sets the replica's
   Redis drain flag (``PublisherObserver``; routers send it nothing new).

LoRA control requests (``control()``, docs/lora.md) share the loop: see
``serving.lora_control`` (a load reads the adapter off this thread, then registers on it).

A failed delivery (client gone) comes back to the loop as an ``Abort`` command.

Disaggregated prefill/decode (``kv_connector``, ``serving.kv_transfer_control``): a request
whose ``kv_transfer_params`` name a prefill replica is parked, not added, until its prompt's
blocks were pulled into the prefix cache (or the pull failed); the connector's threads wake
the loop, whose every iteration polls it (answering peers' pulls, committing arrivals). A
parked request counts as in flight for the drain, an abort and a stop. A request with
``do_remote_decode`` gets the KV handle as the ``kv_transfer_params`` output of its final
response.

Invariants:
- every request gets exactly one response with ``is_final`` (its last output, an error,
  or the shutdown error); a request leaves ``_in_flight`` exactly when that is queued;
- a bad request (``ValueError`` from ``engine.add``) gets an error and nothing else; a
  request admission control refuses (``EngineOverloaded``) gets an ``UNAVAILABLE`` error;
- an engine exception fails every in-flight request with an error and aborts them in the
  engine; the loop keeps running, so the model keeps answering new requests;
- ``stop()`` sets the stop event, fails what is in flight, joins the loop and loader
  threads, answers commands still queued (requests, control requests) with the shutdown
  error, then tells the observers ``on_stop`` (the fleet publisher deregisters).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from pagoda.engine.core.load_shedding import EngineOverloaded
from pagoda.engine.client import EngineClient
from pagoda.engine.request import EngineRequest
from pagoda.serving.commands import Abort, Add, Command, LoRACommand, RegisterLoRA, ServingRequest, Wake, request_of
from pagoda.contracts.errors import DRAINING_MESSAGE
from pagoda.serving.lora_control import SHUTDOWN_MESSAGE, LoRAController
from pagoda.serving.observers import Observers, StepObserver
from pagoda.serving.response_sender import ResponseSender
from pagoda.engine.kv_transfer.connector import KVConnector
from pagoda.engine.parallel.workers import TensorParallelWorkerDied
from pagoda.serving.kv_transfer_control import KVTransferControl
from pagoda.serving.responses import Response, make_error_response, make_response

logger = logging.getLogger(__name__)

__all__ = ["EngineLoop", "ResponseSender", "ServingRequest"]  # ResponseSender, ServingRequest: their old home



class EngineLoop:
    """Owns the engine on one thread.

    Args:
        engine: the engine (``LLMEngine``, or a test fake with the same ``EngineClient`` methods).
        sender: where responses go.
        observers: step observers (``serving.observers``: metrics, tracer, fleet publisher),
            called in this order through one guarded loop.
        cancel_poll_interval_s: how often in-flight requests are asked ``is_cancelled()``
            (each ask is an IPC round trip to the server, so not every step).
        idle_wait_s: how long the loop blocks on the command queue when there is no work.
        drain_path: a file whose appearance starts the drain (see the module doc).
        allow_runtime_lora: accept LoRA ``load``/``unload`` control requests.
        kv_connector: a listening ``KVConnector`` over ``engine`` for disaggregated
            prefill/decode (``serving.kv_transfer_control``); None: such requests are refused.
        on_fatal: called (with the error) when the engine can never step again (a tensor-
            parallel worker died), after every request in flight got that error; the Triton
            model ends its stub so ``pagoda serve`` restarts the model (not ready meanwhile).
        tokenizer: the engine's tokenizer fingerprint: a request whose token ids that tokenizer
            made (the router's) is not encoded again.
    """

    DRAIN_POLL_INTERVAL_S = 0.2

    def __init__(self, engine: EngineClient, sender: ResponseSender, observers: Sequence[StepObserver] = (),
                 cancel_poll_interval_s: float = 0.05, idle_wait_s: float = 0.1, drain_path: Optional[str] = None,
                 allow_runtime_lora: bool = False, decode_token: Callable[[int], str] = str,
                 kv_connector: Optional[KVConnector] = None,
                 on_fatal: Callable[[str], None] = lambda message: None, tokenizer: Optional[str] = None) -> None:
        self._engine = engine
        self._tokenizer = tokenizer  # the engine's tokenizer fingerprint (WireRequest.prompt_tokenizer)
        self._decode_token = decode_token  # a token id's text (the vLLM dialect's decoded_token)
        self._sender = sender
        self._observers = Observers(observers)
        self._cancel_poll_interval_s = cancel_poll_interval_s
        self._idle_wait_s = idle_wait_s
        self._commands: "queue.Queue[Command]" = queue.Queue()
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
        self._lora = LoRAController(engine, sender, self._commands.put, self._stop.is_set, allow_runtime_lora)
        self._kv = KVTransferControl(engine, kv_connector)
        self._on_fatal = on_fatal
        if kv_connector is not None:
            kv_connector.set_wake(lambda: self._commands.put(Wake()))

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._observers.on_start()
        self._thread.start()

    def submit(self, request: ServingRequest) -> None:
        """Queue a request for the engine. A text prompt whose token ids did not come with it
        (from a router with this engine's tokenizer) is tokenized here, on the caller's thread,
        not on the engine loop's: encoding a 900k-character prompt takes ~0.5 s of CPU that
        would otherwise stall every running stream's step. A prompt the engine refuses
        (``tokenize_prompt`` raises) is queued as is and refused by the loop's add with the
        same message (its bound is checked before any encoding)."""
        wire = request.wire
        if wire is not None and not wire.uses_given_token_ids(self._tokenizer):
            try:
                request.prompt_token_ids = self._engine.tokenize_prompt(wire.prompt, wire.params)
            except ValueError:
                pass
        self._commands.put(Add(request))

    def abort(self, request_id: str) -> None:
        """Queue an abort; the request's final response follows from the loop."""
        self._commands.put(Abort(request_id))

    def control(self, request: ServingRequest) -> None:
        """Queue a LoRA control request (``request.control`` is a ``LoRAControl``); returns at
        once. Its one final response follows (``serving.lora_control``)."""
        self._lora.submit(request)

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        """Stop the loop (in-flight requests get a shutdown error) and join it."""
        self._stop.set()
        self._commands.put(Wake())
        self._lora.shutdown()  # queued loads answer the shutdown error
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._kv.close()
        if not self._thread.is_alive():
            self._answer_leftover_commands()
        self._observers.on_stop()  # the fleet publisher deregisters: the heartbeat and the drain flag go

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_draining(self) -> bool:
        """Whether the loop has seen the drain file (new requests are refused from then on)."""
        return self._is_draining

    def _answer_leftover_commands(self) -> None:
        """After the loop ended: what is still queued gets the shutdown error (nothing else would answer)."""
        while True:
            try:
                request = request_of(self._commands.get_nowait())
            except queue.Empty:
                return
            if request is not None:
                self._sender.put(request, make_error_response(SHUTDOWN_MESSAGE, "UNAVAILABLE"))

    # ------------------------------------------------------- the loop thread
    def _run(self) -> None:
        self._observe(stepped=False)
        while not self._stop.is_set():
            self._drain_commands(block=not self._engine.has_unfinished_requests())
            if self._stop.is_set():
                break
            for request in self._kv.poll():  # parked until their prompt's KV arrived
                self._admit(request)
            self._poll_drain()
            self._poll_cancellations()
            if self._engine.has_unfinished_requests():
                self._step()
            elif self._observers:
                self._observe_idle_events()
        self._fail_all(SHUTDOWN_MESSAGE, "UNAVAILABLE")

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: Command) -> None:
        match command:
            case Add(request):
                self._add(request)
            case Abort(request_id):
                self._abort(request_id)
            case RegisterLoRA(request, adapter):
                self._lora.register(request, adapter)
            case LoRACommand(request):
                self._lora.command(request)
            case Wake():
                pass  # only unblocks an idle loop
            case _:
                raise AssertionError(f"unknown engine-loop command {command!r}")

    def _add(self, request: ServingRequest) -> None:
        if self._stop.is_set():
            self._sender.put(request, make_error_response(SHUTDOWN_MESSAGE, "UNAVAILABLE"))
            return
        self._poll_drain(now=True)  # a request must not slip in between SIGTERM and the next poll
        if self._is_draining:
            self._sender.put(request, make_error_response(DRAINING_MESSAGE, "UNAVAILABLE"))
            return
        params = request.wire.options.kv_transfer_params if request.wire is not None else None
        if params:
            try:
                self._kv.check(params, bool(request.wire.images))
            except ValueError as exc:
                self._sender.put(request, make_error_response(str(exc)))
                return
            envelope = self._engine_request(request)
            ids = envelope.prompt_token_ids if isinstance(envelope.prompt, str) else envelope.prompt
            if params.get("do_remote_prefill") and ids and self._kv.start_pull(request, ids):
                return  # admitted when the blocks arrived (or the pull failed): _run
        self._admit(request)

    def _admit(self, request: ServingRequest) -> None:
        try:
            self._engine.add(self._engine_request(request))
        except EngineOverloaded as exc:  # admission control: refused at once, retry later
            self._sender.put(request, make_error_response(str(exc), "UNAVAILABLE"))
            return
        except ValueError as exc:
            self._sender.put(request, make_error_response(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - the engine failed; this request alone fails
            logger.exception("adding request %s failed", request.request_id)
            self._sender.put(request, make_error_response(f"engine error while adding the request: {exc}", "INTERNAL"))
            return
        self._in_flight[request.request_id] = request

    def _abort(self, request_id: str) -> None:
        parked = self._kv.take(request_id)
        if parked is not None:
            self._sender.put(parked, make_error_response("request cancelled while its KV transfer ran", "UNAVAILABLE"))
            return
        if request_id in self._in_flight and request_id not in self._aborting:
            self._aborting.add(request_id)
            try:
                self._engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort_request failed for %s", request_id)
                error = make_error_response("request aborted; the engine failed to abort it", "INTERNAL")
                self._finish(request_id, error)

    def _poll_drain(self, now: bool = False) -> None:
        """Look for the drain file (every ``DRAIN_POLL_INTERVAL_S``, or ``now``: a new request
        is about to be admitted); mark the drain done once nothing is in flight."""
        if self._drain_path is None or self._is_drained:
            return
        if not self._is_draining:
            clock = time.monotonic()
            if not now and clock - self._last_drain_poll < self.DRAIN_POLL_INTERVAL_S:
                return
            self._last_drain_poll = clock
            if not os.path.exists(self._drain_path):
                return
            self._is_draining = True
            logger.info("draining: %d request(s) in flight, no new ones", len(self._in_flight))
            self._observers.on_drain()  # the fleet publisher sets the replica's drain flag
        if not self._in_flight and not self._kv.num_parked:
            try:
                open(self._drain_path + ".done", "w").close()
            except OSError:
                logger.exception("cannot mark the drain done")
            self._is_drained = True

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
            if isinstance(exc, TensorParallelWorkerDied):  # no later step can succeed
                self._on_fatal(f"{type(exc).__name__}: {exc}")
            # A step that keeps failing would spin; back off a little each time.
            self._stop.wait(min(1.0, 0.05 * self._num_failed_steps))
            return
        self._num_failed_steps = 0
        ready: list[tuple[ServingRequest, Response]] = []
        for output in outputs:
            request = self._in_flight.get(output.request_id)
            if request is None:
                continue
            self._observers.on_output(request, output)
            response = make_response(request, output, self._decode_token)
            if output.finished and response is not None and (request.wire.options.kv_transfer_params or {}).get(
                    "do_remote_decode") and response.error is None:
                response.tensors["kv_transfer_params"] = np.array(
                    [self._kv.handle(len(output.prompt_token_ids)).encode()], dtype=np.object_)
            if output.finished:
                ready.append((self._take(output.request_id),
                              response or make_error_response("request finished without output", "INTERNAL")))
            elif response is not None:
                ready.append((request, response))
        # Observers first: a client that reads /metrics after its final response sees them.
        self._observe(stepped=True)
        for request, response in ready:
            self._sender.put(request, response)

    def _observe(self, stepped: bool) -> None:
        """Hand the engine's stats (and, after a step, its block events) to the observers."""
        if not self._observers:
            return
        try:
            stats = self._engine.get_stats()
            block_events = self._engine.take_block_events() if stepped else []
        except Exception:  # noqa: BLE001 - reading stats must never fail a step
            logger.exception("reading the engine's stats failed")
            return
        if stepped:
            self._observers.on_step(stats, block_events)
        else:
            self._observers.on_refresh(stats)

    def _observe_idle_events(self) -> None:
        """Block events emitted since the last step while idle (the KV file tiers' writer thread),
        so the fleet's index learns a file written after the step that queued it."""
        try:
            block_events = self._engine.take_block_events()
        except Exception:  # noqa: BLE001 - reading events must never fail the loop
            logger.exception("reading the engine's block events failed")
            return
        if block_events:
            self._observers.on_block_events(block_events)

    def _engine_request(self, request: ServingRequest) -> EngineRequest:
        """The engine's envelope for a generation request."""
        assert request.wire is not None, f"request {request.request_id} is not a generation request"
        return request.wire.to_engine_request(request.request_id, request.arrival_time, self._tokenizer,
                                              request.prompt_token_ids)

    def _take(self, request_id: str) -> ServingRequest:
        """Remove a request from flight; its final response must follow."""
        self._aborting.discard(request_id)
        return self._in_flight.pop(request_id)

    def _finish(self, request_id: str, response: Response) -> None:
        assert response.is_final, "a request's last response must carry the final flag"
        self._sender.put(self._take(request_id), response)

    def _fail_all(self, message: str, error_code: str) -> None:
        for parked in self._kv.take_all():
            self._sender.put(parked, make_error_response(message, error_code))
        request_ids = list(self._in_flight)
        for request_id in request_ids:
            self._finish(request_id, make_error_response(message, error_code))
        if request_ids:
            try:
                self._engine.abort_request(request_ids)
            except Exception:  # noqa: BLE001
                logger.exception("aborting failed requests failed")
        self._observe(stepped=False)

