"""Builders of OpenAPI v3 schema nodes for structural CRD schemas (crd.py, crd_status.py).

Each returns a plain dict; `obj` lists its properties (never
`x-kubernetes-preserve-unknown-fields`), so the API server prunes or rejects unknown fields.
Scalars carry a description; `integer` is int32 (the API server's default for counts).
"""

from __future__ import annotations

from typing import Any


def obj(properties: dict[str, Any], *, required: list[str] | None = None,
        description: str | None = None, **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    if description:
        schema["description"] = description
    schema.update(extra)
    return schema


def string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def integer(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", "description": description, **extra}


def number(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "description": description, **extra}


def boolean(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "boolean", "description": description, **extra}
