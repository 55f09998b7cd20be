"""`spec.kvCache`: the replicas' KV tiers below the device. Schema, rules, flags and volumes.

The engine's tiers (docs/kv_offload.md): a CPU tier of `cpuOffloadBytes` (`pagoda serve
--cpu-offload-bytes`), and below it a **disk tier** (`--kv-disk-dir`, capped at `disk.bytes`)
on a node-local volume, and a **shared tier** (`--kv-shared-dir`) on a ReadWriteMany
PersistentVolumeClaim every replica mounts (NFS, CephFS, ...), whose blocks the router credits to
every replica that mounts it; `writeThrough` (`--kv-write-through`) writes a block to them when its
last request ends, not only when the device evicts it. The chart's KServe ServingRuntime takes the
same settings as `kserve.kvCache`.

Volumes: the disk tier is an `emptyDir` of `disk.sizeLimit` (lost with the pod), or with
`disk.hostPath` a directory on the node (`DirectoryOrCreate`), so a replica restarted on the
node finds its blocks (a warm restart). The disk tier belongs to one engine: with `hostPath`
keep one replica per node (anti-affinity), as two engines would evict each other's files.

Both modes that render pods take it: mode Deployment (the replica pods) and mode KServeLLM (the
flags and volumes go into the LLMInferenceService's `spec.template`, container `main`). KServe's
own `spec.kvCacheOffloading` is not rendered: KServe turns it into vLLM's `--kv-transfer-config`
inside its vLLM command line, which pagoda's `main` container replaces, so it would configure
nothing in pagoda (and could have KServe mount volumes the container never reads).

Rules (each failure names its field; spec.py raises it as a SpecError):
- a disk or shared tier needs `cpuOffloadBytes > 0` (blocks are written from and read into the
  CPU tier) and `spec.engine.enablePrefixCaching` (the tiers hold prefix blocks);
- not with `spec.parallelism` past one rank (the engine refuses file tiers under tensor or
  pipeline parallelism: a step's loaded blocks do not travel to the other ranks yet);
- mode KServe (an InferenceService on the chart's ServingRuntime) is refused: set the chart's
  `kserve.kvCache` values instead;
- the flags rendered here must not also be in `spec.engine.extraArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DISK_MOUNT = "/var/cache/pagoda-kv/disk"
SHARED_MOUNT = "/var/cache/pagoda-kv/shared"
RENDERED_FLAGS = ("--cpu-offload-bytes", "--kv-disk-dir", "--kv-disk-bytes", "--kv-shared-dir", "--kv-write-through")
_QUANTITY = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[eE][0-9]+)?$"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "KV tiers below the device (docs/kv_offload.md): a CPU tier of cpuOffloadBytes, a node-local "
                   "disk tier and a shared tier on a ReadWriteMany PVC that every replica mounts (the router "
                   "credits its blocks to each of them). The file tiers need cpuOffloadBytes > 0.",
    "properties": {
        "cpuOffloadBytes": {"type": "integer", "format": "int64", "minimum": 0, "default": 0,
                            "description": "Host memory for KV blocks (`--cpu-offload-bytes`); 0: off."},
        "writeThrough": {"type": "boolean", "default": False,
                         "description": "Write a block to the disk/shared tier when its last request ends, "
                                        "not only when the device evicts it (`--kv-write-through`)."},
        "disk": {
            "type": "object",
            "description": "A node-local disk tier (`--kv-disk-dir`): an emptyDir of sizeLimit, or hostPath.",
            "required": ["bytes"],
            "properties": {
                "bytes": {"type": "integer", "format": "int64", "minimum": 1,
                          "description": "The tier's cap on file bytes (`--kv-disk-bytes`); below the volume."},
                "sizeLimit": {"type": "string", "pattern": _QUANTITY, "default": "10Gi",
                              "description": "The emptyDir's size limit (ignored with hostPath)."},
                "hostPath": {"type": "string", "pattern": "^/",
                             "description": "A directory on the node instead of an emptyDir: a restarted "
                                            "replica finds its blocks (one replica per node)."},
            },
        },
        "shared": {
            "type": "object",
            "description": "A shared tier (`--kv-shared-dir`) on an existing ReadWriteMany PVC.",
            "required": ["claimName"],
            "properties": {
                "claimName": {"type": "string", "minLength": 1, "maxLength": 253,
                              "description": "The PersistentVolumeClaim every replica mounts."},
            },
        },
    },
}


@dataclass(frozen=True)
class KVCacheSpec:
    cpu_offload_bytes: int = 0
    disk_bytes: int = 0  # 0: no disk tier
    disk_size_limit: str = "10Gi"
    disk_host_path: str = ""
    shared_claim: str = ""  # "": no shared tier
    write_through: bool = False


def check(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """The rules of the module docstring over a defaulted raw spec: (field, message) of the first
    broken one, or []."""
    raw = spec.get("kvCache")
    if raw is None:
        return []
    has_files = "disk" in raw or "shared" in raw
    if has_files and raw["cpuOffloadBytes"] <= 0:
        return [("spec.kvCache.cpuOffloadBytes", "must be > 0 with a disk or shared tier (their blocks are "
                                                 "written from and read into the CPU tier)")]
    if has_files and not spec["engine"]["enablePrefixCaching"]:
        return [("spec.engine.enablePrefixCaching", "must be true with spec.kvCache.disk/shared (the tiers hold "
                                                    "prefix blocks)")]
    split = spec.get("parallelism") or {}
    if has_files and split.get("tensor", 1) * split.get("pipeline", 1) > 1:
        return [("spec.kvCache", "the disk and shared tiers do not work with tensor or pipeline parallelism yet "
                                 "(a step's loaded blocks do not travel to the other ranks); remove them or "
                                 "spec.parallelism")]
    if spec["mode"] == "KServe":
        return [("spec.kvCache", "mode KServe runs the chart's ServingRuntime: set its kserve.kvCache values "
                                 "instead")]
    for arg in spec["engine"].get("extraArgs", []):
        if arg.split("=", 1)[0] in RENDERED_FLAGS:
            return [("spec.engine.extraArgs", f"{arg.split('=', 1)[0]} comes from spec.kvCache; remove it")]
    return []


def parse(raw: dict[str, Any] | None) -> KVCacheSpec | None:
    if raw is None:
        return None
    disk, shared = raw.get("disk") or {}, raw.get("shared") or {}
    return KVCacheSpec(cpu_offload_bytes=raw["cpuOffloadBytes"], disk_bytes=disk.get("bytes", 0),
                       disk_size_limit=disk.get("sizeLimit", "10Gi"), disk_host_path=disk.get("hostPath", ""),
                       shared_claim=shared.get("claimName", ""), write_through=raw["writeThrough"])


def serve_args(kv: KVCacheSpec | None) -> list[str]:
    """`pagoda serve` flags of the tiers ([] without `spec.kvCache`)."""
    if kv is None:
        return []
    args = ["--cpu-offload-bytes", str(kv.cpu_offload_bytes)] if kv.cpu_offload_bytes else []
    if kv.disk_bytes:
        args += ["--kv-disk-dir", DISK_MOUNT, "--kv-disk-bytes", str(kv.disk_bytes)]
    if kv.shared_claim:
        args += ["--kv-shared-dir", SHARED_MOUNT]
    if kv.write_through and (kv.disk_bytes or kv.shared_claim):
        args.append("--kv-write-through")
    return args


def volumes(kv: KVCacheSpec | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts) of the disk and shared tiers."""
    pod, mounts = [], []
    if kv is not None and kv.disk_bytes:
        source = ({"hostPath": {"path": kv.disk_host_path, "type": "DirectoryOrCreate"}} if kv.disk_host_path
                  else {"emptyDir": {"sizeLimit": kv.disk_size_limit}})
        pod.append({"name": "kv-disk", **source})
        mounts.append({"name": "kv-disk", "mountPath": DISK_MOUNT})
    if kv is not None and kv.shared_claim:
        pod.append({"name": "kv-shared", "persistentVolumeClaim": {"claimName": kv.shared_claim}})
        mounts.append({"name": "kv-shared", "mountPath": SHARED_MOUNT})
    return pod, mounts
