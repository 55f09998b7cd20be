"""Triton request tensors -> what the engine needs, and engine outputs -> response tensors.

ARCHITECTURE contract 1. Pure functions over numpy arrays, so they are tested without a
server; ``model.py`` only fetches the tensors and wraps the results.

Inputs (all optional but the prompt: ``text_input``, or ``input_ids``, its token ids as
TensorRT-LLM's INT32 input of that name, never both):

- Triton vLLM backend style: ``text_input`` (STRING), ``stream`` (BOOL),
  ``sampling_parameters`` (STRING holding a JSON object of ``SamplingParams`` fields, plus
  the request options ``priority``, ``cache_salt``, ``lora_name``, ``timeout`` (seconds
  from arrival after which the request ends with a "deadline exceeded" error) and
  ``kv_transfer_params`` (vLLM's disaggregated prefill/decode option:
  ``serving.kv_transfer_control``; the prefill side's final response carries the
  ``kv_transfer_params`` output, the KV handle); structured
  output as a ``guided_decoding`` object with one of ``json``, ``json_object``, ``regex``,
  ``choice``, ``grammar``), ``exclude_input_in_output`` and the ``return_*`` flags.
  As in that backend, numeric and boolean fields may also be given as strings
  (``{"temperature": "0.7", "max_tokens": "64"}``) as long as the string parses exactly,
  and the request's *parameters* (gRPC ``parameters=``, HTTP ``"parameters"``) are read as
  the same JSON; an unknown request parameter is refused, never ignored. vLLM's
  ``structured_outputs`` and the output dialect: ``vllm_dialect``.
- TensorRT-LLM style scalars: ``max_tokens``, ``min_tokens``, ``temperature``, ``top_k``,
  ``top_p``, ``seed`` (or ``random_seed``), ``repetition_penalty``, ``presence_penalty``,
  ``frequency_penalty``, ``stop_words`` (STRING list; empty strings ignored), ``end_id``
  (an extra stop token id), ``bad_words`` (STRING list: vLLM's ``bad_words``, sequences
  never generated), ``embedding_bias_words`` / ``embedding_bias_weights`` (each word's
  tokens get its weight as a ``logit_bias``, as TensorRT-LLM's preprocessing builds its
  embedding bias; needs ``encode``) and ``beam_width`` (above 1: beam search, as
  ``use_beam_search`` with that width; ``temperature`` then defaults to 0). A beam-search
  request's ``cumulative_logprob`` is each returned beam's summed log-probability, its
  ``logprobs`` (with the ``logprobs`` sampling field) each beam's per-token entries.

Precedence: a scalar input wins over the same key in ``sampling_parameters`` (it is the
more specific, per-tensor statement; TensorRT-LLM clients never send the JSON).
``end_id`` is added to ``stop_token_ids`` rather than replacing them.

Outputs: one element per completion (``n``) in ``text_output``, ``finish_reason``,
``stop_reason`` (the stop string or token id that ended it, ``"None"`` otherwise),
``cumulative_logprob``, ``logprobs`` (JSON, in the request's output dialect:
``vllm_dialect``) and ``num_output_tokens``; ``num_input_tokens`` and ``num_cached_tokens``
(the prompt tokens found in the prefix cache) have one element, and so does
``prompt_logprobs`` (JSON, ``vllm_dialect``), sent once (with the first tokens when
streaming) to a request that set the ``prompt_logprobs`` sampling parameter.
Streaming responses carry this step's deltas; a non-streaming response carries the whole
text, with the prompt in front unless ``exclude_input_in_output`` is true (the vLLM
backend's behaviour).
``finish_reason`` is ``""`` (pagoda dialect) or ``"None"`` (vLLM) until a completion finishes.

LoRA control requests (run-time adapter loading, docs/lora.md): a request with a
``lora_action`` input (``load`` | ``unload`` | ``list``) is not a generation. It carries
``lora_name`` (load, unload) and ``lora_path`` (load: a PEFT folder on the replica's disk)
and nothing else; ``parse_lora_control`` reads it into a ``LoRAControl``, and its one
final response (``make_control_response``) holds a JSON document in ``text_output``.

Every bad input raises ``ValueError`` whose message starts with the input's (or the
sampling field's) name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from pagoda.contracts.errors import TRITON_CODES, ErrorKind, TritonCode, triton_code_of
from pagoda.engine.core.load_shedding import check_timeout, is_admission_error
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.serving.trtllm_dialect import embedding_bias
from pagoda.serving.vllm_dialect import (apply_structured_outputs, finish_reason_text,
                                         logprobs_text, merge_parameters, prompt_logprobs_text,
                                         read_request_parameters, read_sampling_json, split_values)

# A prompt longer than this many characters cannot fit any supported context; refusing it
# here avoids tokenizing megabytes on the engine thread. The engine checks tokens exactly.
MAX_PROMPT_CHARS = 1_000_000

FLAG_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_stop_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_num_cached_tokens",
)

# TensorRT-LLM style scalar input -> (SamplingParams field, python type)
SCALAR_INPUTS: dict[str, tuple[str, type]] = {
    "max_tokens": ("max_tokens", int),
    "min_tokens": ("min_tokens", int),
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "seed": ("seed", int),
    "random_seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}

GetInput = Callable[[str], Optional[np.ndarray]]

# Every input of a generation request (config.pbtxt), so a control request can refuse them.
GENERATION_INPUTS = ("text_input", "sampling_parameters", *FLAG_INPUTS, *SCALAR_INPUTS, "stop_words", "bad_words",
                     "end_id", "beam_width", "embedding_bias_words", "embedding_bias_weights")
LORA_ACTIONS = ("load", "unload", "list")


@dataclass
class ParsedRequest:
    """Everything one Triton request asks for, validated."""

    prompt: Union[str, list[int]]  # text (text_input) or token ids (input_ids)
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_stop_reason: bool = False  # the stop string or token id that ended a completion ("None": none)
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_num_cached_tokens: bool = False
    priority: int = 0
    cache_salt: Optional[str] = None
    # vLLM's kv_transfer_params: disaggregated prefill/decode (serving.kv_transfer_control)
    kv_transfer_params: Optional[dict] = None
    lora_name: Optional[str] = None  # a loaded LoRA adapter (vLLM backend's lora_name); None: base model
    timeout: Optional[float] = None  # seconds from arrival (pagoda.engine.core.load_shedding)
    logprobs_asked: bool = False  # the request set ``logprobs`` (return_* flags alone do not)
    output_dialect: str = "pagoda"  # shape of logprobs and finish_reason (vllm_dialect)
    prompt_logprobs_sent: bool = False  # set by make_response once the prompt_logprobs output went


@dataclass
class LoRAControl:
    """A LoRA control request: load ``lora_name`` from ``lora_path``, unload it, or list."""

    action: str
    lora_name: Optional[str] = None
    lora_path: Optional[str] = None

    @property
    def changes_adapters(self) -> bool:
        return self.action != "list"


@dataclass
class Response:
    """One response to send: tensors, or an error; ``is_final`` marks the request's last."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    error: Optional[str] = None
    # What kind of failure ``error`` is, as a Triton error code name
    # (``pagoda.contracts.errors.TritonCode``): INVALID_ARG (bad input, HTTP 400), INTERNAL
    # (engine fault), UNAVAILABLE (shutting down, overloaded, or the request's deadline
    # passed; the message says which; tritonserver's generate endpoint answers every error
    # with HTTP 400, see docs/serving.md).
    error_code: str = TritonCode.INVALID_ARG
    is_final: bool = False


