"""Pod hardening shared by every pod the operator renders (replicas and routers).

- the pod runs as a non-root user (uid/gid 1000, `triton-server` in NVIDIA's image) with
  the runtime's default seccomp profile;
- each container has a read-only root filesystem, no privilege escalation and no Linux
  capabilities;
- what pagoda and tritonserver do write goes to emptyDirs: `/tmp` (the materialized model
  repository and backend directory of `pagoda serve`, Python's temp files) and
  `CACHE_DIR` (Triton/torch JIT caches; `HOME` points there too, so a library that
  writes `~/.cache` writes into it). Replicas also get a memory-backed `/dev/shm`
  (render_replicas.py).
"""

from __future__ import annotations

from typing import Any

RUN_AS_USER = 1000
CACHE_DIR = "/var/cache/pagoda"


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def writable_volumes(tmp_size: str = "2Gi") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for the writable paths under a read-only root filesystem."""
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": tmp_size}},
               {"name": "cache", "emptyDir": {"sizeLimit": "4Gi"}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    return volumes, mounts


def writable_env() -> list[dict[str, str]]:
    """Point every cache a library might write at the writable cache volume."""
    return [{"name": "HOME", "value": CACHE_DIR},
            {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
            {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/inductor"},
            {"name": "TMPDIR", "value": "/tmp"}]
