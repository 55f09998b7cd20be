"""Strict JSON for request bodies and JSON-valued inputs, on every door.

Python's ``json.loads`` accepts what no JSON client means and what later code cannot
handle: ``NaN``/``Infinity`` (and ``1e999``, which becomes infinity), nesting deep enough
to exhaust the parser's recursion (a ``RecursionError``, not a ``ValueError``), and ``\\ud800``
escapes that make lone surrogates (any later ``.encode("utf-8")`` raises). Each of those
was a 500, or a lost gRPC request, at the router's doors. ``loads`` refuses all of them with
a ``JSONInputError`` (a ``ValueError``) whose message names the field: ``what`` (the body or
input), then the JSON path of the offending value (a non-finite number is parsed as a marker
and refused by the walk over the document, which knows its path).

Limits: at most ``MAX_DEPTH`` nested arrays/objects (OpenAI requests, JSON schemas for
structured output and tools need far fewer; Envoy's and vLLM's servers refuse deeper
documents too). Only finite numbers. Strings must be valid Unicode (no lone surrogates).
"""

from __future__ import annotations

import json
import math
from typing import Any, Union

MAX_DEPTH = 64


class JSONInputError(ValueError):
    """Input JSON refused; ``param`` names the input it came in."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _NonFinite:
    """Where a non-finite number stood while parsing; ``check`` refuses it naming its path."""

    def __init__(self, message: str) -> None:
        self.message = message


def loads(text: Union[str, bytes, bytearray], what: str = "body") -> Any:
    """Parse ``text`` strictly (module docstring); raises ``JSONInputError`` naming ``what`` and
    the JSON path of the offending value (``body.temperature: NaN is not a JSON number``)."""

    def constant(name: str) -> _NonFinite:
        return _NonFinite(f"{name} is not a JSON number (only finite numbers are accepted)")

    def finite(literal: str) -> Any:
        value = float(literal)
        if not math.isfinite(value):
            return _NonFinite(f"the number {literal} is out of range (only finite numbers are accepted)")
        return value

    try:
        value = json.loads(text, parse_constant=constant, parse_float=finite)
    except RecursionError:
        raise JSONInputError(f"{what}: JSON nested too deeply (at most {MAX_DEPTH} levels)", what) from None
    except UnicodeDecodeError as exc:
        raise JSONInputError(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})", what) from None
    except ValueError as exc:
        raise JSONInputError(f"{what}: not valid JSON ({exc})", what) from None
    check(value, what)
    return value


def check(value: Any, what: str) -> None:
    """Depth, Unicode and finite numbers of a parsed document (``loads`` calls it)."""
    stack = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, what, path)
        elif isinstance(item, _NonFinite):
            raise JSONInputError(f"{what}{path}: {item.message}", what)
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise JSONInputError(f"{what}: JSON nested too deeply (at most {MAX_DEPTH} levels)", what)
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, what, path)
                    stack.append((child, depth + 1, f"{path}.{key}"))
            else:
                stack.extend((child, depth + 1, f"{path}[{i}]") for i, child in enumerate(item))


def _check_text(text: str, what: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise JSONInputError(f"{what}{path}: a lone surrogate (\\u{code:04x}) is not valid Unicode; send UTF-8 text",
                             what) from None