# ------------------------------------------------------------------------ parsing
def parse_request(get_input: GetInput, parameters: Any = None, output_dialect: str = "pagoda",
                  encode: Optional[Callable[[str], list[int]]] = None) -> ParsedRequest:
    """Read and validate one request's inputs.

    Args:
        get_input: returns the named input as a numpy array, or ``None`` if absent.
        parameters: the request's parameters (``request.parameters()``: JSON text), read as
            sampling parameters (``vllm_dialect``); ``None``: none.
        output_dialect: the model's default shape of ``logprobs`` and ``finish_reason``
            (``vllm_dialect.OUTPUT_DIALECTS``); the ``output_dialect`` request option wins.
        encode: text -> token ids without special tokens (the embedding bias's words);
            ``None``: ``embedding_bias_words`` is refused.

    Returns:
        The parsed request.

    Raises:
        ValueError: naming the offending input, request parameter or sampling field.
    """
    prompt = _read_prompt(get_input("text_input"), get_input("input_ids"))
    if get_input("lora_path") is not None:
        raise ValueError("lora_path: only a LoRA control request (lora_action 'load') takes a path; "
                         "to generate with an adapter, give its lora_name")
    flags = {name: _read_bool(name, get_input(name)) for name in FLAG_INPUTS}
    values, options = split_values(read_sampling_json(get_input("sampling_parameters")))
    extra_values, extra_options = split_values(read_request_parameters(parameters), from_parameters=True)
    values, options = merge_parameters(values, extra_values), merge_parameters(options, extra_options)
    values.update(_read_scalars(get_input))
    _apply_trtllm_words(get_input, values)
    _apply_embedding_bias(get_input, values, encode)
    apply_structured_outputs(values)
    logprobs_asked = values.get("logprobs") is not None
    if flags["return_logprobs"] or (flags["return_cumulative_logprob"] and values.get("use_beam_search") is not True):
        # The engine tracks log-probabilities only when asked; 0 alternatives suffice (beams carry their sums).
        if values.get("logprobs") is None:
            values["logprobs"] = 0
    try:
        params = SamplingParams.from_dict(values)
    except TypeError as exc:  # a field given a value its validators cannot even compare
        raise ValueError(f"sampling_parameters: {exc}") from None
    lora_name = _read_lora_name(get_input("lora_name"), options.get("lora_name"))
    return ParsedRequest(prompt=prompt, params=params, priority=options.get("priority", 0),
                         cache_salt=options.get("cache_salt"), lora_name=lora_name,
                         timeout=options.get("timeout"), logprobs_asked=logprobs_asked,
                         kv_transfer_params=options.get("kv_transfer_params"),
                         output_dialect=options.get("output_dialect", output_dialect), **flags)


