"""The error vocabulary (``pagoda.contracts.errors``): every kind's wire form is the one the
doors answered before the vocabulary existed, and the replicas' real messages classify as
the router has always read them."""

from __future__ import annotations

import json

import pytest

from pagoda.contracts import errors
from pagoda.contracts.errors import ErrorKind, TritonCode, classify_replica_error, is_overloaded, spec_of

# kind: (Triton code, HTTP, /v2 HTTP, gRPC, OpenAI type, Retry-After) as answered today.
TODAY = {
    ErrorKind.INVALID_REQUEST: ("INVALID_ARG", 400, 400, "INVALID_ARGUMENT", "invalid_request_error", False),
    ErrorKind.UNAUTHORIZED: (None, 401, 401, "UNAUTHENTICATED", "authentication_error", False),
    ErrorKind.PERMISSION_DENIED: (None, 403, 403, "PERMISSION_DENIED", "permission_error", False),
    ErrorKind.NOT_FOUND: (None, 404, 404, "NOT_FOUND", "not_found_error", False),
    ErrorKind.DEADLINE_EXCEEDED: ("UNAVAILABLE", 408, 400, "UNAVAILABLE", "timeout", False),
    ErrorKind.RATE_LIMITED: (None, 429, 429, "RESOURCE_EXHAUSTED", "rate_limit_error", True),
    ErrorKind.OVERLOADED: ("UNAVAILABLE", 429, 503, "UNAVAILABLE", "rate_limit_error", True),
    ErrorKind.ENGINE_FAULT: ("INTERNAL", 500, 400, "INTERNAL", "internal_error", False),
    ErrorKind.REPLICA_FAILED: (None, 502, 502, "UNAVAILABLE", "replica_error", False),
    ErrorKind.UNAVAILABLE: ("UNAVAILABLE", 503, 503, "UNAVAILABLE", "service_unavailable", False),
}


def test_every_kind_has_the_wire_form_the_doors_use():
    assert set(errors.SPECS) == set(ErrorKind) == set(TODAY)
    for kind, (code, http, triton_http, grpc_status, openai_type, retry_after) in TODAY.items():
        spec = spec_of(kind)
        assert (spec.triton_code, spec.http_status, spec.triton_http_status, spec.grpc_status, spec.openai_type,
                spec.retry_after) == (code, http, triton_http, grpc_status, openai_type, retry_after), kind
        assert code is None or code in errors.TRITON_CODES


def test_grpc_status_names_exist():
    grpc = pytest.importorskip("grpc")
    assert all(hasattr(grpc.StatusCode, spec.grpc_status) for spec in errors.SPECS.values())


def test_status_lookup_used_by_the_lora_endpoints():
    # /v1/load_lora_adapter answers 400, 404, 502 or 503 with these types (as before).
    types = {status: spec_of(errors.kind_of_http_status(status)).openai_type for status in (400, 404, 502, 503)}
    assert types == {400: "invalid_request_error", 404: "not_found_error", 502: "replica_error",
                     503: "service_unavailable"}
    assert errors.kind_of_http_status(418) is ErrorKind.INVALID_REQUEST


def _real_messages() -> dict[str, ErrorKind]:
    from pagoda.engine.core.load_shedding import deadline_message, overload_message

    overloaded = overload_message("this replica's waiting queue is full (16 requests, at most 16)")
    return {
        overloaded: ErrorKind.OVERLOADED,
        json.dumps({"error": overloaded}): ErrorKind.OVERLOADED,  # a Triton HTTP error body
        f'data: {json.dumps({"error": overloaded})}\n\n': ErrorKind.OVERLOADED,  # its SSE form
        deadline_message(2.0, None): ErrorKind.DEADLINE_EXCEEDED,
        "engine error: RuntimeError: CUDA error: an illegal memory access": ErrorKind.ENGINE_FAULT,
        "engine error while adding the request: ValueError: boom": ErrorKind.ENGINE_FAULT,
        "engine error while unloading: KeyError: 'sql'": ErrorKind.ENGINE_FAULT,
        "request finished without output": ErrorKind.ENGINE_FAULT,
        errors.SHUTDOWN_MESSAGE: ErrorKind.UNAVAILABLE,
        # A draining replica's refusal: 503 on the OpenAI door (it was a 400 before the vocabulary).
        errors.DRAINING_MESSAGE: ErrorKind.UNAVAILABLE,
        "prompt: 5000 tokens exceed this server's max_model_len (2048)": ErrorKind.INVALID_REQUEST,
        "guided_regex: the pattern does not compile: unterminated group": ErrorKind.INVALID_REQUEST,
        "": ErrorKind.INVALID_REQUEST,
    }


