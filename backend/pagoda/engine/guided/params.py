"""What one request's output must look like: ``GuidedDecodingParams``, shaped like vLLM's.

Exactly one kind per request:

- ``json``: a JSON schema (a dict, or a string holding one); the output is a JSON value
  valid against it.
- ``json_object``: ``True``: the output is any JSON object (OpenAI's ``json_object``).
- ``regex``: the whole output matches this regular expression.
- ``choice``: the output is exactly one of these strings.
- ``grammar``: an EBNF grammar (GBNF style, root rule ``root``).

Everything that can be checked without compiling is checked here (one kind, types, JSON
syntax, sizes); compilation errors (an unsupported schema keyword, a bad regex, an
undefined rule) surface later, per request, from the grammar backend.
``cache_key`` identifies a compiled grammar: equal keys compile to the same grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from pagoda.contracts import json_input

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A specification longer than this is a mistake (or an attack on the compiler), not a format.
MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 8_192  # 5,000 choices compile in 0.6 s (xgrammar, a loaded 2-core Xeon)
BACKENDS = ("xgrammar",)


@dataclass
class GuidedDecodingParams:
    """One request's output format. Raises ``ValueError`` (message starting with
    ``guided_decoding``) when not exactly one kind is given or a value has the wrong type.

    Attributes:
        json: JSON schema as a dict or a JSON string.
        json_object: ``True`` for any JSON object.
        regex: regular expression the whole output must match.
        choice: the output is one of these strings.
        grammar: EBNF grammar with a ``root`` rule.
        backend: grammar backend; ``None`` means the server's default (``xgrammar``).
        disable_any_whitespace: JSON kinds only: no optional whitespace between tokens
            (compact output, fewer tokens); by default any whitespace is allowed.
    """

    json: Optional[Union[str, dict]] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    backend: Optional[str] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided_decoding: give exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"guided_decoding.json_object: must be a boolean, got {self.json_object!r}")
        if self.json is not None:
            self.json = _schema_text(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided_decoding.{name}: must be a non-empty string, got {value!r}")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"guided_decoding.{name}: longer than {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            _check_choice(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"guided_decoding.disable_any_whitespace: must be a boolean, "
                             f"got {self.disable_any_whitespace!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"guided_decoding.backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The kind's specification as text: the schema (canonical JSON), the regex, the
        grammar, the choices as a JSON list, or ``""`` for ``json_object``."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        return getattr(self, kind)

    @property
    def cache_key(self) -> tuple[str, str, str, bool]:
        return (self.backend or BACKENDS[0], self.kind, self.spec, self.disable_any_whitespace)

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, as JSON values (``from_dict`` reads them back)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}

    @classmethod
    def from_dict(cls, values: Any) -> "GuidedDecodingParams":
        """From a JSON object (Triton's ``sampling_parameters.guided_decoding``); unknown
        keys and ``null`` values of unused kinds are handled like vLLM's backend does:
        unknown keys are refused, ``null`` means "not given"."""
        if isinstance(values, GuidedDecodingParams):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"guided_decoding: must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(values) - known)
        if unknown:
            raise ValueError(f"guided_decoding: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


def _schema_text(schema: Any) -> str:
    """A schema given as a dict or a JSON string, as canonical JSON text (the cache key)."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise ValueError(f"guided_decoding.json: longer than {MAX_SPEC_CHARS} characters")
        try:
            schema = json_input.loads(schema, "guided_decoding.json")  # strict: finite numbers, bounded depth
        except json_input.JSONInputError as exc:
            raise ValueError(str(exc)) from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"guided_decoding.json: a JSON schema must be an object, got {type(schema).__name__}")
    # Key order kept: a schema's property order is the order the output is generated in.
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"guided_decoding.json: longer than {MAX_SPEC_CHARS} characters")
    return text


def _check_choice(choice: Any) -> None:
    if not isinstance(choice, (list, tuple)) or not choice:
        raise ValueError(f"guided_decoding.choice: must be a non-empty list of strings, got {choice!r}")
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"guided_decoding.choice: at most {MAX_CHOICES} choices, got {len(choice)}")
    for item in choice:
        if not isinstance(item, str) or not item:
            raise ValueError(f"guided_decoding.choice: every choice must be a non-empty string, got {item!r}")
    if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
        raise ValueError(f"guided_decoding.choice: longer than {MAX_SPEC_CHARS} characters in all")
