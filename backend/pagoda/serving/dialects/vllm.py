"""Triton's vLLM backend dialect: its ``sampling_parameters`` JSON, request parameters,
``structured_outputs``, and its ``logprobs`` / ``finish_reason`` output shapes.

The only reader of this vocabulary. Pure functions (no server).

Request values come two ways, and both are read here into pagoda's names (sampling fields,
request options, the wire's own keys):

- the ``sampling_parameters`` input (one string holding a JSON object);
- the request's *parameters* (``request.parameters()``, JSON text): tritonclient's gRPC
  ``parameters=``, an HTTP body's ``"parameters": {...}``, and every top-level key of an HTTP
  ``generate`` body that is not an input. The vLLM backend reads them when the tensor is
  absent; so does pagoda, with one difference on purpose (**no silent drops**): a key that is
  neither a sampling field, a request option, the wire's own key nor a tolerated key
  (``TOLERATED_PARAMETERS``) is refused, naming it; with the tensor present too (the
  backend's own client tests send the same dict both ways), the two are merged and a key
  given both ways must carry the same value (after reading strings such as ``"0"``).

Values may be strings (``"0"``, ``"3"``, ``"true"``) as the backend's clients send them; a
string that does not parse as the field's type is a ``ValueError`` naming the key.

``structured_outputs`` (vLLM's ``SamplingParams.structured_outputs``): a JSON object, or a
string holding one. It becomes pagoda's ``guided_decoding``: ``json``, ``regex``, ``choice``,
``grammar``, ``json_object`` and ``disable_any_whitespace`` apply; ``disable_fallback`` is
accepted (one grammar backend, nothing to fall back to); ``structural_tag``,
``whitespace_pattern`` and ``disable_additional_properties`` are refused when set. ``null``
values mean "not given", as in vLLM.

Images: the ``image`` input (BYTES, one element per image, several per request), each the
base64 of an encoded image (PNG, JPEG, ...), as the vLLM backend takes it; ``read_images``
decodes it strictly (standard alphabet, padding; whitespace ignored). Whether the bytes are
an image, and the limits, are the engine's checks (``engine.image_inputs``).

Outputs (``output_dialect``: ``"vllm"``, the backend's shapes; ``"pagoda"``, the shapes the
router's OpenAI door reads; the model's ``output_dialect`` config parameter, or the request's):

- ``logprobs``: per completion, a JSON list with one object per token,
  ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the sampled token and the
  top ``logprobs`` alternatives (rank 1 = most likely), or ``null`` when the request did not
  set the ``logprobs`` sampling parameter; pagoda's shape is ``TokenLogprob.to_dict()``;
- ``finish_reason``: ``str(reason)``, so ``"None"`` on a streaming response whose completion
  is not finished (pagoda's shape: ``""``);
- ``prompt_logprobs`` (pagoda's addition): one JSON list for the request, ``null`` first, then
  vLLM's ``PromptLogprobs`` entry per position (pagoda's shape: ``TokenLogprob.to_dict()``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
from typing import Any, Callable, Optional, Sequence

import numpy as np

from pagoda.contracts import json_input
from pagoda.contracts.request_options import OPTION_NAMES
from pagoda.engine.guided.params import GuidedDecodingParams
from pagoda.engine.outputs import TokenLogprob
from pagoda.engine.sampling_params import SamplingParams

OUTPUT_DIALECTS = ("vllm", "pagoda")
# Keys of the request that are the wire request's own, beside sampling fields and options:
# the response shape, and the tokenizer that made input_ids from text_input (a router's).
WIRE_KEYS = ("output_dialect", "prompt_tokenizer")
# vLLM SamplingParams keys that are not pagoda SamplingParams fields: read (or refused) here.
VLLM_ONLY_KEYS = ("structured_outputs",)

# Request-parameter keys that are not the user's sampling parameters, and why they pass
# (what reaches the backend was measured on tritonserver 2.51; test_serving_vllm_dialect.py sends them):
# - traceparent: pagoda's router adds it (W3C trace context, pagoda.serving.tracing);
# - id: the generate extension's request id ({"id": ...} in a generate body), which
#   tritonserver 2.51 hands on as a parameter; it is the client's label, not a sampling key;
# - priority, timeout, triton_enable_empty_final_response, sequence_id, sequence_start,
#   sequence_end: tritonserver's own request fields (gRPC carries them as parameters).
#   tritonserver 2.51 consumes them and none reaches the backend; they stay tolerated
#   for servers that forward them, since tritonserver has acted on them already.
TOLERATED_PARAMETERS = frozenset({"traceparent", "id", "priority", "timeout", "triton_enable_empty_final_response",
                                  "sequence_id", "sequence_start", "sequence_end"})

STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
STRUCTURED_OUTPUT_REFUSED = ("structural_tag", "whitespace_pattern", "disable_additional_properties")
_SCALAR_TYPES = {"int": int, "float": float, "bool": bool}


@functools.lru_cache(maxsize=None)
def request_parameter_vocabulary() -> frozenset[str]:
    """Every key a request's values may have (sampling fields, vLLM-only keys, request options,
    the wire's keys) or a request parameter may carry without effect: the one list a front
    door in pagoda's fleet checks against."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"given"}
    return frozenset(fields | set(VLLM_ONLY_KEYS) | set(OPTION_NAMES) | set(WIRE_KEYS) | TOLERATED_PARAMETERS)