def test_real_replica_messages_classify():
    for message, kind in _real_messages().items():
        assert classify_replica_error(message) is kind, message
        assert is_overloaded(message) == (kind is ErrorKind.OVERLOADED)
    assert classify_replica_error(None) is ErrorKind.INVALID_REQUEST and not is_overloaded(None)
    # An engine fault that quotes an overload is still an engine fault (order is the contract).
    assert classify_replica_error("engine error: overloaded: ...") is ErrorKind.ENGINE_FAULT
    # The code decides only where no prefix does.
    assert classify_replica_error("boom", TritonCode.INTERNAL) is ErrorKind.ENGINE_FAULT
    assert classify_replica_error("gone", TritonCode.UNAVAILABLE) is ErrorKind.UNAVAILABLE
    assert classify_replica_error(errors.DEADLINE_PREFIX + " x", TritonCode.UNAVAILABLE) is ErrorKind.DEADLINE_EXCEEDED


def test_engine_and_serving_take_their_prefixes_and_codes_from_the_contract():
    from pagoda.engine.core import load_shedding
    from pagoda.serving import lora_control
    from pagoda.serving.responses import make_error_response

    assert load_shedding.OVERLOADED_PREFIX is errors.OVERLOADED_PREFIX
    assert load_shedding.DEADLINE_PREFIX is errors.DEADLINE_PREFIX
    assert load_shedding.DEFAULT_RETRY_AFTER_S == errors.DEFAULT_RETRY_AFTER_S
    assert lora_control.SHUTDOWN_MESSAGE is errors.SHUTDOWN_MESSAGE
    assert make_error_response("bad").error_code == "INVALID_ARG"
    assert make_error_response("x", "UNAVAILABLE").error_code == "UNAVAILABLE"  # code names still accepted
    assert make_error_response("x", ErrorKind.ENGINE_FAULT).error_code == "INTERNAL"
    assert make_error_response("x", ErrorKind.OVERLOADED).error_code == "UNAVAILABLE"
    with pytest.raises(AssertionError):
        make_error_response("x", ErrorKind.RATE_LIMITED)  # a replica never sends it
    with pytest.raises(AssertionError):
        make_error_response("x", "NOT_A_CODE")


def test_openai_door_answers_replica_errors_as_before():
    from pagoda.fleet.api.openai_api import _replica_error

    expected = {ErrorKind.OVERLOADED: (429, "rate_limit_error"), ErrorKind.DEADLINE_EXCEEDED: (408, "timeout"),
                ErrorKind.ENGINE_FAULT: (500, "internal_error"), ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
                ErrorKind.INVALID_REQUEST: (400, "invalid_request_error")}
    for message, kind in _real_messages().items():
        response = _replica_error(message)
        body = json.loads(response.body)
        assert (response.status, body["error"]["type"]) == expected[kind], message
        assert body["error"] == {"message": message, "type": expected[kind][1], "param": None, "code": None}
        assert (response.headers.get("Retry-After") == "1") == (kind is ErrorKind.OVERLOADED)


def test_error_text_reads_triton_and_openai_bodies():
    from pagoda.contracts.errors import error_text

    assert error_text(b'{"error": "in use"}') == "in use"
    assert error_text(b'{"error": {"message": "no admin key", "type": "permission_error"}}') == "no admin key"
    assert error_text(b"  plain 502 page \n") == "plain 502 page"
    assert error_text(b"[1, 2]") == "[1, 2]"
