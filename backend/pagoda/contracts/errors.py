"""One error vocabulary: what failed, and how each door says it.

A replica reports a failure as a Triton error (a code name and a message); the router
answers its clients in three dialects (OpenAI JSON, Triton HTTP, Triton gRPC). This module
names every kind of failure once (``ErrorKind``) and gives each its wire form
(``ErrorSpec``): the Triton code a replica sends, the router's HTTP status and OpenAI
error type, its status where the router's Triton HTTP door answers itself, the gRPC
status, and whether the answer carries ``Retry-After``.

    kind               Triton code   HTTP  /v2  gRPC                 OpenAI type            Retry-After
    invalid_request    INVALID_ARG   400   400  INVALID_ARGUMENT     invalid_request_error
    unauthorized       -             401   401  UNAUTHENTICATED      authentication_error
    permission_denied  -             403   403  PERMISSION_DENIED    permission_error
    not_found          -             404   404  NOT_FOUND            not_found_error
    deadline_exceeded  UNAVAILABLE   408   400  UNAVAILABLE          timeout
    rate_limited       -             429   429  RESOURCE_EXHAUSTED   rate_limit_error       yes
    overloaded         UNAVAILABLE   429   503  UNAVAILABLE          rate_limit_error       yes
    engine_fault       INTERNAL      500   400  INTERNAL             internal_error
    replica_failed     -             502   502  UNAVAILABLE          replica_error
    unavailable        UNAVAILABLE   503   503  UNAVAILABLE          service_unavailable

"-": a replica never sends it (the router's own refusals). "/v2": the router's Triton HTTP
door where it answers itself; a replica's error there is relayed as tritonserver sent it
(400 on ``generate``: tritonserver answers every backend error with 400, the message tells
them apart), except an overload when every replica is full (503). gRPC: the status of a
unary call (tritonserver maps the Triton code); on a stream an error is an in-band
response carrying the replica's message. The OpenAI door's unknown ``model`` is OpenAI's
own convention (404, ``invalid_request_error``, code ``model_not_found``), not a kind here.

Messages. A replica's message is what tells kinds apart (the Triton code does not reach a
stream's client, and ``UNAVAILABLE`` covers four kinds), so the engine and serving layers
build their messages from the prefixes below, and ``classify_replica_error`` is the one
function that reads them back. Its order is the contract: an engine fault first (its text
may quote anything), then shutting down or draining, then an overload anywhere in the text (a Triton
HTTP body wraps the message in JSON), then a deadline; anything else is the request's fault.

Invariants: the prefixes, codes and statuses here are wire formats (clients and older
routers match them); change one only with every door's tests. This module imports nothing
of pagoda's (``contracts`` is the bottom floor).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Optional

OVERLOADED_PREFIX = "overloaded:"  # admission control refused or displaced the request
DEADLINE_PREFIX = "deadline exceeded:"  # the request's timeout passed
ENGINE_ERROR_PREFIX = "engine error"  # the engine raised while adding or stepping
NO_OUTPUT_MESSAGE = "request finished without output"  # the engine ended a request silently
SHUTDOWN_MESSAGE = "the server is shutting down"
DRAINING_PREFIX = "the replica is draining"  # pagoda serve's drain: in-flight requests finish, new ones go
DRAINING_MESSAGE = (DRAINING_PREFIX + " (shutting down): it finishes the requests it has and takes no new ones; "
                    "retry on another replica")
DEFAULT_RETRY_AFTER_S = 1.0  # the retry hint of an overload (message and Retry-After)


class TritonCode:
    """The Triton error code names (``pb_utils.TritonError.<name>``) a replica sends."""

    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


TRITON_CODES = (TritonCode.INVALID_ARG, TritonCode.UNAVAILABLE, TritonCode.INTERNAL)


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    ENGINE_FAULT = "engine_fault"
    REPLICA_FAILED = "replica_failed"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class ErrorSpec:
    """The wire form of one ``ErrorKind`` (the module docstring's table)."""

    kind: ErrorKind
    triton_code: Optional[str]  # None: a replica never sends this kind
    http_status: int  # OpenAI door, and the router's own answers
    triton_http_status: int  # the router's Triton HTTP (/v2) door where it answers itself
    grpc_status: str  # a grpc.StatusCode name
    openai_type: str
    retry_after: bool = False


_K = ErrorKind
SPECS: dict[ErrorKind, ErrorSpec] = {spec.kind: spec for spec in (
    ErrorSpec(_K.INVALID_REQUEST, TritonCode.INVALID_ARG, 400, 400, "INVALID_ARGUMENT", "invalid_request_error"),
    ErrorSpec(_K.UNAUTHORIZED, None, 401, 401, "UNAUTHENTICATED", "authentication_error"),
    ErrorSpec(_K.PERMISSION_DENIED, None, 403, 403, "PERMISSION_DENIED", "permission_error"),
    ErrorSpec(_K.NOT_FOUND, None, 404, 404, "NOT_FOUND", "not_found_error"),
    ErrorSpec(_K.DEADLINE_EXCEEDED, TritonCode.UNAVAILABLE, 408, 400, "UNAVAILABLE", "timeout"),
    ErrorSpec(_K.RATE_LIMITED, None, 429, 429, "RESOURCE_EXHAUSTED", "rate_limit_error", retry_after=True),
    ErrorSpec(_K.OVERLOADED, TritonCode.UNAVAILABLE, 429, 503, "UNAVAILABLE", "rate_limit_error", retry_after=True),
    ErrorSpec(_K.ENGINE_FAULT, TritonCode.INTERNAL, 500, 400, "INTERNAL", "internal_error"),
    ErrorSpec(_K.REPLICA_FAILED, None, 502, 502, "UNAVAILABLE", "replica_error"),
    ErrorSpec(_K.UNAVAILABLE, TritonCode.UNAVAILABLE, 503, 503, "UNAVAILABLE", "service_unavailable"),
)}


def spec_of(kind: ErrorKind) -> ErrorSpec:
    """The wire form of ``kind``."""
    return SPECS[kind]


def kind_of_http_status(status: int) -> ErrorKind:
    """The first kind answered with HTTP ``status`` (``invalid_request`` for an unknown one)."""
    return next((spec.kind for spec in SPECS.values() if spec.http_status == status), ErrorKind.INVALID_REQUEST)


def triton_code_of(kind: ErrorKind) -> str:
    """The Triton code a replica sends for ``kind``; asserts a replica may send it."""
    code = SPECS[kind].triton_code
    assert code is not None, f"a replica never sends {kind.value}"
    return code


def classify_replica_error(message: Optional[str], triton_code: Optional[str] = None) -> ErrorKind:
    """The kind of an error a replica sent (see "Messages" in the module docstring).

    Args:
        message: the replica's error text (a stream response's ``error_message``, a Triton
            HTTP error body or its ``error`` string).
        triton_code: the Triton code, where the caller has it; it decides only for a
            message none of the prefixes names.

    Returns:
        The kind; ``INVALID_REQUEST`` for an empty or unrecognised message without a code.
    """
    text = message or ""
    if text.startswith((ENGINE_ERROR_PREFIX, NO_OUTPUT_MESSAGE)):
        return ErrorKind.ENGINE_FAULT
    if text.startswith((SHUTDOWN_MESSAGE, DRAINING_PREFIX)):
        return ErrorKind.UNAVAILABLE
    if OVERLOADED_PREFIX in text:
        return ErrorKind.OVERLOADED
    if text.startswith(DEADLINE_PREFIX):
        return ErrorKind.DEADLINE_EXCEEDED
    if triton_code == TritonCode.INTERNAL:
        return ErrorKind.ENGINE_FAULT
    if triton_code == TritonCode.UNAVAILABLE:
        return ErrorKind.UNAVAILABLE
    return ErrorKind.INVALID_REQUEST


# Triton's Python backend, when the model's stub process died under a request.
STUB_DIED_MARKERS = ("Stub process", "is not healthy")


def is_replica_fault(message: Optional[str]) -> bool:
    """Whether a replica's error says the replica, not the request, failed: it is shutting
    down or draining, or its model's stub died. The router may continue such a request on
    another replica (request migration, docs/reliability.md); an engine fault is not one (the
    same request could fail the next replica the same way)."""
    text = message or ""
    return text.startswith((SHUTDOWN_MESSAGE, DRAINING_PREFIX)) or all(m in text for m in STUB_DIED_MARKERS)


def is_overloaded(message: Optional[str]) -> bool:
    """Whether a replica refused the request as overloaded (``classify_replica_error``)."""
    return classify_replica_error(message) is ErrorKind.OVERLOADED


__all__ = ["ErrorKind", "ErrorSpec", "SPECS", "TritonCode", "TRITON_CODES", "classify_replica_error", "is_overloaded",
           "is_replica_fault", "kind_of_http_status", "spec_of", "triton_code_of", "OVERLOADED_PREFIX",
           "DEADLINE_PREFIX",
           "ENGINE_ERROR_PREFIX", "NO_OUTPUT_MESSAGE", "SHUTDOWN_MESSAGE", "DRAINING_PREFIX", "DRAINING_MESSAGE",
           "DEFAULT_RETRY_AFTER_S", "STUB_DIED_MARKERS"]


def error_text(data: bytes) -> str:
    """The message of an error body: Triton's ``{"error": "..."}``, OpenAI's ``{"error":
    {"message": ...}}``, or the raw text when it is neither."""
    text = data.decode("utf-8", "replace").strip()
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, dict) and isinstance(value.get("error"), dict):  # OpenAI's shape
        return str(value["error"].get("message", text))
    return str(value.get("error", text)) if isinstance(value, dict) else text
