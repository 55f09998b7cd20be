"""Triton's gRPC wire encoding as the router reads and writes it: tensors inside a ``ModelInferRequest``.

Shared by the doors (``fleet.api``) and the gate (``fleet.gate.limits``), so neither
reaches into the other. A BYTES tensor's raw contents are ``(uint32 little-endian length,
bytes)*``; a request carries an input either as raw contents (index-aligned with
``inputs``) or as typed ``contents`` (``bytes_contents``, ``int_contents``, ...).

``infer_request`` is the one place the router builds a replica's request from named numpy
tensors (a ``WireRequest.to_triton_inputs()``); ``infer_inputs`` reads a client's request
back into named numpy tensors, whichever encoding it used.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping, Optional

import numpy as np
from tritonclient.grpc import service_pb2

# numpy dtype -> Triton datatype, and back (with each datatype's typed-contents field).
_DATATYPES = {np.dtype(np.object_): "BYTES", np.dtype(np.bool_): "BOOL", np.dtype(np.int32): "INT32",
              np.dtype(np.int64): "INT64", np.dtype(np.uint32): "UINT32", np.dtype(np.uint64): "UINT64",
              np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64"}
_NUMPY = {datatype: dtype for dtype, datatype in _DATATYPES.items()}
_CONTENTS = {"BYTES": "bytes_contents", "BOOL": "bool_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents"}


def infer_request(model_name: str, request_id: str, tensors: Mapping[str, np.ndarray],
                  parameters: Optional[Mapping[str, Any]] = None) -> Any:
    """A ``ModelInferRequest`` for ``model_name`` carrying ``tensors`` as raw contents and
    ``parameters`` (str, bool or int values) as request parameters."""
    request = service_pb2.ModelInferRequest(model_name=model_name, id=request_id)
    for name, array in tensors.items():
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, _DATATYPES[array.dtype]
        tensor.shape.extend(array.shape)
        if array.dtype == np.object_:
            request.raw_input_contents.append(bytes_raw([bytes(v) for v in array.reshape(-1)]))
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"))
                                              .tobytes())
    for key, value in (parameters or {}).items():
        kind = "bool_param" if isinstance(value, bool) else "int64_param" if isinstance(value, int) else "string_param"
        setattr(request.parameters[key], kind, value)
    return request


def infer_inputs(request: Any) -> dict[str, np.ndarray]:
    """Every input of a ``ModelInferRequest`` as a numpy array of its shape (BYTES as ``bytes``).

    Raises:
        ValueError: naming an input of an unknown datatype or whose contents do not fill its shape.
    """
    out = {}
    uses_raw = len(request.raw_input_contents) > 0
    for index, tensor in enumerate(request.inputs):
        if tensor.datatype not in _NUMPY:
            raise ValueError(f"{tensor.name}: datatype {tensor.datatype} is not one pagoda reads")
        shape = tuple(tensor.shape)
        if tensor.datatype == "BYTES":
            values = (bytes_elements(request.raw_input_contents[index]) if uses_raw
                      else list(tensor.contents.bytes_contents))
            array = np.array(values, dtype=np.object_)
        elif uses_raw:
            raw = request.raw_input_contents[index] if index < len(request.raw_input_contents) else b""
            array = np.frombuffer(raw, dtype=_NUMPY[tensor.datatype].newbyteorder("<")).astype(_NUMPY[tensor.datatype])
        else:
            array = np.array(list(getattr(tensor.contents, _CONTENTS[tensor.datatype])), dtype=_NUMPY[tensor.datatype])
        if array.size != int(np.prod(shape)):
            raise ValueError(f"{tensor.name}: {array.size} elements do not fill its shape {list(shape)}")
        out[tensor.name] = array.reshape(shape)
    return out


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


def request_parameters(request: Any) -> dict[str, Any]:
    """A ``ModelInferRequest``'s parameters as Python values."""
    out = {}
    for key, parameter in request.parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is not None:
            out[key] = getattr(parameter, kind)
    return out


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


def drop_output(response: Any, name: str) -> None:
    """Remove the output ``name`` of a ``ModelInferResponse`` (with its raw contents), if it has it."""
    if any(tensor.name == name for tensor in response.outputs):
        keep_outputs(response, {tensor.name for tensor in response.outputs} - {name})
