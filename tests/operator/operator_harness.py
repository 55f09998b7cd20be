"""Test harness: an emulated API server, a kopf operator, and fakes for the rest.

- `Cluster`: PagodaKubeEmulator + kmock.Server on their own event loop in a thread,
  with a small synchronous JSON client for the test body (acts like kubectl).
- `Operator`: our kopf registry run by `kopf.operator` in its own thread and loop
  (inside pytest's loop kopf would cancel pytest's tasks when it stops).
- `FakeFleet`: the FleetStore the operator reads, injected through kopf.Memo; the test
  sets per-replica loads and the fake records drain/forget calls.
- `FakeDeploymentController`: stands in for the ReplicaSet controller: keeps one pod per
  replica, deletes the pod with the lowest pod-deletion-cost on scale-in (as Kubernetes
  does), and records each deleted pod's drain state at the moment of deletion.
- `FakeLeaderWorkerSetController`: the same for a LeaderWorkerSet (multi-node replicas):
  one leader pod and `size - 1` worker pods per group, and on scale-in it removes the
  highest-numbered groups whole (its leaders are a StatefulSet), as LWS does.
- `FakeClock`: time for the policy windows and drain timeouts, advanced by the test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import kmock
import kopf

from k8s_emulator import PagodaKubeEmulator
from pagoda_operator import crd
from pagoda_operator.drain import DELETION_COST_ANNOTATION
from pagoda_operator.handlers import make_registry
from pagoda_operator.load import ReplicaLoad

NS = "default"
LLMS = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{NS}/llmservices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
LWSS = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets"
PODS = f"/api/v1/namespaces/{NS}/pods"


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0,
             what: str | Callable[[], str] = "condition",
             step: Callable[[], None] | None = None) -> Any:
    """Poll `predicate` (running `step` first each round) until it returns truthy."""
    deadline = time.monotonic() + timeout
    while True:
        if step is not None:
            step()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


class Cluster:
    def __init__(self) -> None:
        self.url = ""
        self.emulator: PagodaKubeEmulator | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with PagodaKubeEmulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"] = kmock.ResourceInfo(
                kind=crd.KIND, singular=crd.SINGULAR, namespaced=True,
                shortnames=set(crd.SHORT_NAMES), subresources={"status"},
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
            # kopf's backbone waits for these to be discoverable. (kmock cannot serve
            # /api/v1/namespaces itself, so the Operator disables kopf's scanning.)
            for key, kind, namespaced in (
                    ("v1/namespaces", "Namespace", False), ("v1/events", "Event", True),
                    ("apiextensions.k8s.io/v1/customresourcedefinitions",
                     "CustomResourceDefinition", False)):
                emulator.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, verbs={"get", "list", "watch", "create"})
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._started.set()
            await self._stop.wait()

    def start(self) -> "Cluster":
        self._thread.start()
        assert self._started.wait(10), "emulator did not start"
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/merge-patch+json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json" if method == "POST"
                           else content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def items(self, path: str, selector: str | None = None) -> list[dict[str, Any]]:
        suffix = f"?labelSelector={selector}" if selector else ""
        return (self.get(path + suffix) or {}).get("items", [])

    def create(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, body)

    def patch(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("PATCH", path, body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def count_writes(self, path_part: str) -> int:
        """POST/PATCH/DELETE requests so far whose path contains `path_part`."""
        assert self.emulator is not None
        return sum(1 for r in list(self.emulator._requests)
                   if str(r.method) in ("method.POST", "method.PATCH", "method.DELETE",
                                        "POST", "PATCH", "DELETE")
                   and path_part in r.url.path)

    def status_patches(self, name: str, key: str) -> int:
        """PATCHes of LLMService `name`'s status whose body sets status.`key`."""
        assert self.emulator is not None
        return sum(1 for r in list(self.emulator._requests)
                   if r.url.path.endswith(f"/llmservices/{name}/status")
                   and key in ((r.data or {}).get("status") or {}))

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        events = self.items(f"/api/v1/namespaces/{NS}/events")
        return [e for e in events if reason is None or e.get("reason") == reason]


class FakeClock:
    def __init__(self) -> None:
        self._now = time.time()
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class FakeFleet:
    """In-memory FleetStore: loads per replica id; records drains and removals."""

    source = "redis"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loads: dict[str, ReplicaLoad] = {}
        self.draining: list[str] = []
        self.forgotten: list[str] = []
        self.itl_reads: set[str] = set()  # pods whose loads were read with need_itl
        self.read_pods: set[str] = set()  # every pod whose load was asked for

    def set_load(self, replica_id: str, **fields: float) -> None:
        with self._lock:
            self.loads[replica_id] = ReplicaLoad(replica_id=replica_id, **fields)

    def drop(self, replica_id: str) -> None:
        with self._lock:
            self.loads.pop(replica_id, None)

    def is_draining(self, replica_id: str) -> bool:
        with self._lock:
            return replica_id in self.draining

    async def read_loads(self, model: str, pods: dict[str, str | None], *,
                         need_itl: bool = False) -> dict[str, ReplicaLoad]:
        with self._lock:
            self.read_pods.update(pods)
            if need_itl:
                self.itl_reads.update(pods)
            return {name: load for name, load in self.loads.items() if name in pods}

    async def mark_draining(self, model: str, replica_id: str) -> None:
        with self._lock:
            self.draining.append(replica_id)

    async def forget_replica(self, model: str, replica_id: str) -> None:
        with self._lock:
            self.forgotten.append(replica_id)


