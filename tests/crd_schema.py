"""Offline validation of Kubernetes objects against CRD schemas (shared by chart and operator tests)."""

from __future__ import annotations

import copy
from pathlib import Path

KSERVE = Path(__file__).resolve().parent / "data" / "kserve"  # KServe's CRDs, with their licence


def tighten(schema: dict) -> dict:
    """Forbid unknown fields wherever an object lists its properties (as the API server's
    strict field validation does); leave x-kubernetes-preserve-unknown-fields alone."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema
