"""Limits on every input the router accepts, and the router's own check of Triton HTTP bodies.

Every limit is a field of ``RequestLimits`` (``pagoda router --max-*`` flags) and every
refusal is a ``LimitError`` whose message starts with the offending parameter and names
the limit, answered as 400 (413 for the body size). The checks run before routing, so a
refused request costs no replica anything:

- body size (``max_body_bytes``): from ``Content-Length`` before a byte of the body is
  read (a chunked body is cut off by aiohttp at the same size), so a 10 MB body is
  refused in milliseconds instead of being parsed, rendered and tokenized first;
- prompt characters (``max_prompt_chars``, the replicas' own bound), chat messages
  (``max_messages``);
- sampling: ``max_tokens`` (``max_tokens_limit``), ``n``, ``logprobs``/``top_logprobs``,
  the number and length of stop strings, the number of ``stop_token_ids``.

``default_max_tokens`` is no limit but a fact about the replicas (their own
``--default-max-tokens``, 1024 by default): token quotas charge ``n`` x it for a request
without ``max_tokens`` (``Gate.num_tokens``). It is a router flag rather than a heartbeat
field because the charge is taken before the request is routed.

``validate_generate_body`` checks a Triton generate-extension body as the replica's own
front end should but does not (tritonserver answers a body it cannot parse with 500): the
body must be a JSON object; every key must be one of the model's inputs
(``GENERATE_INPUTS``), ``traceparent``, the extension's ``id`` (a string, echoed) and
``parameters`` (an object), or a key the replica reads as a request parameter
(``request_parameter_keys``: tritonserver turns any other top-level key into one, and the
replica reads them as sampling parameters the way Triton's vLLM backend does) — the same
vocabulary as the replica's, so a body one accepts the other accepts too; the keys of
``parameters`` likewise. Each input value must have its input's JSON type (``text_input``
a string or a list of one string, booleans ``true``/``false``, numbers as numbers). A
``sampling_parameters`` object is accepted and sent on as the JSON string the replica
expects. A body with ``lora_action`` (a LoRA control request) needs no ``text_input``. The
limits apply to sampling values wherever they come (``sampling_of_generate``). A body for
one of TensorRT-LLM's front models (``FRONT_INPUTS``: ``ensemble``, ``tensorrt_llm_bls``,
``tensorrt_llm``) is checked against that model's own inputs instead, with no request
parameter but ``cache_salt`` (the tenant salt the HTTP door adds for them).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.contracts import json_input
from pagoda.serving import trtllm_dialect, trtllm_llmapi
from pagoda.serving.vllm_dialect import request_parameter_vocabulary

# Triton generate inputs of model_repository/pagoda/config.pbtxt -> their JSON kind.
GENERATE_INPUTS: dict[str, str] = {
    "text_input": "string", "input_ids": "ints", "sampling_parameters": "json",
    "stream": "bool", "exclude_input_in_output": "bool", "return_finish_reason": "bool", "return_stop_reason": "bool",
    "return_cumulative_logprob": "bool", "return_logprobs": "bool", "return_num_input_tokens": "bool",
    "return_num_output_tokens": "bool", "return_num_cached_tokens": "bool",
    "max_tokens": "int", "min_tokens": "int", "top_k": "int", "end_id": "int", "beam_width": "int",
    "seed": "uint", "random_seed": "uint",
    "temperature": "number", "top_p": "number", "repetition_penalty": "number", "presence_penalty": "number",
    "frequency_penalty": "number",
    "stop_words": "strings", "bad_words": "strings", "lora_name": "string",
    "embedding_bias_words": "strings", "embedding_bias_weights": "numbers",
    "lora_action": "string", "lora_path": "string",  # a LoRA control request (http_api answers it)
}
GENERATE_PARAMETERS = ("traceparent",)  # top-level keys that are request parameters, not inputs
# TensorRT-LLM's front models on the replica (serving.trtllm_dialect / trtllm_llmapi): their own inputs,
# and the ones the router's limits read (max tokens, samples, stop strings).
FRONT_INPUTS = {"ensemble": trtllm_dialect.INPUTS, "tensorrt_llm_bls": trtllm_dialect.INPUTS,
                "tensorrt_llm": trtllm_llmapi.INPUTS}
FRONT_SAMPLING = {"max_tokens": "max_tokens", "sampling_param_max_tokens": "max_tokens", "num_return_sequences": "n",
                  "stop_words": "stop", "sampling_param_stop": "stop"}
# The generate extension's own keys: the request's id (echoed by tritonserver) and its
# request-parameter object (the vLLM backend's README sends sampling values there).
GENERATE_RESERVED = ("id", "parameters")


def request_parameter_keys() -> frozenset[str]:
    """The keys the replica reads as request parameters (``serving.vllm_dialect``'s one list,
    computed once): tritonserver turns a top-level generate key that is not an input into
    one, so the router accepts exactly the keys the replica would."""
    return request_parameter_vocabulary()


class LimitError(ValueError):
    """A request refused before routing; ``param`` names the field, ``status`` the HTTP code."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class RequestLimits:
    """The router's input limits (see the module docstring); every one is a router flag."""

    max_body_bytes: int = 4 * 2**20
    max_prompt_chars: int = 1_000_000
    max_tokens_limit: int = 32_768
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512
    max_stop_token_ids: int = 64
    max_messages: int = 1024
    # What the replicas apply to a request without max_tokens (`pagoda serve
    # --default-max-tokens`, the model repository's 1024): quotas charge it (gate.py).
    default_max_tokens: int = 1024

    def check_body_size(self, content_length: Optional[int]) -> None:
        if content_length is not None and content_length > self.max_body_bytes:
            raise LimitError(f"body: {content_length} bytes exceed this server's limit of {self.max_body_bytes} "
                             "bytes (router --max-body-bytes)", "body", status=413)

    def check_prompt(self, prompt: str, param: str = "prompt") -> None:
        if len(prompt) > self.max_prompt_chars:
            raise LimitError(f"{param}: {len(prompt)} characters exceed this server's limit of "
                             f"{self.max_prompt_chars} (router --max-prompt-chars)", param)

    def check_messages(self, messages: list) -> None:
        if len(messages) > self.max_messages:
            raise LimitError(f"messages: {len(messages)} messages exceed this server's limit of "
                             f"{self.max_messages} (router --max-messages)", "messages")

    def check_sampling(self, sampling: dict[str, Any]) -> None:
        """Check SamplingParams-named values (numbers may still be strings, vLLM-backend style)."""
        for name, limit, flag in (("max_tokens", self.max_tokens_limit, "max-tokens-limit"),
                                  ("n", self.max_n, "max-n"), ("logprobs", self.max_logprobs, "max-logprobs")):
            value = as_int(sampling.get(name))
            if value is not None and value > limit:
                raise LimitError(f"{name}: {value} exceeds this server's limit of {limit} (router --{flag})", name)
        stop = sampling.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > self.max_stop_strings:
            raise LimitError(f"stop: {len(stops)} stop strings exceed this server's limit of "
                             f"{self.max_stop_strings} (router --max-stop-strings)", "stop")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > self.max_stop_string_chars:
            raise LimitError(f"stop: a stop string of {longest} characters exceeds this server's limit of "
                             f"{self.max_stop_string_chars} (router --max-stop-string-chars)", "stop")
        ids = sampling.get("stop_token_ids")
        if isinstance(ids, list) and len(ids) > self.max_stop_token_ids:
            raise LimitError(f"stop_token_ids: {len(ids)} ids exceed this server's limit of "
                             f"{self.max_stop_token_ids} (router --max-stop-token-ids)", "stop_token_ids")


