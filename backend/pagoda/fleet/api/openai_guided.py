"""Structured output at the OpenAI endpoints -> the engine's ``guided_decoding`` object.

Accepted on ``/v1/chat/completions`` and ``/v1/completions`` (one per request):

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
  {...}, "strict": ...}}`` (``strict`` is accepted and ignored: the output always follows
  the schema).
- vLLM's extra fields: ``guided_json`` (schema object or string), ``guided_regex``,
  ``guided_choice`` (list of strings), ``guided_grammar`` (EBNF), and
  ``guided_decoding_backend`` (``xgrammar``); ``guided_whitespace_pattern`` is refused.

The result is checked with ``GuidedDecodingParams`` here, so a malformed format is a 400
before any replica sees it; a format that parses but does not compile comes back from the
replica as its 400.
"""

from __future__ import annotations

from typing import Any, Optional

from pagoda.engine.guided.params import GuidedDecodingParams

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def guided_decoding_from_body(request: Any, error: type) -> Optional[dict[str, Any]]:
    """The ``guided_decoding`` dict for ``sampling_parameters``, or ``None``.

    Args:
        request: the validated request (``openai_protocol``; its types are checked there,
            the meaning here).
        error: exception type raised as ``error(message, param)`` (``OpenAIError``).
    """
    given: list[tuple[str, dict[str, Any]]] = []
    if request.response_format is not None:
        found = _from_response_format(request.response_format, error)
        if found is not None:
            given.append(("response_format", found))
    for name, kind in _GUIDED_FIELDS.items():
        if getattr(request, name) is not None:
            given.append((name, {kind: getattr(request, name)}))
    if request.guided_whitespace_pattern is not None:
        raise error("guided_whitespace_pattern: not supported; the xgrammar backend allows any JSON whitespace",
                    "guided_whitespace_pattern")
    backend = request.guided_decoding_backend
    if not given:
        if backend is not None:
            raise error("guided_decoding_backend: needs one of response_format, guided_json, guided_regex, "
                        "guided_choice, guided_grammar", "guided_decoding_backend")
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise error(f"{given[1][0]}: give one output format per request, got {names}", given[1][0])
    param, guided = given[0]
    if backend is not None:
        guided["backend"] = backend
    try:
        GuidedDecodingParams.from_dict(dict(guided))
    except ValueError as exc:
        raise error(f"{param}: {exc}", param) from None
    return guided


def _from_response_format(value: Any, error: type) -> Optional[dict[str, Any]]:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return {"json_object": True}
    if value.json_schema is None:
        raise error("response_format: json_schema needs {'name': ..., 'schema': {...}}", "response_format")
    return {"json": value.json_schema.schema_}
