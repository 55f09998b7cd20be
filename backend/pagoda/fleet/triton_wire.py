"""Triton's wire encoding as the router reads it: BYTES tensors inside a ``ModelInferRequest``.

Shared by the doors (``fleet.api``) and the gate (``fleet.gate.limits``), so neither
reaches into the other. A BYTES tensor's raw contents are ``(uint32 little-endian length,
bytes)*``; a request carries an input either as raw contents (index-aligned with
``inputs``) or as typed ``contents.bytes_contents``.
"""

from __future__ import annotations

import struct
from typing import Any, Optional


def bytes_elements(raw: bytes) -> list[bytes]:
    """Decode Triton's BYTES tensor encoding: (uint32 little-endian length, bytes)*."""
    out, offset = [], 0
    while offset + 4 <= len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        out.append(raw[offset + 4: offset + 4 + length])
        offset += 4 + length
    return out


def _first_element(tensors: Any, raw_contents: Any, name: str) -> Optional[bytes]:
    """The first BYTES element of the tensor ``name`` (raw contents index-aligned, else typed)."""
    for index, tensor in enumerate(tensors):
        if tensor.name != name:
            continue
        elements = (bytes_elements(raw_contents[index]) if index < len(raw_contents)
                    else list(tensor.contents.bytes_contents))
        return elements[0] if elements else None
    return None


def read_string_input(request: Any, name: str) -> Optional[str]:
    """The first element of a BYTES input of a ``ModelInferRequest`` (``None`` if absent or unreadable)."""
    element = _first_element(request.inputs, request.raw_input_contents, name)
    try:
        return None if element is None else element.decode("utf-8")
    except UnicodeDecodeError:
        return None


def drop_inputs(request: Any, names: tuple[str, ...]) -> None:
    """Remove the named inputs from a ``ModelInferRequest`` (and their raw contents, if it uses them)."""
    uses_raw = len(request.raw_input_contents) == len(request.inputs) and len(request.inputs) > 0
    for index in reversed(range(len(request.inputs))):
        if request.inputs[index].name in names:
            del request.inputs[index]
            if uses_raw:
                del request.raw_input_contents[index]


def output_text(response: Any, name: str) -> Optional[str]:
    """The first element of a BYTES output of a ``ModelInferResponse`` (``None`` if absent)."""
    element = _first_element(response.outputs, response.raw_output_contents, name)
    return None if element is None else element.decode("utf-8", errors="replace")


def bytes_raw(values: list[bytes]) -> bytes:
    """Triton's BYTES tensor encoding of ``values`` (the inverse of ``bytes_elements``)."""
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


# Numeric and BOOL tensors the router reads the first element of: datatype -> struct format.
_FORMATS = {"BOOL": "?", "INT32": "i", "INT64": "q", "UINT32": "I", "UINT64": "Q", "FP32": "f", "FP64": "d"}


def _first_number(datatype: str, raw: bytes) -> Any:
    fmt = _FORMATS.get(datatype)
    if fmt is None or len(raw) < struct.calcsize(fmt):
        return None
    return struct.unpack_from("<" + fmt, raw)[0]


def scalar_inputs(request: Any) -> dict[str, Any]:
    """The first element of each numeric or BOOL input of a ``ModelInferRequest`` sent as raw contents."""
    out = {}
    for index, tensor in enumerate(request.inputs):
        if index < len(request.raw_input_contents):
            value = _first_number(tensor.datatype, request.raw_input_contents[index])
            if value is not None:
                out[tensor.name] = value
    return out


def request_parameters(request: Any) -> dict[str, Any]:
    """A ``ModelInferRequest``'s parameters as Python values."""
    out = {}
    for key, parameter in request.parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is not None:
            out[key] = getattr(parameter, kind)
    return out


def drop_parameters(request: Any, names: tuple[str, ...]) -> None:
    """Remove the named parameters from a ``ModelInferRequest``."""
    for name in names:
        if name in request.parameters:
            del request.parameters[name]


def output_number(response: Any, name: str) -> Any:
    """The first element of a numeric output of a ``ModelInferResponse`` (``None`` if absent)."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name == name and index < len(response.raw_output_contents):
            return _first_number(tensor.datatype, response.raw_output_contents[index])
    return None


def replace_output(response: Any, name: str, raw: bytes) -> None:
    """Set the raw contents of the output ``name`` of a ``ModelInferResponse`` (if it has it)."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name == name and index < len(response.raw_output_contents):
            response.raw_output_contents[index] = raw


def keep_outputs(response: Any, names: set[str]) -> None:
    """Remove every output of a ``ModelInferResponse`` not in ``names`` (with its raw contents)."""
    uses_raw = len(response.raw_output_contents) == len(response.outputs)
    for index in reversed(range(len(response.outputs))):
        if response.outputs[index].name not in names:
            del response.outputs[index]
            if uses_raw:
                del response.raw_output_contents[index]
