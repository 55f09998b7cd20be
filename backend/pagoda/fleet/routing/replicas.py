"""The router's view of its replicas: who they are, how to reach them, and whether they work.

Membership comes from exactly one source, fixed at start:

- ``static``: ``--replicas "id=a,grpc=h:p,http=h:p,metrics=h:p;grpc=...,http=..."``. An
  entry without ``id=`` takes the id of the registry heartbeat that names the same gRPC
  endpoint (so the Redis index's replica ids line up), else its gRPC endpoint.
- ``kubernetes``: ready pods matching ``--k8s-selector`` in the router's namespace, listed
  from the API server every few seconds (``routing.k8s_discovery``); id = pod name, the
  replica id the operator gives each replica (``PAGODA_REPLICA_ID``).
- ``registry``: the Redis replica registry itself (every replica with a live heartbeat).
  A member the registry stops listing (Redis restarted empty, FLUSHALL) is kept while its
  health probes pass, for at most ``REGISTRY_GRACE_S`` (``_apply_registry``).

Each ``Replica`` also carries what the router learns on its own: ``in_flight`` (requests
it routed there that have not ended: optimistic accounting, counted at decision time so a
burst spreads before any heartbeat reports it), ``healthy`` (cleared when a connection or
a stream to it breaks; set again by the health prober once ``ServerReady`` answers), the
last heartbeat's load, drain flag and KV connector, and ``lora_synced`` (run-time adapters replayed).

Invariant: ``in_flight`` is changed only by ``ReplicaSet.acquire``/``release`` and never
goes below zero; a replica that leaves membership keeps its object (and channel) until its
in-flight requests end, so their accounting stays exact.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

logger = logging.getLogger(__name__)

ENDPOINT_KEYS = ("grpc", "http", "metrics", "kv")  # kv: the KV connector (routing.peer_pull)
# Disaggregated serving (docs/kv_transfer.md): a prefill replica takes only the first stage of
# a request, a decode replica the second; mixed (the default) takes whole requests.
ROLES = ("mixed", "prefill", "decode")


def parse_replicas_spec(spec: str) -> list[tuple[Optional[str], dict[str, str]]]:
    """Parse ``--replicas``: ``;``-separated entries of ``key=value`` pairs.

    Returns:
        ``[(replica_id or None, {"grpc": "h:p", "http": "h:p", ...}), ...]``.

    Raises:
        ValueError: an empty list, an unknown key, a malformed ``host:port``, or an entry
            without both ``grpc`` and ``http``.
    """
    entries = []
    for raw in (part.strip() for part in spec.split(";")):
        if not raw:
            continue
        replica_id, endpoints = None, {}
        for pair in raw.split(","):
            key, sep, value = pair.strip().partition("=")
            if not sep or not value:
                raise ValueError(f"--replicas: expected key=value, got {pair.strip()!r} in {raw!r}")
            if key == "id":
                replica_id = value
            elif key == "role":
                if value not in ROLES:
                    raise ValueError(f"--replicas: role must be one of {', '.join(ROLES)}, got {value!r}")
                endpoints["role"] = value
            elif key in ENDPOINT_KEYS:
                host, colon, port = value.rpartition(":")
                if not colon or not host or not port.isdigit():
                    raise ValueError(f"--replicas: {key} must be host:port, got {value!r}")
                endpoints[key] = value
            else:
                raise ValueError(f"--replicas: unknown key {key!r} (known: id, grpc, http, metrics, kv, role)")
        missing = [k for k in ("grpc", "http") if k not in endpoints]
        if missing:
            raise ValueError(f"--replicas: entry {raw!r} lacks {' and '.join(missing)}")
        entries.append((replica_id, endpoints))
    if not entries:
        raise ValueError("--replicas: no replica given")
    return entries


@dataclass
class Replica:
    """One replica as the router sees it."""

    replica_id: str
    endpoints: dict[str, str]
    healthy: bool = True
    in_flight: int = 0
    num_routed: int = 0  # requests ever routed here (tests, /metrics)
    draining: bool = False
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    heartbeat_ts: float = 0.0
    unhealthy_reason: str = ""
    unhealthy_since: float = 0.0
    id_from_registry: bool = False
    lora_synced: bool = False  # its LoRA adapters were synced (lora_admin.sync) since it became ready
    missing_since: Optional[float] = None  # registry mode: when the registry stopped listing it (else None)
    role: str = "mixed"  # ROLES: from --replicas' role= (which wins), else the replica's heartbeat
    role_from_spec: bool = False
    heartbeat_kv: Optional[str] = None  # the KV connector its heartbeat advertises (routing.peer_pull)
    shared_tier: str = ""  # the KV shared tier its heartbeat says it mounts (policy: shared credit)
    _grpc_stub: Any = field(default=None, repr=False)
    _grpc_channel: Any = field(default=None, repr=False)
    _probe_stub: Any = field(default=None, repr=False)
    _probe_channel: Any = field(default=None, repr=False)
    _closing: list = field(default_factory=list, repr=False)  # (channel, task) closing after a grace period

    @property
    def kv_address(self) -> Optional[str]:
        """Its KV connector's address: ``--replicas``' ``kv=`` wins over the heartbeat's."""
        return self.endpoints.get("kv") or self.heartbeat_kv

    def grpc_stub(self) -> Any:
        """A ``GRPCInferenceServiceStub`` on one shared channel (created on first use)."""
        if self._grpc_stub is None:
            self._grpc_channel, self._grpc_stub = _open_channel(self.endpoints["grpc"])
        return self._grpc_stub

    def probe_stub(self) -> Any:
        """The stub a health probe uses: the shared one while healthy; while unhealthy, a
        fresh channel per probe, so a restarted server is seen at the next probe instead
        of after the old channel's reconnect backoff (gRPC's grows to minutes)."""
        if self.healthy:
            return self.grpc_stub()
        if self._probe_channel is not None:
            _close_channel_later(self._probe_channel)
        self._probe_channel, self._probe_stub = _open_channel(self.endpoints["grpc"])
        return self._probe_stub

    def adopt_probe_channel(self) -> None:
        """The probe found the replica ready again: its fresh, connected channel becomes the
        shared one; the old one (likely in reconnect backoff) closes after a grace period
        that lets any stream still on it end."""
        if self._probe_channel is None:
            return
        if self._grpc_channel is not None:
            task = _close_channel_later(self._grpc_channel, grace_s=60.0)
            self._closing = [(c, t) for c, t in self._closing if t is not None and not t.done()]
            self._closing.append((self._grpc_channel, task))
        self._grpc_channel, self._grpc_stub = self._probe_channel, self._probe_stub
        self._probe_channel = self._probe_stub = None

    async def close(self) -> None:
        for channel, task in self._closing:
            if task is not None:
                task.cancel()
        for channel in (self._grpc_channel, self._probe_channel, *(c for c, _ in self._closing)):
            if channel is not None:
                await channel.close()
        self._grpc_channel = self._grpc_stub = self._probe_channel = self._probe_stub = None
        self._closing = []


