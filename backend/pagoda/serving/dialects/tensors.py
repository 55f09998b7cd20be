"""Reading Triton input tensors (numpy arrays) the one way every dialect reads them.

A Triton request's inputs reach a Python backend as numpy arrays: ``BYTES``/``STRING`` as
object arrays of ``bytes``, numbers and booleans as typed arrays, with whatever shape the
client sent (``[1]``, ``[1, 1]`` for a batch of one, ``[N]`` for lists). Each helper takes
the input's name and its array (``None``: absent) and either returns a Python value or
raises a ``ValueError`` whose message starts with the name, so every dialect refuses a
malformed input with the same words.

``DialectRequest`` is what a dialect reader makes of one request: the prompt and three
bags of typed values (sampling fields, request options, output flags) under pagoda's
names. ``serving.wire.WireRequest.from_dialect`` checks them into the typed request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

GetInput = Callable[[str], Optional[np.ndarray]]
Item = dict[str, np.ndarray]  # one request's (or one batch item's) inputs by name


@dataclass
class DialectRequest:
    """One request as a dialect read it, before ``WireRequest.from_dialect`` checks it.

    Attributes:
        prompt: text, or None.
        prompt_token_ids: token ids, or None.
        sampling: ``SamplingParams`` field name -> value.
        options: ``RequestOptions`` field name -> value (and ``output_dialect``,
            ``prompt_tokenizer``: the wire's own keys).
        flags: ``OutputOptions`` flag name -> bool.
        images: each image's encoded bytes (the vLLM dialect's ``image`` input, decoded).
    """

    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    sampling: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, bool] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)


def decode_text(name: str, value: Any) -> str:
    """A ``BYTES`` element as text (UTF-8, strict). Raises ValueError naming the input."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"{name}: must be a string, got {type(value).__name__}")


def one(name: str, array: Optional[np.ndarray]) -> Any:
    """The single element of an input as a Python value (text for ``BYTES``), or None when absent.

    Raises:
        ValueError: the input holds more or fewer than one element, or text that is not UTF-8.
    """
    if array is None:
        return None
    if array.size != 1:
        raise ValueError(f"{name}: expected one value, got {array.size} elements")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, bytearray)):
        return decode_text(name, value)
    return value.item() if hasattr(value, "item") else value


def text(name: str, array: Optional[np.ndarray]) -> Optional[str]:
    """A one-string input, or None when absent. Raises ValueError naming it (not one string, empty)."""
    value = one(name, array)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
    return value


def strings(name: str, array: Optional[np.ndarray]) -> list[str]:
    """A list-of-strings input (``[N]``), empty strings dropped; ``[]`` when absent."""
    if array is None:
        return []
    return [decode_text(name, v) for v in array.reshape(-1) if len(v)]


def flag(name: str, array: Optional[np.ndarray]) -> bool:
    """A ``BOOL`` input; False when absent. Raises ValueError naming it (not one boolean)."""
    if array is None:
        return False
    if array.size != 1:
        raise ValueError(f"{name}: expected one boolean, got {array.size} elements")
    value = array.reshape(-1)[0]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name}: must be a boolean, got {value!r}")


def number(name: str, array: Optional[np.ndarray], kind: type) -> Union[int, float, None]:
    """A one-number input as ``kind`` (int or float); None when absent.

    Raises:
        ValueError: not one element, or (for ``int``) not an integer tensor, or not a number.
    """
    if array is None:
        return None
    if array.size != 1:
        raise ValueError(f"{name}: expected one value, got {array.size} elements")
    item = np.asarray(array.reshape(-1)[0])
    if kind is int:
        if not np.issubdtype(item.dtype, np.integer):
            raise ValueError(f"{name}: must be an integer, got {item.item()!r}")
        return int(item)
    if not np.issubdtype(item.dtype, np.number) or np.issubdtype(item.dtype, np.bool_):
        raise ValueError(f"{name}: must be a number, got {item.item()!r}")
    return float(item)


def token_ids(name: str, array: Optional[np.ndarray]) -> Optional[list[int]]:
    """A token-id list input (``INT32 [-1]``), or None when absent.

    Raises:
        ValueError: empty, not integers, or a negative id.
    """
    if array is None:
        return None
    if array.size == 0 or not np.issubdtype(array.dtype, np.integer) or int(array.min()) < 0:
        raise ValueError(f"{name}: must be a non-empty list of token ids (integers >= 0)")
    return [int(t) for t in array.reshape(-1)]


def string_array(values: list[str]) -> np.ndarray:
    """A ``BYTES`` output/input tensor of these texts."""
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)
