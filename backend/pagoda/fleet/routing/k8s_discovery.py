"""Kubernetes discovery: the ready pods matching ``--k8s-selector`` become a ``ReplicaSet``'s members.

``KubernetesDiscovery`` lists the pods of the router's namespace that match a label
selector from the API server every ``interval_s`` (5 s) and hands the ready ones to
``ReplicaSet.set_members``; a failed list keeps the last known members and is retried.
``pod_to_member`` reads one pod: a pod that is being deleted, has no IP or is not
``Ready`` is no member; its id is the pod name (the replica id the operator gives each
replica, ``PAGODA_REPLICA_ID``), its endpoints the pod IP with the container ports named
``http``/``grpc``/``metrics`` (else ``DEFAULT_PORTS``), and its role the operator's
disaggregated pool label. ``KubernetesConfig`` says where the API server is and how to
authenticate: in a pod, its service account (``in_cluster``); else ``--k8s-api``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.fleet.routing.replicas import ROLES, ReplicaSet

logger = logging.getLogger(__name__)

POOL_LABEL = "pagoda.dev/pool"  # pods of an operator's prefill or decode pool (pagoda_operator.naming)
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


@dataclass
class KubernetesConfig:
    """Where and how to reach the API server (in-cluster defaults)."""

    api_url: str
    namespace: str
    token: Optional[str] = None
    ca_file: Optional[str] = None

    @classmethod
    def in_cluster(cls, namespace: Optional[str] = None) -> "KubernetesConfig":
        """The service-account configuration a pod has.

        Raises:
            RuntimeError: not running in a pod (no ``KUBERNETES_SERVICE_HOST``).
        """
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("--k8s-selector needs to run in a pod (KUBERNETES_SERVICE_HOST is not set); "
                               "pass --k8s-api to point at an API server")
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        namespace = namespace or os.environ.get("PAGODA_NAMESPACE") or _read(f"{sa}/namespace") or "default"
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", namespace, _read(f"{sa}/token"), f"{sa}/ca.crt")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def pod_to_member(pod: dict[str, Any]) -> Optional[tuple[str, dict[str, str]]]:
    """(replica id, endpoints) of a ready pod, or ``None`` for a pod not ready to serve."""
    metadata, status, spec = pod.get("metadata", {}), pod.get("status", {}), pod.get("spec", {})
    if metadata.get("deletionTimestamp") or not status.get("podIP"):
        return None
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions", [])}
    if conditions.get("Ready") != "True":
        return None
    ports = dict(DEFAULT_PORTS)
    for container in spec.get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") in ports:
                ports[port["name"]] = int(port["containerPort"])
    ip = status["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    member = {key: f"{host}:{value}" for key, value in ports.items()}
    role = (metadata.get("labels") or {}).get(POOL_LABEL)  # the operator's disaggregated pools
    if role in ROLES:
        member["role"] = role
    return metadata["name"], member


class KubernetesDiscovery:
    """Lists pods matching a label selector and feeds them to a ``ReplicaSet``.

    Args:
        replicas: the set to update.
        selector: a label selector (``a=b,c=d``).
        config: API server location and credentials.
        interval_s: seconds between lists.
    """

    def __init__(self, replicas: ReplicaSet, selector: str, config: KubernetesConfig, interval_s: float = 5.0) -> None:
        self.replicas = replicas
        self.selector = selector
        self.config = config
        self.interval_s = interval_s
        self.num_lists = 0
        self._task: Optional[asyncio.Task] = None
        self._session: Any = None

    async def list_members(self) -> list[tuple[str, dict[str, str]]]:
        """One list call; returns the ready replicas (raises on API errors)."""
        import aiohttp

        if self._session is None:
            ssl_context: Any = None
            if self.config.api_url.startswith("https://"):
                ssl_context = ssl.create_default_context(cafile=self.config.ca_file) if self.config.ca_file else None
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_context)
                                                  if ssl_context else None)
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        url = f"{self.config.api_url}/api/v1/namespaces/{self.config.namespace}/pods"
        async with self._session.get(url, params={"labelSelector": self.selector}, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status != 200:
                raise RuntimeError(f"listing pods failed: HTTP {response.status}: {(await response.text())[:200]}")
            body = json.loads(await response.text())
        self.num_lists += 1
        return [m for m in (pod_to_member(pod) for pod in body.get("items", [])) if m is not None]

    async def refresh(self) -> None:
        self.replicas.set_members(await self.list_members())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pagoda-k8s-discovery")

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the last known members and retry
                logger.warning("Kubernetes discovery failed (keeping %d known replicas): %s",
                               len(self.replicas.all()), exc)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