def read_values(sampling_json: Any, parameters: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A request's (sampling values, options) from its ``sampling_parameters`` text (or None) and
    its request parameters (JSON text, a dict, or None), merged as the module docstring says.

    Raises:
        ValueError: naming the key: not JSON objects, an unknown parameter, a contradiction,
            a string that does not parse as its field's type.
    """
    values, options = split_values(read_sampling_json(sampling_json))
    extra_values, extra_options = split_values(read_request_parameters(parameters), from_parameters=True)
    values, options = merge_parameters(values, extra_values), merge_parameters(options, extra_options)
    apply_structured_outputs(values)
    return values, options


def read_sampling_json(raw: Any) -> dict[str, Any]:
    """The ``sampling_parameters`` JSON object (``{}`` when absent or blank). Raises ValueError."""
    if raw is None or not str(raw).strip():
        return {}
    values = json_input.loads(raw, "sampling_parameters")  # strict (contracts.json_input)
    if not isinstance(values, dict):
        raise ValueError(f"sampling_parameters: must be a JSON object, got {type(values).__name__}")
    return values


def read_request_parameters(raw: Any) -> dict[str, Any]:
    """The user's keys among a request's parameters (tolerated keys removed).

    Args:
        raw: what ``request.parameters()`` returns (JSON text), a dict, or ``None``.

    Raises:
        ValueError: the text is not a JSON object.
    """
    if raw is None or raw == "":
        return {}
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("utf-8", errors="replace")
    values = json_input.loads(raw, "parameters") if isinstance(raw, str) else raw
    if not isinstance(values, dict):
        raise ValueError(f"parameters: must be a JSON object, got {type(values).__name__}")
    return {key: value for key, value in values.items() if key not in TOLERATED_PARAMETERS}


def merge_parameters(from_tensor: dict[str, Any], from_parameters: dict[str, Any]) -> dict[str, Any]:
    """``sampling_parameters`` and request parameters, already read to typed values.

    Raises:
        ValueError: one key given both ways with different values.
    """
    for key, value in from_parameters.items():
        if key in from_tensor and from_tensor[key] != value:
            raise ValueError(f"{key}: given as a request parameter ({value!r}) and in sampling_parameters "
                             f"({from_tensor[key]!r}) with different values; send it once")
    return {**from_parameters, **from_tensor}


def split_values(values: dict[str, Any], from_parameters: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SamplingParams values, request options and wire keys), strings read as their field's type.

    ``from_parameters``: the values are request parameters, which carry only scalars, so a
    list or object field may come as JSON text; an unknown key is refused here, naming it.
    """
    field_types = {f.name: str(f.type) for f in dataclasses.fields(SamplingParams) if f.name != "given"}
    if from_parameters:
        unknown = sorted(set(values) - request_parameter_vocabulary())
        if unknown:
            raise ValueError(f"unknown request parameter(s): {', '.join(unknown)}; a request parameter must be a "
                             f"sampling parameter ({', '.join(sorted([*field_types, *VLLM_ONLY_KEYS]))}) or a "
                             f"request option ({', '.join(OPTION_NAMES + WIRE_KEYS)})")
        if isinstance(values.get("guided_decoding"), str):  # an object, as request parameters carry it
            values = {**values, "guided_decoding": json_input.loads(values["guided_decoding"], "guided_decoding")}
    values = dict(values)
    options = {key: values.pop(key) for key in OPTION_NAMES + WIRE_KEYS if key in values}
    for key in ("kv_transfer_params", "resume"):  # JSON text of the object (request parameters)
        if isinstance(options.get(key), str):
            options[key] = json_input.loads(options[key], key)
    if "allow_migration" in options:
        options["allow_migration"] = coerce("allow_migration", options["allow_migration"], bool)
    if "priority" in options:
        options["priority"] = coerce("priority", options["priority"], int)
    if "timeout" in options and options["timeout"] is not None:
        options["timeout"] = coerce("timeout", options["timeout"], float)
    for key, value in list(values.items()):
        kind = field_types.get(key, "").replace("Optional[", "")
        if isinstance(value, str) and kind.rstrip("]") in _SCALAR_TYPES:
            values[key] = coerce(key, value, _SCALAR_TYPES[kind.rstrip("]")])
        elif from_parameters and isinstance(value, str) and kind.startswith(("list[", "dict[")) and key != "stop":
            try:
                values[key] = json_input.loads(value, key)
            except json_input.JSONInputError as exc:
                raise ValueError(f"{key}: must be JSON text of a {kind[:4]}, got {value!r} ({exc})") from None
        elif (kind.startswith("list[") and not isinstance(value, list)
              and not (key == "stop" and isinstance(value, str))):
            raise ValueError(f"{key}: must be a JSON list, got {value!r}")
    return values, options


def coerce(name: str, value: Any, kind: type) -> Any:
    """Turn a vLLM-backend style string ("0.7", "64", "true") into ``kind``; other values pass."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if kind is bool:
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            raise ValueError
        if kind is int:
            return int(text)
        return float(text)
    except ValueError:
        what = "a boolean" if kind is bool else "an integer" if kind is int else "a number"
        raise ValueError(f"{name}: must be {what}, got {value!r}") from None


def apply_structured_outputs(values: dict[str, Any]) -> None:
    """Replace a ``structured_outputs`` key in ``values`` by the ``guided_decoding`` it means.

    Raises:
        ValueError: naming ``structured_outputs`` (or one of its keys): not an object, both
            ``structured_outputs`` and ``guided_decoding``, a refused key, a bad value.
    """
    if "structured_outputs" not in values:
        return
    spec = values.pop("structured_outputs")
    if spec is None:
        return
    if isinstance(spec, (bytes, bytearray)):
        spec = bytes(spec).decode("utf-8", errors="replace")
    if isinstance(spec, str):
        spec = json_input.loads(spec, "structured_outputs")
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs: must be a JSON object, got {type(spec).__name__}")
    if values.get("guided_decoding") is not None:
        raise ValueError("structured_outputs: give either structured_outputs (vLLM's current name) or "
                         "guided_decoding, not both")
    guided: dict[str, Any] = {}
    for key, value in spec.items():
        if value is None or key == "disable_fallback":
            continue
        if key in STRUCTURED_OUTPUT_REFUSED:
            if value in (False, ""):
                continue
            raise ValueError(f"structured_outputs.{key}: not supported by pagoda's grammar path; "
                             f"supported: {', '.join(STRUCTURED_OUTPUT_KEYS)}")
        if key not in STRUCTURED_OUTPUT_KEYS:
            known = STRUCTURED_OUTPUT_KEYS + STRUCTURED_OUTPUT_REFUSED + ("disable_fallback",)
            raise ValueError(f"structured_outputs.{key}: unknown key; known: {', '.join(known)}")
        guided[key] = value
    try:
        values["guided_decoding"] = GuidedDecodingParams.from_dict(guided)
    except ValueError as exc:
        raise ValueError(str(exc).replace("guided_decoding", "structured_outputs", 1)) from None


def read_images(array: Optional[np.ndarray]) -> list[bytes]:
    """The ``image`` input's images (``[]`` when absent): each element base64 text -> its bytes.

    Raises:
        ValueError: naming ``image`` (and the element): not text, not base64, or empty.
    """
    if array is None:
        return []
    images = []
    for index, value in enumerate(array.reshape(-1)):
        if isinstance(value, str):
            value = value.encode("ascii", errors="replace")
        if not isinstance(value, (bytes, bytearray)):
            raise ValueError(f"image[{index}]: must be a base64 string, got {type(value).__name__}")
        try:
            data = base64.b64decode(b"".join(bytes(value).split()), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"image[{index}]: not valid base64 (send each image's encoded bytes, PNG or JPEG, "
                             f"base64-encoded)") from None
        if not data:
            raise ValueError(f"image[{index}]: empty image")
        images.append(data)
    return images


def check_output_dialect(name: str, value: Any) -> str:
    """``value`` if it names an output dialect. Raises ValueError naming ``name``."""
    if value not in OUTPUT_DIALECTS:
        raise ValueError(f"{name}: must be one of {', '.join(OUTPUT_DIALECTS)}, got {value!r}")
    return value


# ---------------------------------------------------------------------------- outputs
def finish_reason_text(reason: Optional[str], dialect: str) -> str:
    """One completion's ``finish_reason`` element: ``str(reason)`` (vLLM) or ``reason or ""``."""
    return str(reason) if dialect == "vllm" else (reason or "")


def logprobs_text(entries: Optional[Sequence[TokenLogprob]], asked: bool, dialect: str,
                  decode: Callable[[int], str]) -> str:
    """One completion's ``logprobs`` element (JSON text) in ``dialect``.

    Args:
        entries: this response's tokens' log-probabilities (deltas when streaming).
        asked: whether the request set the ``logprobs`` sampling parameter.
        decode: token id -> its text (``decoded_token``).
    """
    if dialect != "vllm":
        return json.dumps([lp.to_dict() for lp in entries or []])
    if not asked:
        return "null"
    return json.dumps([_vllm_entry(lp, decode) for lp in entries or []])


def prompt_logprobs_text(entries: Sequence[Optional[TokenLogprob]], dialect: str, decode: Callable[[int], str]) -> str:
    """The request's ``prompt_logprobs`` element (JSON text) in ``dialect`` (``null`` first)."""
    if dialect != "vllm":
        return json.dumps([lp.to_dict() if lp is not None else None for lp in entries])
    return json.dumps([_vllm_entry(lp, decode) if lp is not None else None for lp in entries])


def _vllm_entry(lp: TokenLogprob, decode: Callable[[int], str]) -> dict[str, Any]:
    """One position in vLLM's shape: the top alternatives (ranks 1..), then the token itself."""
    step = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": decode(token_id)}
            for rank, (token_id, logprob) in enumerate(lp.top, start=1)}
    step[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode(lp.token_id)}
    return step