def _read_lora_name(array: Optional[np.ndarray], from_json: Any) -> Optional[str]:
    """The ``lora_name`` input (vLLM backend dialect), or the same key in ``sampling_parameters``."""
    return _read_string("lora_name", array, from_json)


def _read_string(name: str, array: Optional[np.ndarray], default: Any = None) -> Optional[str]:
    """One non-empty string input, or ``default`` when the input is absent."""
    value = default
    if array is not None:
        if array.size != 1:
            raise ValueError(f"{name}: expected one string, got {array.size} elements")
        value = array.reshape(-1)[0]
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", errors="replace")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
    return value


def parse_lora_control(get_input: GetInput) -> Optional[LoRAControl]:
    """Read a LoRA control request, or return ``None`` when the request has no ``lora_action``.

    Raises:
        ValueError: an unknown action, a missing or extra ``lora_name``/``lora_path``, or a
            generation input (``text_input`` etc.) beside the action.
    """
    action = _read_string("lora_action", get_input("lora_action"))
    if action is None:
        return None
    if action not in LORA_ACTIONS:
        raise ValueError(f"lora_action: must be one of {', '.join(LORA_ACTIONS)}, got {action!r}")
    extra = [name for name in GENERATION_INPUTS if get_input(name) is not None]
    if extra:
        raise ValueError(f"lora_action: a LoRA control request takes only lora_action, lora_name and lora_path; "
                         f"it cannot be combined with generation inputs ({', '.join(extra)})")
    name = _read_string("lora_name", get_input("lora_name"))
    path = _read_string("lora_path", get_input("lora_path"))
    if action != "list" and name is None:
        raise ValueError(f"lora_name: required by lora_action {action!r}")
    if action == "list" and name is not None:
        raise ValueError("lora_name: lora_action 'list' takes no lora_name")
    if action == "load" and path is None:
        raise ValueError("lora_path: required by lora_action 'load' (the adapter's folder on the replica)")
    if action != "load" and path is not None:
        raise ValueError(f"lora_path: only lora_action 'load' takes a path, not {action!r}")
    return LoRAControl(action, name, path)