def as_int(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


# ------------------------------------------------------------------ Triton generate bodies
def validate_generate_body(body: bytes, limits: RequestLimits, model: str = "pagoda") -> dict[str, Any]:
    """Parse and check a generate-extension body for ``model``; returns it with
    ``sampling_parameters`` as text. A TensorRT-LLM front (``FRONT_INPUTS``) is checked
    against its own inputs, as the replica checks it.

    Raises:
        LimitError: naming the problem (not JSON, not an object, an unknown key, a value of
            the wrong type, a limit exceeded).
    """
    try:
        document = json_input.loads(body, "body")
    except json_input.JSONInputError as exc:
        raise LimitError(str(exc), exc.param) from None
    if not isinstance(document, dict):
        raise LimitError(f"body: must be a JSON object of inputs, got a JSON {_json_kind(document)}", "body")
    if model in FRONT_INPUTS:
        return _validate_front_body(document, limits, model)
    vocabulary = request_parameter_keys()
    unknown = sorted(set(document) - set(GENERATE_INPUTS) - set(GENERATE_PARAMETERS) - set(GENERATE_RESERVED)
                     - vocabulary)
    if unknown:
        raise LimitError(f"{unknown[0]}: unknown input or request parameter; the inputs are "
                         f"{', '.join(sorted(GENERATE_INPUTS))}", unknown[0])
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise LimitError(f"parameters: must be a JSON object, got a JSON {_json_kind(parameters)}", "parameters")
    unknown = sorted(set(parameters) - vocabulary - set(GENERATE_INPUTS))
    if unknown:
        raise LimitError(f"parameters.{unknown[0]}: unknown request parameter", f"parameters.{unknown[0]}")
    for name, value in parameters.items():  # tritonserver makes these the inputs of that name
        if name in GENERATE_INPUTS and GENERATE_INPUTS[name] != "json":
            parameters[name] = _check_input(name, GENERATE_INPUTS[name], value)
    if "id" in document and not isinstance(document["id"], str):
        raise LimitError(f"id: must be a string, got a JSON {_json_kind(document['id'])}", "id")
    is_control = "lora_action" in document  # a LoRA control request: no prompt (http_api answers it)
    if "text_input" not in document and "input_ids" not in document and not is_control:
        raise LimitError("text_input: required input is missing (or give input_ids)", "text_input")
    for name, value in document.items():
        if name in GENERATE_INPUTS:
            document[name] = _check_input(name, GENERATE_INPUTS[name], value)
    if is_control:
        return document
    limits.check_prompt(prompt_of(document), "text_input")
    limits.check_sampling(sampling_of_generate(document))
    return document


def _validate_front_body(document: dict[str, Any], limits: RequestLimits, model: str) -> dict[str, Any]:
    unknown = sorted(set(document) - set(FRONT_INPUTS[model]) - set(GENERATE_PARAMETERS) - set(GENERATE_RESERVED))
    if unknown:
        raise LimitError(f"{unknown[0]}: unknown input of TensorRT-LLM's {model} model; the inputs are "
                         f"{', '.join(sorted(FRONT_INPUTS[model]))}", unknown[0])
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict) or set(parameters) - {"cache_salt"}:
        raise LimitError("parameters: TensorRT-LLM's models read no request parameters", "parameters")
    if "text_input" not in document:
        raise LimitError("text_input: required input is missing", "text_input")
    limits.check_prompt(prompt_of(document), "text_input")
    one = lambda v: v[0] if isinstance(v, list) and len(v) == 1 else v  # noqa: E731 - [[x]]-style bodies
    limits.check_sampling({FRONT_SAMPLING[k]: (v if FRONT_SAMPLING[k] == "stop" else one(v))
                           for k, v in document.items() if k in FRONT_SAMPLING})
    return document