# Reconnect quickly: a replica that restarts is back in seconds, and a channel in gRPC's
# default backoff (1 s growing x1.6 to 120 s) would keep failing long after it is READY.
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                    ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000)]


def _open_channel(target: str) -> tuple[Any, Any]:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _close_channel_later(channel: Any, grace_s: float = 0.0) -> Optional[asyncio.Task]:
    async def close() -> None:
        await asyncio.sleep(grace_s)
        await channel.close()

    try:
        return asyncio.get_running_loop().create_task(close())
    except RuntimeError:  # no loop running: nothing was opened on one either
        return None


class ReplicaSet:
    """Membership, health and in-flight counts of the router's replicas."""

    REGISTRY_GRACE_S = 30.0

    def __init__(self, source: str, registry_grace_s: float = REGISTRY_GRACE_S) -> None:
        assert source in ("static", "kubernetes", "registry"), f"unknown membership source {source}"
        self.source = source
        self.registry_grace_s = registry_grace_s
        self._replicas: dict[str, Replica] = {}
        self._retired: list[Replica] = []  # left membership with requests still in flight

    # ---------------------------------------------------------------- membership
    def set_members(self, members: Iterable[tuple[str, dict[str, str]]]) -> None:
        """Make ``members`` (id, endpoints) the replica list; unknown ids are added."""
        wanted = dict(members)
        for replica_id in list(self._replicas):
            if replica_id not in wanted:
                self._retire(self._replicas.pop(replica_id))
        for replica_id, given in wanted.items():
            endpoints = {k: v for k, v in given.items() if k != "role"}
            replica = self._replicas.get(replica_id)
            if replica is None or replica.endpoints != endpoints:
                if replica is not None:
                    self._retire(self._replicas.pop(replica_id))
                replica = self._replicas[replica_id] = Replica(replica_id, endpoints)
            if "role" in given:
                replica.role, replica.role_from_spec = given["role"], True

    def _retire(self, replica: Replica) -> None:
        if replica.in_flight > 0:
            self._retired.append(replica)
        else:
            _close_later(replica)

    def apply_heartbeats(self, infos: Iterable[Any], now: Optional[float] = None) -> None:
        """Copy heartbeat load onto members; in ``registry`` mode the heartbeats are the members
        (``_apply_registry``: a member the registry stops listing stays while it is healthy,
        for at most ``registry_grace_s``).

        Static entries without an explicit id adopt the id of the heartbeat whose gRPC
        endpoint they name.
        """
        infos = list(infos)
        if self.source == "registry":
            self._apply_registry(infos, time.monotonic() if now is None else now)
        elif self.source == "static":
            by_grpc = {info.endpoints.get("grpc"): info.replica_id for info in infos}
            for replica_id, replica in list(self._replicas.items()):
                new_id = by_grpc.get(replica.endpoints["grpc"])
                if new_id and new_id != replica_id and new_id not in self._replicas and not replica.id_from_registry:
                    del self._replicas[replica_id]
                    replica.replica_id, replica.id_from_registry = new_id, True
                    self._replicas[new_id] = replica
        for info in infos:
            replica = self._replicas.get(info.replica_id)
            if replica is None:
                continue
            replica.waiting, replica.running = int(info.waiting), int(info.running)
            replica.kv_usage, replica.draining = float(info.kv_usage), bool(info.draining)
            replica.heartbeat_ts = float(info.ts)
            role = (getattr(info, "extra", None) or {}).get("role")
            if role in ROLES and not replica.role_from_spec:
                replica.role = role
            replica.heartbeat_kv = info.endpoints.get("kv")
            replica.shared_tier = (getattr(info, "extra", None) or {}).get("shared_tier", "")

    def _apply_registry(self, infos: list[Any], now: float) -> None:
        """Redis restarted empty, or was flushed, forgets every heartbeat at once although
        every replica still serves (they re-register on their next heartbeat); a router that
        took the empty registry literally answered 503 meanwhile. So a member missing from the
        registry is kept while its health probes pass and its last heartbeat did not say
        draining, for at most ``registry_grace_s``; it goes at once when a probe fails (a dead
        replica) and, since a draining replica is not routable, a clean shutdown is unaffected."""
        members = {info.replica_id: dict(info.endpoints) for info in infos}
        for replica_id, replica in self._replicas.items():
            if replica_id in members:
                replica.missing_since = None
                continue
            if replica.missing_since is None:
                replica.missing_since = now
                logger.info("replica %s is no longer in the registry; kept while it answers its health probes "
                            "(at most %.0f s): Redis may have lost its data", replica_id, self.registry_grace_s)
            if replica.healthy and now - replica.missing_since < self.registry_grace_s:
                members[replica_id] = replica.endpoints
        self.set_members(members.items())

    # ---------------------------------------------------------------- queries
    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, replica_id: str) -> Optional[Replica]:
        return self._replicas.get(replica_id)

    def routable(self, exclude: Iterable[str] = (), include_draining: bool = False) -> list[Replica]:
        """Healthy, not excluded (and not draining unless asked), in a stable (id) order."""
        excluded = set(exclude)
        return sorted((r for r in self._replicas.values()
                       if r.healthy and (include_draining or not r.draining) and r.replica_id not in excluded),
                      key=lambda r: r.replica_id)

    # ---------------------------------------------------------------- accounting
    def acquire(self, replica: Replica) -> None:
        replica.in_flight += 1
        replica.num_routed += 1

    def release(self, replica: Replica) -> None:
        assert replica.in_flight > 0, f"in-flight count of {replica.replica_id} would go negative"
        replica.in_flight -= 1
        if replica.in_flight == 0 and replica in self._retired:
            self._retired.remove(replica)
            _close_later(replica)

    def mark_unhealthy(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            logger.warning("replica %s marked unhealthy: %s", replica.replica_id, reason)
        replica.healthy = False
        replica.unhealthy_reason = reason
        replica.unhealthy_since = time.monotonic()

    def mark_healthy(self, replica: Replica) -> None:
        if not replica.healthy:
            logger.info("replica %s is healthy again", replica.replica_id)
            replica.adopt_probe_channel()
        replica.healthy = True
        replica.unhealthy_reason = ""

    async def close(self) -> None:
        for replica in [*self._replicas.values(), *self._retired]:
            await replica.close()
        self._replicas.clear()
        self._retired.clear()


def _close_later(replica: Replica) -> None:
    try:
        asyncio.get_running_loop().create_task(replica.close())
    except RuntimeError:  # no loop running: nothing was opened on one either
        pass
