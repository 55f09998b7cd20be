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


def read_string_input(request: Any, name: str) -> Optional[str]:
    """The first element of a BYTES input of a ``ModelInferRequest`` (``None`` if absent or unreadable)."""
    for index, tensor in enumerate(request.inputs):
        if tensor.name != name:
            continue
        if index < len(request.raw_input_contents):
            elements = bytes_elements(request.raw_input_contents[index])
        else:
            elements = list(tensor.contents.bytes_contents)
        if not elements:
            return None
        try:
            return elements[0].decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None
