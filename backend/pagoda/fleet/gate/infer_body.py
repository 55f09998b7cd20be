"""KServe v2 ``/infer`` bodies at the router's HTTP door, checked before they are forwarded.

The router used to relay ``POST /v2/models/{model}[/versions/{v}]/infer`` byte for byte, so
a hostile body reached a replica unchecked and a prompt over the router's limits was never
refused. Now the JSON part (the whole body, or its first ``Inference-Header-Content-Length``
bytes with the binary-data extension) is parsed strictly (``contracts.json_input``) and must be
the protocol's request object, declared as typed models (``InferRequest``, pydantic v2,
strict; the first error becomes one ``LimitError`` naming its path):

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

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from pagoda.contracts import json_input
from pagoda.fleet.gate.limits import LimitError, RequestLimits, error_path, sampling_object, show_value

Datatype = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
                   "FP64", "BF16", "BYTES"]
_CONFIG = ConfigDict(strict=True, extra="forbid")


class InferInput(BaseModel):
    """One input tensor: ``data`` inline, or its bytes in the binary part (``parameters.binary_data_size``)."""

    model_config = _CONFIG
    name: Annotated[StrictStr, Field(min_length=1)]
    datatype: Datatype
    shape: list[Annotated[StrictInt, Field(ge=0)]]
    data: Any = None
    parameters: dict[str, Any] = {}

    @model_validator(mode="after")
    def _has_data(self) -> "InferInput":
        if "data" not in self.model_fields_set and "binary_data_size" not in self.parameters:
            raise PydanticCustomError("missing_data", "required (or parameters.binary_data_size with the binary "
                                      "extension)")
        return self


class InferOutput(BaseModel):
    model_config = _CONFIG
    name: StrictStr
    parameters: Optional[dict[str, Any]] = None


class InferRequest(BaseModel):
    """A KServe v2 inference request's JSON object."""

    model_config = _CONFIG
    id: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    inputs: Annotated[list[InferInput], Field(min_length=1)]
    outputs: list[InferOutput] = []


# What each field must be, for the error message (the schema above says the same in types).
_MUST = {"id": "must be a string", "parameters": "must be an object",
         "inputs": "required, a non-empty list of {name, datatype, shape, data}",
         "outputs": "must be a list of {name, parameters?} objects",
         "name": "required, a non-empty string", "datatype": f"must be one of {', '.join(sorted(Datatype.__args__))}",
         "shape": "must be a list of non-negative integers", "data": "required (or parameters.binary_data_size with "
         "the binary extension)"}


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
    try:
        request = InferRequest.model_validate(document)
    except ValidationError as exc:
        raise _describe(exc.errors(include_url=False)[0], document) from None
    for tensor in request.inputs:
        strings = [v for v in _flatten(tensor.data) if isinstance(v, str)]
        if tensor.name == "text_input":
            for text in strings:
                limits.check_prompt(text, "text_input")
        elif tensor.name == "sampling_parameters":
            for text in strings:
                limits.check_sampling(sampling_object(text))


def _describe(error: dict, document: dict) -> LimitError:
    loc = error["loc"]
    if not loc:
        return LimitError(f"body: {error['msg']}", "body")
    if loc[0] == "outputs":
        return LimitError(f"outputs: {_MUST['outputs']}", "outputs")
    if error["type"] == "extra_forbidden":
        where = error_path(loc[:-1])
        if len(loc) == 1:
            keys = ", ".join(sorted(InferRequest.model_fields))
            return LimitError(f"{loc[0]}: unknown key of an inference request (keys: {keys})", str(loc[0]))
        return LimitError(f"{error_path(loc)}: unknown key of an input tensor", error_path(loc))
    if error["type"] == "missing_data":
        loc = (*loc[:2], "data")
    if loc[0] == "inputs" and len(loc) == 2:
        return LimitError(f"{error_path(loc)}: must be an object {{name, datatype, shape, data}}, got "
                          f"{show_value(document['inputs'][loc[1]])}", error_path(loc))
    if loc[0] != "inputs" or len(loc) < 3:
        return LimitError(f"{loc[0]}: {_MUST[str(loc[0])]}, got {show_value(document.get(loc[0]))}", str(loc[0]))
    where, field = error_path(loc[:2]), str(loc[2])
    tensor = document["inputs"][loc[1]]
    name = tensor.get("name") if isinstance(tensor, dict) else None
    return LimitError(f"{where}.{field} ({name}): {_MUST[field]}, got {show_value(tensor.get(field))}",
                      f"{where}.{field}")


def _flatten(data: Any) -> list:
    out, stack = [], [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        else:
            out.append(item)
    return out
