"""Size and complexity limits on a guided format, checked before it is compiled.

A grammar compile runs in C++ and cannot be interrupted; a small format can still expand
into a huge automaton (every bounded repetition ``x{0,1000}`` is unrolled). So what can
be measured in the text is refused up front, with a ``ValueError`` (a 400) naming the
``EngineConfig`` field that bounds it (``GuidedConfig``, docs/structured_output.md):

- ``guided_max_spec_chars``: the format's text (schema as canonical JSON, regex, grammar,
  choices as a JSON list);
- ``guided_max_schema_properties``: properties summed over every object of a schema;
- ``guided_max_schema_depth``: nesting of the schema document's objects and arrays;
- ``guided_max_regex_chars``: a regex, and each ``pattern`` of a schema;
- ``guided_max_length_bound``: the *repetition bound* of the format: the sum of every
  bounded repetition's upper bound (``maxLength``/``minLength``, ``maxItems``/``minItems``,
  ``maxProperties``, a regex's or a grammar's ``{m,n}``), a repetition nested in another
  counted times the outer bound (``(a{100}){200}`` is 20,000).

Invariant: the check is linear in the format's text and never compiles anything; it is
an estimate that errs on the side of refusing (a grammar's ``{m,n}`` inside a string
literal counts too).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.engine.config import GuidedConfig
from pagoda.engine.guided.params import GuidedDecodingParams

_STRING_BOUNDS = ("maxLength", "minLength")
_ARRAY_BOUNDS = ("maxItems", "minItems")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_complexity(params: GuidedDecodingParams, config: GuidedConfig) -> None:
    """Raise ``ValueError`` (``guided_decoding.<kind>: ... over <field>=<limit>``) when
    ``params`` is over one of ``config``'s limits."""
    kind, spec = params.kind, params.spec
    _over(kind, "characters", len(spec), "guided_max_spec_chars", config.guided_max_spec_chars)
    if kind == "regex":
        bound = _regex_bound(kind, spec, config)
    elif kind == "grammar":
        bound = _nested_bound(spec, "(", ")")
    elif kind == "json":
        walk = _SchemaWalk(config)
        bound = walk.cost(json.loads(spec), 1)
        _over(kind, "properties", walk.properties, "guided_max_schema_properties", config.guided_max_schema_properties)
    else:
        bound = 0
    _over(kind, "as repetition bound", bound, "guided_max_length_bound", config.guided_max_length_bound)


def _over(kind: str, what: str, value: int, field: str, limit: int) -> None:
    if value > limit:
        raise ValueError(f"guided_decoding.{kind}: {value} {what}, over {field}={limit} "
                         f"(a server setting; simplify the format)")


def _regex_bound(kind: str, regex: str, config: GuidedConfig) -> int:
    _over(kind, "regex characters", len(regex), "guided_max_regex_chars", config.guided_max_regex_chars)
    return _nested_bound(_strip_classes(regex), "(", ")")


def _strip_classes(regex: str) -> str:
    """The regex without escapes and ``[...]`` classes (a ``{`` in them is a literal)."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            out.append("x")
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            out.append("x")
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _nested_bound(text: str, open_: str, close: str) -> int:
    """Sum of ``{m,n}`` upper bounds (``m`` for ``{m,}``), each group's sum multiplied by
    the bound that follows the group."""
    stack, i = [0], 0
    while i < len(text):
        c = text[i]
        if c == open_:
            stack.append(0)
        elif c == close and len(stack) > 1:
            inner = stack.pop()
            match = _QUANTIFIER.match(text, i + 1)
            if match:
                stack[-1] += max(inner, 1) * _upper(match)
                i = match.end()
                continue
            stack[-1] += inner
        elif c == "{":
            match = _QUANTIFIER.match(text, i)
            if match:
                stack[-1] += _upper(match)
                i = match.end()
                continue
        i += 1
    return sum(stack)


def _upper(match: "re.Match[str]") -> int:
    low, high = match.group(1), match.group(2)
    return int(high) if high else int(low)


class _SchemaWalk:
    """One pass over a schema document: properties counted, depth checked, cost summed."""

    def __init__(self, config: GuidedConfig) -> None:
        self.config = config
        self.properties = 0

    def cost(self, node: Any, depth: int) -> int:
        limit = self.config.guided_max_schema_depth
        if depth > limit:
            _over("json", "levels of nesting", depth, "guided_max_schema_depth", limit)
        if isinstance(node, list):
            return sum(self.cost(item, depth + 1) for item in node)
        if not isinstance(node, dict):
            return 0
        if isinstance(node.get("properties"), dict):
            self.properties += len(node["properties"])
        total = _bound(node, _STRING_BOUNDS) + _bound(node, ("maxProperties", "minProperties"))
        if isinstance(node.get("pattern"), str):
            total += _regex_bound("json", node["pattern"], self.config)
        items = 0
        for key, value in node.items():
            child = self.cost(value, depth + 1)
            if key in ("items", "prefixItems", "additionalItems", "contains"):
                items += child
            else:
                total += child
        repeats = _bound(node, _ARRAY_BOUNDS)
        return total + (max(items, 1) * repeats if repeats else items)


def _bound(node: dict, keys: tuple[str, ...]) -> int:
    values = [node[k] for k in keys if isinstance(node.get(k), int) and not isinstance(node.get(k), bool)]
    return max(values) if values else 0