def _check_input(name: str, kind: str, value: Any) -> Any:
    if kind == "string":
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not isinstance(value, str):
            raise LimitError(f"{name}: must be a string, got a JSON {_json_kind(value)}", name)
    elif kind == "json":
        if isinstance(value, dict):
            return json.dumps(value)
        if not isinstance(value, str):
            raise LimitError(f"{name}: must be a JSON object (or a string holding one), got a JSON "
                             f"{_json_kind(value)}", name)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise LimitError(f"{name}: must be true or false, got {json.dumps(value)}", name)
    elif kind in ("int", "uint"):
        if isinstance(value, bool) or not isinstance(value, int) or (kind == "uint" and value < 0):
            raise LimitError(f"{name}: must be {'a non-negative' if kind == 'uint' else 'an'} integer, "
                             f"got {json.dumps(value)}", name)
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LimitError(f"{name}: must be a number, got {json.dumps(value)}", name)
    elif kind == "ints":
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise LimitError(f"{name}: must be a list of integers", name)
    elif kind == "numbers":
        if not all(isinstance(item, (int, float)) and not isinstance(item, bool)
                   for item in (value if isinstance(value, list) else [value])):
            raise LimitError(f"{name}: must be a number or a list of numbers", name)
    elif kind == "strings":
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise LimitError(f"{name}: must be a string or a list of strings", name)
    return value