class FakeDeploymentController:
    """Keeps pods in line with a Deployment's replicas, the way a ReplicaSet would."""

    def __init__(self, cluster: Cluster, fleet: FakeFleet, deployment: str,
                 on_new_pod: Callable[[str], None]):
        self.cluster, self.fleet, self.deployment = cluster, fleet, deployment
        self.on_new_pod = on_new_pod
        self.removed: list[dict[str, Any]] = []  # {name, draining, running} at deletion
        self.replica_history: list[int] = []
        self._serial = 0

    def step(self) -> None:
        dep = self.cluster.get(f"{DEPLOYMENTS}/{self.deployment}")
        if dep is None:
            return
        want = dep["spec"]["replicas"]
        if not self.replica_history or self.replica_history[-1] != want:
            self.replica_history.append(want)
        selector = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
        pods = self.cluster.items(PODS, selector)
        while len(pods) < want:
            self._serial += 1
            name = f"{self.deployment}-{self._serial}"
            labels = dep["spec"]["template"]["metadata"]["labels"]
            pods.append(self.cluster.create(PODS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": labels},
                "spec": dep["spec"]["template"]["spec"],
                "status": {"podIP": f"10.0.0.{self._serial}", "phase": "Running"}}))
            self.on_new_pod(name)
        while len(pods) > want:
            def cost(pod: dict[str, Any]) -> int:
                annotations = pod["metadata"].get("annotations") or {}
                return int(annotations.get(DELETION_COST_ANNOTATION, "0"))
            victim = min(pods, key=cost)
            name = victim["metadata"]["name"]
            load = self.fleet.loads.get(name)
            self.removed.append({"name": name, "draining": self.fleet.is_draining(name),
                                 "running": load.running if load else None})
            self.cluster.delete(f"{PODS}/{name}")
            self.fleet.drop(name)
            pods.remove(victim)
        self.cluster.request("PATCH", f"{DEPLOYMENTS}/{self.deployment}/status",
                             {"status": {"replicas": want, "readyReplicas": want}})


class FakeLeaderWorkerSetController:
    """Keeps groups of pods in line with a LeaderWorkerSet: leader `<lws>-<i>`, workers
    `<lws>-<i>-<j>`; scale-in deletes the last groups whole, whatever their load."""

    def __init__(self, cluster: Cluster, fleet: FakeFleet, name: str, on_new_leader: Callable[[str], None]):
        self.cluster, self.fleet, self.name, self.on_new_leader = cluster, fleet, name, on_new_leader
        self.removed: list[dict[str, Any]] = []  # {name, draining, running} of each deleted pod
        self.replica_history: list[int] = []

    def _pod(self, name: str, template: dict[str, Any], group: int) -> None:
        labels = dict(template["metadata"]["labels"], **{"leaderworkerset.sigs.k8s.io/group-index": str(group)})
        self.cluster.create(PODS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                                   "spec": template["spec"], "status": {"phase": "Running", "podIP": "10.1.0.1"}})

    def step(self) -> None:
        lws = self.cluster.get(f"{LWSS}/{self.name}")
        if lws is None:
            return
        want, template = lws["spec"]["replicas"], lws["spec"]["leaderWorkerTemplate"]
        if not self.replica_history or self.replica_history[-1] != want:
            self.replica_history.append(want)
        names = {p["metadata"]["name"] for p in self.cluster.items(PODS)}
        for group in range(want):
            if f"{self.name}-{group}" not in names:
                self._pod(f"{self.name}-{group}", template["leaderTemplate"], group)
                self.on_new_leader(f"{self.name}-{group}")
            for worker in range(1, template["size"]):
                if f"{self.name}-{group}-{worker}" not in names:
                    self._pod(f"{self.name}-{group}-{worker}", template["workerTemplate"], group)
        for name in sorted(names):
            parts = name[len(self.name) + 1:].split("-") if name.startswith(self.name + "-") else []
            if parts and parts[0].isdigit() and int(parts[0]) >= want:
                load = self.fleet.loads.get(name)
                self.removed.append({"name": name, "draining": self.fleet.is_draining(f"{self.name}-{parts[0]}"),
                                     "running": load.running if load else None})
                self.cluster.delete(f"{PODS}/{name}")
                self.fleet.drop(name)
        self.cluster.request("PATCH", f"{LWSS}/{self.name}/status",
                             {"status": {"replicas": want, "readyReplicas": want}})


class Operator:
    """kopf running our registry in a thread. Use as a context manager."""

    def __init__(self, cluster: Cluster, *, fleet: FakeFleet | None = None,
                 clock: FakeClock | None = None, interval: float = 0.1):
        self.memo = kopf.Memo(connection=kopf.ConnectionInfo(server=cluster.url),
                              fleet_store=fleet or FakeFleet(), clock=clock or FakeClock())
        self.interval = interval
        self.settings = kopf.OperatorSettings()
        self.settings.scanning.disabled = True  # serve exactly NS; no namespace/CRD watching
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(kopf.operator(
                registry=make_registry(autoscale_interval=self.interval), standalone=True,
                clusterwide=False, namespaces=[NS], memo=self.memo,
                settings=self.settings, stop_flag=self._stop, ready_flag=self._ready))
        except BaseException as error:  # surfaced by __exit__
            self.error = error

    def __enter__(self) -> "Operator":
        self._thread.start()
        assert self._ready.wait(20), f"operator did not start: {self.error!r}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(20)
        assert not self._thread.is_alive(), "operator did not stop"
