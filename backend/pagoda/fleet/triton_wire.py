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
