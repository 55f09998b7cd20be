"""A kmock KubernetesEmulator that behaves enough like an API server for kopf.

kmock 0.8 gaps this subclass fills (see shared ENVIRONMENT.md):
- metadata.resourceVersion / uid / generation / creationTimestamp are maintained
  (kopf waits for the resourceVersion its own patch produced);
- PATCH honours the content type: JSON patch (RFC 6902, a failed `test` answers 422, as
  the API server does) or JSON merge patch (RFC 7386);
- the status subresource: `/status` writes only status, main writes never touch status;
- watches subscribe before taking their snapshot (no lost events), and a watch with
  `?resourceVersion=N` replays logged events after N instead of a snapshot;
- lists and watches honour equality-based `labelSelector`.
Objects remain in `kmock.objects` for assertions.
"""

from __future__ import annotations

import copy
import datetime as dt
import uuid
from typing import Any

import aiohttp.web
import jsonpatch
import kmock

STATUS_SUBRESOURCE_PLURALS = {"llmservices", "deployments", "pods", "leaderworkersets"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _matches(labels: dict[str, str], selector: str | None) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def _error(status: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {},
                                      "status": "Failure", "code": status, "reason": reason,
                                      "message": message}, status=status)


class PagodaKubeEmulator(kmock.KubernetesEmulator):
    """See the module docstring."""

    def _state(self) -> dict[str, Any]:
        if not hasattr(self, "_pagoda_state"):
            object.__setattr__(self, "_pagoda_state", {"rv": 0, "log": []})
        return self._pagoda_state  # type: ignore[attr-defined]

    def _next_rv(self) -> str:
        state = self._state()
        state["rv"] += 1
        return str(state["rv"])

    async def _emit(self, resource: Any, event_type: str, raw: dict[str, Any]) -> None:
        event = {"type": event_type, "object": copy.deepcopy(raw)}
        self._state()["log"].append((int(raw["metadata"]["resourceVersion"]), resource, event))
        await self._buses[resource].put(event)

    def _live(self, key: Any) -> dict[str, Any] | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def _store(self, key: Any, raw: dict[str, Any]) -> None:
        if key not in self._objects:
            self._objects[key] = raw
        else:
            self._objects[key].history.append(kmock.ObjectVersion(raw))

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.action not in (
                kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE):
            return await super()._handle(request)
        async with self._lock:
            if request.action == kmock.action.CREATE:
                return await self._create(request)
            if request.action == kmock.action.UPDATE:
                return await self._patch(request)
            return await self._delete(request)

    async def _create(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw = copy.deepcopy(request.data or {})
        meta = raw.setdefault("metadata", {})
        meta["namespace"] = request.namespace or meta.get("namespace")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (request.resource, meta["namespace"], meta["name"])
        if self._live(key) is not None:
            return _error(409, "AlreadyExists", f"{meta['name']} already exists")
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), generation=1,
                    creationTimestamp=dt.datetime.now(dt.timezone.utc)
                    .isoformat(timespec="seconds").replace("+00:00", "Z"))
        self._store(key, raw)
        await self._emit(request.resource, "ADDED", raw)
        return aiohttp.web.json_response(raw, status=201)

    async def _patch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        old = self._live(key)
        if old is None:
            return _error(404, "NotFound", f"{request.name} not found")
        content_type = request.headers.get("Content-Type", "")
        if "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(old, request.data)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as error:
                return _error(422, "Invalid", str(error))
        else:
            new = merge_patch(old, request.data or {})
        has_status = request.resource.plural in STATUS_SUBRESOURCE_PLURALS
        if request.subresource == "status":
            new = {**old, "status": new.get("status", {})}
        elif has_status:
            new["status"] = old.get("status", {})
            if not new["status"]:
                new.pop("status")
        meta = new.setdefault("metadata", {})
        for frozen in ("uid", "creationTimestamp", "namespace", "name"):
            if frozen in old["metadata"]:
                meta[frozen] = old["metadata"][frozen]
        meta["generation"] = old["metadata"].get("generation", 1)
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
                {k: v for k, v in old.items() if k not in ("metadata", "status")}:
            meta["generation"] += 1
        meta["resourceVersion"] = self._next_rv()
        self._store(key, new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._objects[key].delete()
            await self._emit(request.resource, "DELETED", new)
        else:
            await self._emit(request.resource, "MODIFIED", new)
        return aiohttp.web.json_response(new)

    async def _delete(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        old = self._live(key)
        if old is None:
            return _error(404, "NotFound", f"{request.name} not found")
        meta = old["metadata"]
        meta["resourceVersion"] = self._next_rv()
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = dt.datetime.now(dt.timezone.utc) \
                    .isoformat(timespec="seconds").replace("+00:00", "Z")
                self._store(key, old)
                await self._emit(request.resource, "MODIFIED", old)
            return aiohttp.web.json_response(old)
        self._objects[key].delete()
        await self._emit(request.resource, "DELETED", old)
        return aiohttp.web.json_response(old)

    def _visible(self, request: kmock.Request) -> list[dict[str, Any]]:
        selector = request.params.get("labelSelector")
        result = []
        for (resource, namespace, name), obj in self._objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if request.name is not None and name != request.name:
                continue
            raw = obj.raw
            if _matches(raw.get("metadata", {}).get("labels") or {}, selector):
                result.append(copy.deepcopy(raw))
        return result

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        async with self._lock:
            return {"apiVersion": "v1", "kind": "List",
                    "metadata": {"resourceVersion": str(self._state()["rv"])},
                    "items": self._visible(request)}

    async def _serve_watch(self, request: kmock.Request):
        yield b""
        selector = request.params.get("labelSelector")
        since = request.params.get("resourceVersion")
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            if since and since.isdigit():
                backlog = [event for rv, resource, event in self._state()["log"]
                           if rv > int(since) and resource == request.resource]
            else:
                backlog = [{"type": "ADDED", "object": raw} for raw in self._visible(request)]
        try:
            for event in backlog:
                if self._wanted(request, event, selector):
                    yield event
            async for event in bus.stream(since=mark):
                if self._wanted(request, event, selector):
                    yield event
        finally:
            await bus.unmark(mark)

    @staticmethod
    def _wanted(request: kmock.Request, event: dict[str, Any], selector: str | None) -> bool:
        meta = event.get("object", {}).get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        return _matches(meta.get("labels") or {}, selector)


