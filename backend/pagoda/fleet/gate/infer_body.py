"""KServe v2 ``/infer`` bodies at the router's HTTP door, checked before they are forwarded.

The router used to relay ``POST /v2/models/{model}[/versions/{v}]/infer`` byte for byte, so
a hostile body reached a replica unchecked and a prompt over the router's limits was never
refused. Now the JSON part (the whole body, or its first ``Inference-Header-Content-Length``
bytes with the binary-data extension) is parsed strictly (``contracts.json_input``) and must be
the protocol's request object:

- top-level keys ``id`` (string), ``parameters`` (object), ``inputs`` (required, non-empty
  list), ``outputs`` (list of ``{name, parameters?}``); any other key is refused, naming it;
- each input ``{name, datatype, shape, data | parameters.binary_data_size}``: ``name`` a
  string, ``datatype`` one of the protocol's types, ``shape`` a list of non-negative
  integers, ``data`` present unless the input's bytes come in the binary part;
- the router's limits where they apply: each ``text_input`` string against
  ``--max-prompt-chars``, a ``sampling_parameters`` JSON string against the sampling limits.

Input names are not checked against one model's configuration: the door fronts every model
the replicas serve (their own validation names an unknown input).
"""

from __future__ import annotations

from typing import Any, Optional

from pagoda.contracts import json_input
from pagoda.fleet.gate.limits import LimitError, RequestLimits, sampling_object

DATATYPES = {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES"}
_TOP_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "datatype", "shape", "data", "parameters"}


def validate_infer_body(body: bytes, header_length: Optional[str], limits: RequestLimits) -> None:
    """Raise ``LimitError`` naming the first problem of an ``/infer`` body (module docstring)."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise LimitError(f"Inference-Header-Content-Length: must be the byte length of the JSON header "
                             f"(at most {len(body)}), got {header_length!r}", "Inference-Header-Content-Length")
        body = body[:int(header_length)]
    try:
        document = json_input.loads(body, "body")
    except json_input.JSONInputError as exc:
        raise LimitError(str(exc), exc.param) from None
    if not isinstance(document, dict):
        raise LimitError("body: must be a JSON object with 'inputs'", "body")
    unknown = sorted(set(document) - _TOP_KEYS)
    if unknown:
        raise LimitError(f"{unknown[0]}: unknown key of an inference request (keys: {', '.join(sorted(_TOP_KEYS))})",
                         unknown[0])
    _expect(document, "id", str, "a string")
    _expect(document, "parameters", dict, "an object")
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise LimitError("inputs: required, a non-empty list of {name, datatype, shape, data}", "inputs")
    for index, tensor in enumerate(inputs):
        _check_tensor(tensor, f"inputs[{index}]", limits)
    outputs = document.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise LimitError("outputs: must be a list of {name, parameters?} objects", "outputs")


def _expect(document: dict, key: str, kind: type, what: str) -> None:
    if key in document and not isinstance(document[key], kind):
        raise LimitError(f"{key}: must be {what}", key)


def _check_tensor(tensor: Any, where: str, limits: RequestLimits) -> None:
    if not isinstance(tensor, dict):
        raise LimitError(f"{where}: must be an object {{name, datatype, shape, data}}", where)
    unknown = sorted(set(tensor) - _INPUT_KEYS)
    if unknown:
        raise LimitError(f"{where}.{unknown[0]}: unknown key of an input tensor", f"{where}.{unknown[0]}")
    name = tensor.get("name")
    if not isinstance(name, str) or not name:
        raise LimitError(f"{where}.name: required, a non-empty string", f"{where}.name")
    if tensor.get("datatype") not in DATATYPES:
        raise LimitError(f"{where}.datatype ({name}): must be one of {', '.join(sorted(DATATYPES))}, got "
                         f"{tensor.get('datatype')!r}", f"{where}.datatype")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise LimitError(f"{where}.shape ({name}): must be a list of non-negative integers", f"{where}.shape")
    parameters = tensor.get("parameters", {})
    if not isinstance(parameters, dict):
        raise LimitError(f"{where}.parameters ({name}): must be an object", f"{where}.parameters")
    if "data" not in tensor:
        if "binary_data_size" not in parameters:
            raise LimitError(f"{where}.data ({name}): required (or parameters.binary_data_size with the binary "
                             "extension)", f"{where}.data")
        return
    strings = [v for v in _flatten(tensor["data"]) if isinstance(v, str)]
    if name == "text_input":
        for text in strings:
            limits.check_prompt(text, "text_input")
    elif name == "sampling_parameters":
        for text in strings:
            limits.check_sampling(sampling_object(text))


def _flatten(data: Any) -> list:
    out, stack = [], [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        else:
            out.append(item)
    return out