def _json_kind(value: Any) -> str:
    return ("array" if isinstance(value, list) else "object" if isinstance(value, dict)
            else "boolean" if isinstance(value, bool) else "number" if isinstance(value, (int, float))
            else "null" if value is None else "string")


def prompt_of(document: dict[str, Any]) -> str:
    prompt = document.get("text_input")
    return prompt[0] if isinstance(prompt, list) and prompt else prompt if isinstance(prompt, str) else ""


def sampling_of_generate(document: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams-named values of a generate body (request parameters — top level or in
    ``parameters`` — then its JSON, then its scalar inputs, as the replica merges them)."""
    vocabulary = request_parameter_keys()
    sampling = {k: v for k, v in document.items() if k in vocabulary and k not in GENERATE_INPUTS}
    sampling.update(document.get("parameters") or {})
    sampling.update(sampling_object(document.get("sampling_parameters")))
    for name in ("max_tokens",):
        if name in document:
            sampling[name] = document[name]
    if "stop_words" in document:
        words = document["stop_words"]
        sampling["stop"] = [w for w in (words if isinstance(words, list) else [words]) if w]
    return sampling


def sampling_object(text: Any) -> dict[str, Any]:
    """The ``sampling_parameters`` object (``{}`` if absent or not an object: the replica names
    that); JSON that is invalid, non-finite, too deep or not Unicode is a ``LimitError`` here."""
    if isinstance(text, dict):
        json_input.check(text, "sampling_parameters")
        return dict(text)
    try:
        value = json_input.loads(text, "sampling_parameters") if isinstance(text, str) and text.strip() else {}
    except json_input.JSONInputError as exc:
        raise LimitError(str(exc), exc.param) from None
    return value if isinstance(value, dict) else {}


# ------------------------------------------------------------------ gRPC requests
def sampling_of_infer_request(request: Any) -> dict[str, Any]:
    """SamplingParams-named values of a ``ModelInferRequest`` (JSON + ``max_tokens``/``stop_words``)."""
    from pagoda.fleet.triton_wire import bytes_elements, read_string_input

    sampling = sampling_object(read_string_input(request, "sampling_parameters"))
    for index, tensor in enumerate(request.inputs):
        raw = request.raw_input_contents[index] if index < len(request.raw_input_contents) else b""
        if tensor.name == "max_tokens" and tensor.datatype == "INT32" and len(raw) == 4:
            sampling["max_tokens"] = struct.unpack("<i", raw)[0]
        elif tensor.name == "stop_words" and tensor.datatype == "BYTES":
            sampling["stop"] = [w.decode("utf-8", "replace") for w in bytes_elements(raw) if w]
    return sampling


_REMOVE = object()


def remove_sampling_value(request: Any, key: str) -> None:
    """Drop ``key`` from a ``ModelInferRequest``'s ``sampling_parameters`` JSON."""
    set_sampling_value(request, key, _REMOVE)


def set_sampling_value(request: Any, key: str, value: Any) -> None:
    """Set ``key`` in a ``ModelInferRequest``'s ``sampling_parameters`` JSON (added if absent).

    Keeps the request's encoding: raw contents if it uses them, else typed contents.
    Invalid JSON is left alone (the replica names the error)."""
    from pagoda.fleet.triton_wire import read_string_input

    text = read_string_input(request, "sampling_parameters")
    if text is not None and text.strip():
        try:
            values = json.loads(text)
        except ValueError:
            return
        if not isinstance(values, dict):
            return
    else:
        values = {}
    if value is _REMOVE:
        values.pop(key, None)
    else:
        values[key] = value
    encoded = json.dumps(values).encode("utf-8")
    uses_raw = len(request.raw_input_contents) > 0
    for index, tensor in enumerate(request.inputs):
        if tensor.name == "sampling_parameters":
            if uses_raw:
                request.raw_input_contents[index] = struct.pack("<I", len(encoded)) + encoded
            else:
                del tensor.contents.bytes_contents[:]
                tensor.contents.bytes_contents.append(encoded)
            return
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "sampling_parameters", "BYTES"
    tensor.shape.append(1)
    if uses_raw:
        request.raw_input_contents.append(struct.pack("<I", len(encoded)) + encoded)
    else:
        tensor.contents.bytes_contents.append(encoded)
