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


LWS = Path(__file__).resolve().parent / "data" / "lws"  # LeaderWorkerSet's CRD, with its licence


def storage_version_validator(crd_path: Path):
    """(apiVersion, kind, jsonschema validator) of a CRD file's storage version, tightened;
    `metadata` is left to the API server."""
    import jsonschema
    import yaml

    crd = yaml.safe_load(crd_path.read_text())
    [storage] = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = tighten(storage["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return (f"{crd['spec']['group']}/{storage['name']}", crd["spec"]["names"]["kind"],
            jsonschema.Draft7Validator(schema))


def lws_errors(obj: dict) -> list[str]:
    """Schema errors of a LeaderWorkerSet against LWS's own CRD (tests/data/lws)."""
    api_version, kind, validator = _lws_validator()
    assert (obj["apiVersion"], obj["kind"]) == (api_version, kind), (obj["apiVersion"], obj["kind"])
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


_LWS_VALIDATOR: list = []


def _lws_validator():
    if not _LWS_VALIDATOR:
        _LWS_VALIDATOR.append(storage_version_validator(LWS / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"))
    return _LWS_VALIDATOR[0]
