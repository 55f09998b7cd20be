"""Offline validation of Kubernetes objects against CRD schemas (shared by chart and operator tests)."""

from __future__ import annotations

import copy
import functools
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


def load_yaml(path: Path):
    """One YAML document from ``path``, read by libyaml's C loader where PyYAML has it (the
    KServe and LWS CRDs are 1-2 MB: ~4.4 CPU-s each in the pure-Python loader, ~0.9 in C)."""
    import yaml

    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.lru_cache(maxsize=None)
def storage_version_validator(crd_path: Path):
    """(apiVersion, kind, jsonschema validator) of a CRD file's storage version, tightened;
    `metadata` is left to the API server. Built once per file and process."""
    import jsonschema

    crd = load_yaml(crd_path)
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


def _lws_validator():
    return storage_version_validator(LWS / "leaderworkerset.x-k8s.io_leaderworkersets.yaml")
