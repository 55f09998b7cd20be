"""A small async Kubernetes API client over aiohttp (kopf's own HTTP stack).

Only what the operator needs: get / create / merge-patch / delete / list by label
selector, and `apply`, which makes an object match a rendered one idempotently: create
it if absent, merge-patch it if the rendered fields differ from the live ones, and do
nothing otherwise (so a resumed operator issues no writes for an up-to-date cluster).

Credentials come from a `kopf.ConnectionInfo` (the same one kopf's login produced), so
the operator and kopf talk to the same API server with the same identity. A
service-account token file is re-read on every request: kubelet rotates it.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from typing import Any

import aiohttp

PLURALS = {
    "Deployment": "deployments", "Service": "services", "ServiceAccount": "serviceaccounts",
    "Role": "roles", "RoleBinding": "rolebindings", "Pod": "pods", "Secret": "secrets",
    "ConfigMap": "configmaps", "InferenceService": "inferenceservices",
    "LLMInferenceService": "llminferenceservices",
    "LLMService": "llmservices", "NetworkPolicy": "networkpolicies",
    "PodDisruptionBudget": "poddisruptionbudgets", "LeaderWorkerSet": "leaderworkersets",
}
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class KubeError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None,
                  subresource: str | None = None) -> str:
    """URL path of a namespaced object (or of its collection when `name` is None)."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def is_subset(wanted: Any, live: Any) -> bool:
    """True if every field of `wanted` is present with the same value in `live`.
    Lists must match element-wise (merge-patch replaces lists wholesale)."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(
            key in live and is_subset(value, live[key]) for key, value in wanted.items())
    if isinstance(wanted, list):
        return (isinstance(live, list) and len(wanted) == len(live)
                and all(is_subset(w, x) for w, x in zip(wanted, live)))
    return wanted == live


def _ssl_context(info: Any) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    if not info.server.startswith("https"):
        return True
    context = ssl.create_default_context(
        cafile=str(info.ca_path) if info.ca_path else None,
        cadata=_decode(info.ca_data).decode() if info.ca_data else None)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        cert = _spill(_decode(info.certificate_data))
        key = _spill(_decode(info.private_key_data))
    if cert and key:
        context.load_cert_chain(str(cert), str(key))
    return context


def _decode(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


def _spill(data: bytes) -> str:
    handle = tempfile.NamedTemporaryFile(prefix="pagoda-kube-", delete=False)
    handle.write(data)
    handle.close()
    return handle.name


class KubeClient:
    """One aiohttp session against one API server. Close with `await client.close()`."""

    def __init__(self, info: Any, *, token_path: str | None = None):
        self.server = info.server.rstrip("/")
        self._token = info.token
        self._token_path = token_path
        self._auth = (aiohttp.BasicAuth(info.username, info.password or "")
                      if info.username else None)
        connector = aiohttp.TCPConnector(ssl=_ssl_context(info))
        self._session = aiohttp.ClientSession(connector=connector, auth=self._auth,
                                              timeout=aiohttp.ClientTimeout(total=30))

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._token
        if self._token_path:
            try:
                with open(self._token_path) as handle:
                    token = handle.read().strip()
            except OSError:
                pass
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(self, method: str, path: str, *, body: Any = None,
                      params: dict[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        if self._session.closed:  # the operator is shutting down
            raise KubeError(503, "the Kubernetes client is closed")
        async with self._session.request(
                method, self.server + path, json=body, params=params,
                headers=self._headers(content_type if body is not None else None)) as response:
            if response.status >= 400:
                raise KubeError(response.status, (await response.text())[:500])
            return await response.json(content_type=None)

    async def get(self, api_version: str, kind: str, namespace: str,
                  name: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", resource_path(api_version, kind, namespace),
                                    params=params)
        return list(result.get("items") or [])

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self.request(
            "POST", resource_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str,
                    patch: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """JSON merge-patch (RFC 7386)."""
        return await self.request(
            "PATCH", resource_path(api_version, kind, namespace, name, subresource),
            body=patch, content_type="application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete (background propagation); False if it was already gone."""
        try:
            await self.request("DELETE", resource_path(api_version, kind, namespace, name),
                               body={"propagationPolicy": "Background"})
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def apply(self, obj: dict[str, Any]) -> str:
        """Make the live object match `obj`'s fields.

        Returns:
            "created", "patched" or "unchanged".
        """
        meta = obj["metadata"]
        live = await self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if live is None:
            await self.create(obj)
            return "created"
        wanted = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
        if is_subset(wanted, live):
            return "unchanged"
        await self.patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], wanted)
        return "patched"

    async def close(self) -> None:
        await self._session.close()
