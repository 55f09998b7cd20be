"""Triton Python backend adapter for pagoda (decoupled).

Thin by design: converts Triton tensors to our dataclasses and back, and owns the two
threads. A request's inputs become one ``WireRequest`` (``pagoda.serving.wire``: read once,
through the dialects that own their vocabulary), responses come from
``pagoda.serving.responses``, the engine thread is ``pagoda.serving.engine_loop``, metrics
``pagoda.serving.metrics``; metrics, tracer and
the fleet publisher watch the loop as step observers (``pagoda.serving.observers``).

The stub must not outlive tritonserver (it runs the fleet heartbeat, which would keep a
dead replica advertised): ``process_tree.ParentWatch`` ends this process as soon as it is
reparented.

Under ``pagoda serve`` the launcher asks for ``finalize`` through a file after the drain
(``serving.finalize_request``: tritonserver runs without model control, so it would
finalize only at its exit, which an idle HTTP connection can cut short); ``finalize`` is
idempotent (tritonserver calls it again at exit), and requests that arrive after it get the
draining error.
"""

import functools
import itertools
import json
import logging
import os
import threading

import triton_python_backend_utils as pb_utils

from pagoda.contracts.errors import DRAINING_MESSAGE
from pagoda.serving.commands import ServingRequest
from pagoda.serving.dialects.pagoda import read_lora_control
from pagoda.serving.engine_loop import EngineLoop
from pagoda.serving.finalize_request import FinalizeWatch
from pagoda.serving.metrics import ServingMetrics
from pagoda.serving.model_config import (allow_runtime_lora, engine_config_from_parameters, kv_transfer_backend,
                                         kv_transfer_listen, output_dialect, report_custom_metrics,
                                         served_model_name)
from pagoda.serving.observers import make_observers
from pagoda.serving.process_tree import ORPHANED_STUB_MESSAGE, ParentWatch
from pagoda.serving.response_sender import ResponseSender
from pagoda.serving.responses import make_error_response
from pagoda.serving.tracing import make_request_tracer, read_traceparent
from pagoda.serving.wire import WireRequest

logger = logging.getLogger("pagoda.model")

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.parent_watch = ParentWatch(_end_orphaned_stub).start()
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("pagoda needs model_transaction_policy { decoupled: true }")
        parameters = model_config.get("parameters", {})
        config = engine_config_from_parameters(parameters)
        if config.device == "auto" and args.get("model_instance_kind") == "GPU":
            config.device = "cuda"
        if config.device == "cuda":
            import torch

            torch.cuda.set_device(int(args.get("model_instance_device_id", 0)))

        from pagoda.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config)
        labels = {
            "model_name": served_model_name(parameters, args["model_name"]),
            "model": args["model_name"],
            "version": args["model_version"],
        }
        self.metrics = ServingMetrics(pb_utils, labels, max_model_len=self.engine.max_model_len,
                                      report_vllm=report_custom_metrics(parameters))
        self.sender = ResponseSender(self._deliver, on_failure=lambda request_id: self.loop.abort(request_id))
        self.tracer = make_request_tracer(model_name=labels["model_name"])  # None unless an OTLP endpoint is set
        kv_connector = _kv_connector(self.engine, parameters)
        observers = make_observers(self.metrics, self.tracer, _fleet_publisher(self.engine, kv_connector))
        observers += _kv_event_stream(parameters)
        self.output_dialect = output_dialect(parameters)
        tokenizer = self.engine.tokenizer
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        decode_token = functools.lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
        # `pagoda serve` drains (engine_loop) and asks for finalize (finalize_request) through
        # this file; absent elsewhere.
        drain_path = os.environ.get("PAGODA_DRAIN_FILE") or None
        self.loop = EngineLoop(self.engine, self.sender, observers, drain_path=drain_path,
                               allow_runtime_lora=allow_runtime_lora(parameters), decode_token=decode_token,
                               kv_connector=kv_connector, tokenizer=tokenizer.fingerprint,
                               on_fatal=lambda message: _end_broken_stub(message, self.sender))
        self._request_numbers = itertools.count()
        self._finalize_lock = threading.Lock()
        self._is_finalized = False
        self.sender.start()
        self.loop.start()
        self.finalize_watch = FinalizeWatch(drain_path, self.finalize).start() if drain_path else None

    def execute(self, requests):
        if self._is_finalized:  # the launcher's finalize ran; tritonserver is about to exit
            error = pb_utils.TritonError(DRAINING_MESSAGE, pb_utils.TritonError.UNAVAILABLE)
            for request in requests:
                request.get_response_sender().send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
            return None
        for request in requests:
            response_sender = request.get_response_sender()
            triton_id = request.request_id() or "request"
            request_id = f"{triton_id}-{next(self._request_numbers)}"
            get_input = lambda name, request=request: _get_input(request, name)  # noqa: E731
            try:
                control = read_lora_control(get_input)  # None: a generation request
                wire = (WireRequest.from_triton_inputs(get_input, request.parameters(), self.encode)
                        if control is None else None)
            except ValueError as exc:
                self.sender.put(ServingRequest(request_id, None, response_sender), make_error_response(str(exc)))
                continue
            if control is not None:
                self.loop.control(ServingRequest(request_id, None, response_sender, control=control))
                continue
            traceparent = read_traceparent(request.parameters()) if self.tracer is not None else None
            self.loop.submit(ServingRequest(request_id, wire, response_sender, response_sender.is_cancelled,
                                            traceparent=traceparent,
                                            output_dialect=wire.output.dialect_or(self.output_dialect)))
        return None

    def finalize(self):
        # Twice under `pagoda serve` (the launcher's request, then tritonserver's exit): the
        # second call waits for the first to end, so the stub never exits half-finalized.
        with self._finalize_lock:
            if self._is_finalized:
                return
            self._is_finalized = True
            if self.finalize_watch is not None:
                self.finalize_watch.stop()
            self.parent_watch.stop()
            self.loop.stop()
            self.sender.stop()
            self.engine.shutdown()  # joins the device worker thread (async_scheduling)
            if self.tracer is not None:
                self.tracer.shutdown()

    @staticmethod
    def _deliver(response_sender, response):
        flags = _FINAL if response.is_final else 0
        if response.error is not None:
            code = getattr(pb_utils.TritonError, response.error_code, pb_utils.TritonError.INTERNAL)
            response_sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(response.error, code)),
                                 flags=flags)
            return
        tensors = [pb_utils.Tensor(name, array) for name, array in response.tensors.items()]
        try:
            response_sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
        except Exception:
            if response.is_final:
                # The client is gone; still close the request on the server side.
                response_sender.send(flags=_FINAL)
            raise


