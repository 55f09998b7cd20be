"""The TensorRT-LLM front models (``ensemble``, ``tensorrt_llm_bls``; ``tensorrt_llm``, the
LLM-API dialect, in ``LLMAPIFront``): Triton glue.

Runs inside their Python-backend stubs (``model_repository/<name>/1/model.py`` imports
``TritonPythonModel`` from here). Each request's B batch items become B ``WireRequest``s
(read by the dialect that owns the vocabulary: ``serving.dialects.trtllm``, and
``serving.dialects.llmapi`` for ``LLMAPIFront``), checked here, and sent as B BLS requests
(``WireRequest.to_triton_inputs``) to pagoda's own model (config parameter ``target_model``,
default ``pagoda``), in decoupled mode, so the replica keeps **one engine**: the fronts hold
no model, only numpy (and, for ``embedding_bias_words``, the model's tokenizer, loaded on
first use). The dialects turn pagoda's responses back into their outputs.

- decoupled front (``decoupled: true``): one response per (item, sequence) as pagoda's
  responses arrive, each with ``batch_index`` / ``sequence_index``; then an empty final
  response. Streaming, each response carries its own tokens' generation-logit rows and, as
  TensorRT-LLM's do, the item's context logits (pagoda sends them once; the front repeats them:
  ``serving.dialects.trtllm``). A cancelled client request gets no further responses;
  tritonserver 2.51's BLS cannot cancel the request made to pagoda, so the engine finishes it
  (measured: the running count stays 1 after an LLM-API stop request).
- non-decoupled front (``decoupled: false``, TensorRT-LLM's ``decoupled_mode: false``):
  unary ``infer()`` gets one response holding every item's whole answer (texts ``[B * n]``),
  sent with the FINAL flag through the response sender (allowed in default mode), so
  ``execute`` returns at once and requests never wait for each other.

Both modes run each item in its own thread, blocked in BLS while the engine works, so one
instance serves any number of requests concurrently.

An error of one item ends that item with an error response (decoupled) or the request's
response (non-decoupled), with pagoda's message and Triton code.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from pathlib import Path
from typing import Optional

from pagoda.serving.dialects import llmapi
from pagoda.serving.media_fetch import fetcher_from_env
from pagoda.serving.dialects import trtllm as dialect
from pagoda.serving.wire import WireRequest

# pagoda's optional outputs, each behind its return_* input.
PAGODA_OUTPUTS = {"return_finish_reason": "finish_reason", "return_stop_reason": "stop_reason",
                  "return_cumulative_logprob": "cumulative_logprob", "return_logprobs": "logprobs",
                  "return_num_cached_tokens": "num_cached_tokens", "return_context_logits": "context_logits",
                  "return_generation_logits": "generation_logits"}


class TritonPythonModel:
    kv_metrics = staticmethod(dialect.kv_cache_metrics)

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.target = parameters.get("target_model") or "pagoda"
        target_config = Path(args["model_repository"]).parent / self.target / "config.pbtxt"
        target_text = target_config.read_text() if target_config.exists() else ""
        self.block_size = block_size_of(target_text)
        self.model_path = model_path_of(target_text)
        self.names = [entry["name"] for entry in config.get("input", [])]

    def encode(self, text):
        """The target model's tokens of ``text`` without special tokens (TensorRT-LLM's embedding bias)."""
        return _tokenizer(self.model_path).encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ requests
    def _items(self, request):
        """[(pagoda inputs, asked outputs)] of one request. Raises ValueError naming the input."""
        options = dialect.read_request_parameters(request.parameters())
        arrays = {}
        for name in self.names:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                arrays[name] = tensor.as_numpy()
        items = dialect.split_batch(arrays)
        if not items:
            raise ValueError("text_input: the batch is empty")
        wires = [WireRequest.from_dialect(dialect.read_item(item, self.decoupled, self.encode)).with_options(**options)
                 for item in items]
        outputs = set(request.requested_output_names())
        return [(wire.to_triton_inputs(), dialect.requested(item, outputs)) for wire, item in zip(wires, items)]

    def _forward(self, inputs, asked, is_cancelled=None):
        """Yield (pagoda output tensors, perf metrics) per pagoda response; raises on an error response."""
        pb = self.pb
        arrival = time.time_ns()
        names = ["text_output", "num_input_tokens", "num_output_tokens"]
        names += [name for flag, name in PAGODA_OUTPUTS.items() if flag in inputs]  # only true flags travel
        generated = 0
        request = pb.InferenceRequest(model_name=self.target, requested_output_names=names,
                                      inputs=[pb.Tensor(name, array) for name, array in inputs.items()])
        responses = request.exec(decoupled=True)
        first = None
        for response in responses:
            if response.has_error():
                raise _ItemError(response.error().message(), response.error().code())
            if is_cancelled is not None and is_cancelled():
                if hasattr(responses, "cancel"):
                    responses.cancel()
                return
            tensors = {n: t.as_numpy() for n in names
                       if (t := pb.get_output_tensor_by_name(response, n)) is not None}
            if "text_output" not in tensors:  # the empty final response
                continue
            now = time.time_ns()
            first = first or now
            # Streaming responses count this step's tokens, the final unary one all of them.
            generated = (generated if "stream" in inputs else 0) + int(tensors["num_output_tokens"].sum())
            perf = None
            if asked["perf"]:
                perf = self.kv_metrics(int(tensors["num_input_tokens"].reshape(-1)[0]), generated,
                                       int(tensors["num_cached_tokens"].reshape(-1)[0]), self.block_size)
                perf.update(arrival_time_ns=arrival, first_scheduled_time_ns=arrival, first_token_time_ns=first,
                            last_token_time_ns=now, acceptance_rate=0.0, total_accepted_draft_tokens=0,
                            total_draft_tokens=0)
            yield tensors, perf

    def _error(self, message, code=None):
        pb = self.pb
        code = pb.TritonError.INVALID_ARG if code is None else code
        return pb.InferenceResponse(error=pb.TritonError(message, code))

    # ---------------------------------------------------------------- decoupled
    def _serve_decoupled(self, request):
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender = request.get_response_sender()
        try:
            items = self._items(request)
        except ValueError as exc:
            sender.send(self._error(str(exc)), flags=final)
            return
        lock = threading.Lock()
        remaining = [len(items)]

        def run(b, inputs, asked):
            stream, context = "stream" in inputs, None
            try:
                for tensors, perf in self._forward(inputs, asked, sender.is_cancelled):
                    if stream and ("context_logits" in tensors or context is not None):
                        # pagoda sends them once; each of TensorRT-LLM's streamed responses carries them
                        context = tensors["context_logits"] = tensors.get("context_logits", context)
                    for s, text in enumerate(tensors["text_output"]):
                        if stream and not text and not tensors["num_output_tokens"][s]:
                            continue
                        out = dialect.to_trtllm_outputs(tensors, asked, b, s, perf, stream)
                        with lock:
                            sender.send(self.pb.InferenceResponse(
                                output_tensors=[self.pb.Tensor(n, a) for n, a in out.items()]))
            except _ItemError as exc:
                with lock:
                    sender.send(self._error(exc.message, exc.code))
            except Exception as exc:  # noqa: BLE001 - the client must hear of it
                with lock:
                    sender.send(self._error(f"internal error: {exc}", self.pb.TritonError.INTERNAL))
            finally:
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        sender.send(flags=final)

        for b, (inputs, asked) in enumerate(items):
            threading.Thread(target=run, args=(b, inputs, asked), daemon=True, name="pagoda-trtllm").start()

    # ------------------------------------------------------------ non-decoupled
    def _serve_unary(self, request):
        """One response holding every item's whole answer, sent from this request's own
        thread (the Python backend's response sender in default mode), so ``execute``
        returns at once and a long request never holds up the next."""
        sender = request.get_response_sender()
        try:
            items = self._items(request)
        except ValueError as exc:
            sender.send(self._error(str(exc)), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        results = [None] * len(items)
        threads = [threading.Thread(target=self._run_unary, args=(results, b, inputs, asked), daemon=True,
                                    name="pagoda-trtllm") for b, (inputs, asked) in enumerate(items)]

        def finish():
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            error = next((o for o in results if isinstance(o, _ItemError)), None)
            response = (self._error(error.message, error.code) if error is not None else self.pb.InferenceResponse(
                output_tensors=[self.pb.Tensor(n, a) for n, a in dialect.stack_items(results).items()]))
            sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        threading.Thread(target=finish, daemon=True, name="pagoda-trtllm").start()

    def _run_unary(self, results, b, inputs, asked):
        try:
            last = None
            for tensors, perf in self._forward(inputs, asked):
                last = dialect.to_trtllm_outputs(tensors, asked, b, None, perf)
            results[b] = last if last is not None else _ItemError("no response from the engine",
                                                                  self.pb.TritonError.INTERNAL)
        except _ItemError as exc:
            results[b] = exc
        except Exception as exc:  # noqa: BLE001 - the client must hear of it
            results[b] = _ItemError(f"internal error: {exc}", self.pb.TritonError.INTERNAL)

    def execute(self, requests):
        for request in requests:
            (self._serve_decoupled if self.decoupled else self._serve_unary)(request)
        return None


class LLMAPIFront(TritonPythonModel):
    """The LLM-API dialect's ``tensorrt_llm`` model (``serving.dialects.llmapi``): one prompt per request,
    no batch dimension, cumulative text, and stop requests (``stop`` true) that cancel the
    requests carrying their request id."""

    kv_metrics = staticmethod(llmapi.llmapi_kv_metrics)

    def initialize(self, args):
        super().initialize(args)
        self.lock = threading.Lock()
        self.in_flight = {}  # request id -> the stop events of its requests
        self.fetcher = fetcher_from_env()  # http(s) image_url fetching: pagoda serve --allowed-media-domains

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                options = dialect.read_request_parameters(request.parameters(), llmapi.INPUTS)
                arrays = {name: t.as_numpy() for name in self.names
                          if (t := self.pb.get_input_tensor_by_name(request, name)) is not None}
                if llmapi.is_stop_request(arrays):
                    self._stop(request.request_id(), sender)
                    continue
                read = llmapi.read_item(arrays, self.decoupled, self.fetcher)
                wire = WireRequest.from_dialect(read).with_options(**options)
                inputs, asked = wire.to_triton_inputs(), llmapi.requested(arrays)
            except ValueError as exc:
                sender.send(self._error(str(exc)), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            stop = threading.Event()
            with self.lock:
                self.in_flight.setdefault(request.request_id() or None, set()).add(stop)
            prefix = "" if wire.output.exclude_input_in_output else wire.prompt
            threading.Thread(target=self._run, daemon=True, name="pagoda-trtllm",
                             args=(request.request_id() or None, sender, inputs, asked, prefix, stop)).start()
        return None

    def _stop(self, request_id, sender):
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if not request_id:
            sender.send(self._error("stop: a request id must be provided for request cancellation"), flags=final)
            return
        with self.lock:
            for event in self.in_flight.get(request_id, ()):
                event.set()
        sender.send(self._cancelled(), flags=final)  # as TensorRT-LLM answers a stop request

    def _response(self, tensors):
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(n, a) for n, a in tensors.items()])

    def _cancelled(self):
        return self._error("Request cancelled by client", getattr(self.pb.TritonError, "CANCELLED", None))

    def _run(self, request_id, sender, inputs, asked, prefix, stop):
        final, stream, last, texts = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, "stream" in inputs, None, None
        try:
            for tensors, perf in self._forward(inputs, asked, lambda: sender.is_cancelled() or stop.is_set()):
                chunks = [t.decode("utf-8") for t in tensors["text_output"]]
                if stream:  # the LLM API's text is cumulative
                    texts = [(texts[i] if texts else prefix) + chunk for i, chunk in enumerate(chunks)]
                else:
                    texts = chunks
                last = llmapi.to_llmapi_outputs(tensors, texts, perf)
                if stream:
                    sender.send(self._response(last))
            if stop.is_set():
                sender.send(self._cancelled(), flags=final)
            elif stream or last is None:
                sender.send(flags=final)
            else:
                sender.send(self._response(last), flags=final)
        except _ItemError as exc:
            sender.send(self._error(exc.message, exc.code), flags=final)
        except Exception as exc:  # noqa: BLE001 - the client must hear of it
            sender.send(self._error(f"internal error: {exc}", self.pb.TritonError.INTERNAL), flags=final)
        finally:
            with self.lock:
                events = self.in_flight.get(request_id, set())
                events.discard(stop)
                if not events:
                    self.in_flight.pop(request_id, None)


class _ItemError(Exception):
    def __init__(self, message, code=None):
        super().__init__(message)
        self.message, self.code = message, code


FRONT_MODELS = ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")  # tensorrt_llm: LLMAPIFront


@functools.lru_cache(maxsize=None)
def _tokenizer(model_path: Optional[str]):
    from pagoda.models.gguf_import import default_model_dir
    from pagoda.models.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(model_path or default_model_dir())


def set_decoupled(config_text: str, decoupled: bool) -> str:
    """A front model's config.pbtxt with its ``decoupled`` policy set (``pagoda serve --trtllm-decoupled``)."""
    text, count = re.subn(r"(model_transaction_policy\s*\{\s*decoupled:\s*)(true|false)",
                          lambda m: m.group(1) + str(decoupled).lower(), config_text)
    if count != 1:
        raise ValueError("config.pbtxt: expected one model_transaction_policy { decoupled: ... }")
    return text


def _parameter(config_text: str, key: str) -> Optional[str]:
    match = re.search(r'key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config_text)
    return match.group(1) if match else None


def block_size_of(config_text: str, default: int = 16) -> int:
    """The ``block_size`` parameter of pagoda's config.pbtxt (KV-cache metrics' unit)."""
    value = _parameter(config_text, "block_size")
    return int(value) if value and value.isdigit() else default


def model_path_of(config_text: str) -> Optional[str]:
    """The ``model`` parameter of pagoda's config.pbtxt (``None``: the default model)."""
    return _parameter(config_text, "model") or None


def configure_fronts(repository: Path, decoupled: dict[str, bool]) -> None:
    """Set the front models' ``decoupled`` policy in a materialized repository.

    Raises:
        ValueError: ``decoupled`` names a model that is not a front of this repository.
    """
    for name, value in decoupled.items():
        config = repository / name / "config.pbtxt"
        if name not in FRONT_MODELS or not config.exists():
            raise ValueError(f"trtllm_decoupled: {name!r} is not a TensorRT-LLM front model of {repository} "
                             f"({', '.join(FRONT_MODELS)})")
        config.write_text(set_decoupled(config.read_text(), value))