def _read_prompt(array: Optional[np.ndarray], ids: Optional[np.ndarray] = None) -> Union[str, list[int]]:
    if ids is not None:
        if array is not None:
            raise ValueError("input_ids: give the prompt as text_input or as input_ids, not both")
        if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or int(ids.min()) < 0:
            raise ValueError("input_ids: must be a non-empty list of token ids (integers >= 0)")
        return [int(t) for t in ids.reshape(-1)]
    if array is None:
        raise ValueError("text_input: required input is missing (or give input_ids)")
    if array.size != 1:
        raise ValueError(f"text_input: expected exactly one string, got {array.size} elements")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("text_input: is not valid UTF-8") from None
    if not isinstance(value, str):
        raise ValueError(f"text_input: must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError("text_input: must not be empty")
    if len(value) > MAX_PROMPT_CHARS:
        raise ValueError(f"text_input: prompt is too long ({len(value)} characters, at most {MAX_PROMPT_CHARS})")
    return value


def _read_bool(name: str, array: Optional[np.ndarray]) -> bool:
    if array is None:
        return False
    if array.size != 1:
        raise ValueError(f"{name}: expected one boolean, got {array.size} elements")
    value = array.reshape(-1)[0]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name}: must be a boolean, got {value!r}")


def _read_scalars(get_input: GetInput) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, (field_name, kind) in SCALAR_INPUTS.items():
        array = get_input(name)
        if array is None:
            continue
        if array.size != 1:
            raise ValueError(f"{name}: expected one value, got {array.size} elements")
        item = array.reshape(-1)[0]
        if kind is int:
            if not np.issubdtype(np.asarray(item).dtype, np.integer):
                raise ValueError(f"{name}: must be an integer, got {item!r}")
            values[field_name] = int(item)
        else:
            if not np.issubdtype(np.asarray(item).dtype, np.number):
                raise ValueError(f"{name}: must be a number, got {item!r}")
            values[field_name] = float(item)
    return values


def _strings(array: np.ndarray) -> list[str]:
    out = []
    for value in array.reshape(-1):
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", errors="replace")
        if value:
            out.append(str(value))
    return out


def _apply_trtllm_words(get_input: GetInput, values: dict[str, Any]) -> None:
    stop_words = get_input("stop_words")
    if stop_words is not None and _strings(stop_words):
        values["stop"] = _strings(stop_words)
    bad_words = get_input("bad_words")
    if bad_words is not None and _strings(bad_words):
        values["bad_words"] = _strings(bad_words)
    beam_width = get_input("beam_width")
    if beam_width is not None:
        if beam_width.size != 1 or not np.issubdtype(beam_width.dtype, np.integer):
            raise ValueError(f"beam_width: expected one integer, got {beam_width!r}")
        if int(beam_width.reshape(-1)[0]) != 1:  # beam search; SamplingParams checks the width
            values.update(use_beam_search=True, beam_width=int(beam_width.reshape(-1)[0]))
            values.setdefault("temperature", 0.0)
    end_id = get_input("end_id")
    if end_id is not None:
        if end_id.size != 1 or not np.issubdtype(end_id.dtype, np.integer):
            raise ValueError(f"end_id: expected one integer, got {end_id!r}")
        stop_ids = values.get("stop_token_ids") or []
        if not isinstance(stop_ids, list):
            raise ValueError(f"stop_token_ids: must be a list of integers, got {stop_ids!r}")
        values["stop_token_ids"] = [*stop_ids, int(end_id.reshape(-1)[0])]


def _apply_embedding_bias(get_input: GetInput, values: dict[str, Any],
                          encode: Optional[Callable[[str], list[int]]]) -> None:
    words, weights = get_input("embedding_bias_words"), get_input("embedding_bias_weights")
    words = [] if words is None else _strings(words)
    weights = [] if weights is None else [float(w) for w in weights.reshape(-1)]
    if not words and not weights:
        return
    if encode is None:
        raise ValueError("embedding_bias_words: this model has no tokenizer to read the words with")
    bias = embedding_bias(words, weights, encode)
    for token_id, weight in (values.get("logit_bias") or {}).items():  # both given: they add up
        bias[int(token_id)] = bias.get(int(token_id), 0.0) + float(weight)
    values["logit_bias"] = bias