def _end_orphaned_stub():
    """tritonserver is gone: exit now, without finalize (nobody would get its responses),
    so the heartbeat stops and the replica's Redis key expires."""
    logging.getLogger("pagoda.model").error(ORPHANED_STUB_MESSAGE)
    os._exit(1)


def _end_broken_stub(message, sender):
    """The engine can never step again (a tensor-parallel worker died): end this stub, so
    ``pagoda serve`` sees it dead and restarts tritonserver (new stub, new workers). The
    error responses the engine loop just queued are sent first (up to 10 s): exiting with
    them queued left their clients waiting forever."""
    logging.getLogger("pagoda.model").error("the engine cannot continue (%s); ending the stub", message)
    sender.stop(timeout=10.0)
    os._exit(1)


def _get_input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _kv_event_stream(parameters):
    """The vLLM-format ZMQ event stream's observer when configured (``kv_events_config``), else none."""
    from pagoda.serving.kv_event_stream import ZmqEventPublisher, ZmqEventsObserver, kv_events_config

    try:
        config = kv_events_config(parameters)
        return [] if config is None else [ZmqEventsObserver(ZmqEventPublisher(config))]
    except ValueError as error:
        raise pb_utils.TritonModelException(str(error)) from None


def _kv_connector(engine, parameters):
    """A listening KV connector for disaggregated prefill/decode (``kv_transfer_listen``, over the
    ``kv_transfer_backend``), or None."""
    from pagoda.engine.kv_transfer.registry import make_kv_connector

    try:
        backend, listen = kv_transfer_backend(parameters), kv_transfer_listen(parameters)
        if listen is None:
            return None
        connector = make_kv_connector(backend, engine, listen=listen)
    except ValueError as error:
        raise pb_utils.TritonModelException(str(error)) from None
    logger.info("KV connector (%s) listening on %s", backend, connector.address)
    return connector


def _fleet_publisher(engine, kv_connector=None):
    """The replica's KV-event publisher when ``PAGODA_REDIS_URL`` is set, else None (logged on failure);
    its heartbeat advertises the KV connector, if any (routers pull prefixes from it).

    Composed here, at the edge: serving only knows its ``FleetPublisher`` protocol
    (``pagoda.serving.observers``)."""
    if not os.environ.get("PAGODA_REDIS_URL"):
        return None
    try:
        from pagoda.fleet.index.publisher import publisher_from_env

        publisher = publisher_from_env(engine)
        if publisher is not None and kv_connector is not None and kv_connector.address:
            publisher.advertise_kv(kv_connector.address)
        return publisher
    except Exception:  # noqa: BLE001 - serving without the fleet layer beats not serving
        logger.exception("fleet publisher not started")
        return None