# ---------------------------------------------------------------------- responses
def _string_array(values: list[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def make_response(parsed: ParsedRequest, output: RequestOutput,
                  decode_token: Callable[[int], str] = str) -> Optional[Response]:
    """Tensors for one engine output of this request.

    Streaming: this step's deltas; ``None`` when there is nothing to say yet (no new token
    and not finished). Not streaming: ``None`` until the request finishes, then the whole
    text. ``is_final`` is set on the response built from the finished output. An output
    carrying ``error`` becomes the request's one error response: ``UNAVAILABLE`` when
    admission control ended it (overloaded, deadline passed), else ``INVALID_ARG`` (a
    guided-decoding format that does not compile). ``decode_token``: a token id's text, for
    the vLLM dialect's ``decoded_token``.
    """
    if output.error is not None:
        return make_error_response(output.error, TritonCode.UNAVAILABLE if is_admission_error(output.error)
                                   else TritonCode.INVALID_ARG)
    if not parsed.stream and not output.finished:
        return None
    completions = output.outputs
    if parsed.stream and not output.finished and not any(c.delta_token_ids or c.delta_text for c in completions):
        return None
    if parsed.stream:
        texts = [c.delta_text for c in completions]
    else:
        prefix = "" if parsed.exclude_input_in_output else (output.prompt or "")
        texts = [prefix + c.text for c in completions]
    tensors = {"text_output": _string_array(texts)}
    if parsed.return_finish_reason:
        tensors["finish_reason"] = _string_array([finish_reason_text(c.finish_reason, parsed.output_dialect)
                                                  for c in completions])
    if parsed.return_stop_reason:
        tensors["stop_reason"] = _string_array([str(c.stop_reason) for c in completions])
    if parsed.return_cumulative_logprob:
        tensors["cumulative_logprob"] = np.array(
            [c.cumulative_logprob if c.cumulative_logprob is not None else 0.0 for c in completions], dtype=np.float32)
    if parsed.return_logprobs:
        tensors["logprobs"] = _string_array([
            logprobs_text(c.delta_logprobs if parsed.stream else c.logprobs, parsed.logprobs_asked,
                          parsed.output_dialect, decode_token) for c in completions])
    if parsed.return_num_input_tokens:
        tensors["num_input_tokens"] = np.array([len(output.prompt_token_ids)], dtype=np.uint32)
    if parsed.return_num_output_tokens:
        tensors["num_output_tokens"] = np.array(
            [len(c.delta_token_ids) if parsed.stream else len(c.token_ids) for c in completions], dtype=np.uint32)
    if parsed.return_num_cached_tokens:  # prompt tokens served from the prefix cache (OpenAI's cached_tokens)
        tensors["num_cached_tokens"] = np.array([output.num_cached_tokens or 0], dtype=np.uint32)
    if output.prompt_logprobs is not None and not parsed.prompt_logprobs_sent:
        tensors["prompt_logprobs"] = _string_array([prompt_logprobs_text(output.prompt_logprobs, parsed.output_dialect,
                                                                         decode_token)])
        parsed.prompt_logprobs_sent = True
    return Response(tensors=tensors, is_final=output.finished)


def make_control_response(document: dict[str, Any]) -> Response:
    """The single, final response of a LoRA control request: ``document`` as JSON in ``text_output``."""
    return Response(tensors={"text_output": _string_array([json.dumps(document)])}, is_final=True)


def make_error_response(message: str, error: Union[ErrorKind, str] = ErrorKind.INVALID_REQUEST) -> Response:
    """The single, final response of a request that failed.

    Args:
        message: the client's error text (``pagoda.contracts.errors`` names the prefixes
            that tell kinds apart).
        error: its ``ErrorKind`` (whose Triton code is sent), or a Triton code name.
    """
    code = triton_code_of(error) if isinstance(error, ErrorKind) else error
    assert code in TRITON_CODES, f"unknown Triton error code {code!r}"
    return Response(error=message, error_code=code, is_final=True)
