"""The router's LoRA adapters: which it serves, and loading/unloading them on every replica.

The router serves an adapter name (OpenAI ``model``, listed by ``/v1/models``, hashed
into the prompt's block hashes) when it was given with ``--lora NAME``, learned from a
replica, or loaded at run time through the router. It assumes its replicas serve the
same adapters (as the operator deploys them).

Run-time loading (``pagoda router --allow-runtime-lora``; vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, or a Triton control request
on the HTTP door): the router sends the replica control request (``lora_action``, see
``serving/dialects/pagoda.py``) to every routable replica (healthy, not draining) at once,
over their HTTP generate endpoint. All or nothing:

- ``load`` succeeds when every replica loaded it; then the name is served and remembered
  with its path for replay. If some failed, it is unloaded again on those that loaded it
  (rolled back) and the answer names each failed replica with its reason, and any
  replica where the rollback failed too.
- ``unload`` succeeds when no replica still has it (a replica that says it does not know
  the adapter counts as done); then the name is no longer served. If some refused (e.g.
  requests use it), it is loaded again, from the path each reported, on those that
  unloaded it, and the answer names the refusals.

Rejoin (``sync``): when the health prober sees a replica ready that was not (a restart,
a new member), the router lists its adapters (names it did not serve are learned, so
``--lora`` on the router is optional) and loads the adapters loaded at run time that it
lacks (replay), before the replica is routable again. A replay that fails keeps the
replica unhealthy, with the reason, until a later probe succeeds; a list that fails only
matters when there is something to replay.

Limits: replicas join membership routable, so requests may reach a brand-new replica up
to one health interval before its replay; the router does not notice adapters unloaded
on a replica directly (not through the router); learned adapters have no known path
unless the replica reports it, and start-up (``--lora``) or learned adapters are not
replayed (the replica gets those from its own flags).

Invariant: ``runtime`` is a subset of ``served``; load, unload and sync run one at a time
(one lock), so a replay never races a load of the same name.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import aiohttp

from pagoda.contracts.request_options import check_adapter_name
from pagoda.serving.launch.lora_cli import control_body

logger = logging.getLogger(__name__)

MODEL_NAME = "pagoda"
CONTROL_TIMEOUT_S = 300.0  # reading a large adapter from a slow disk


def check_change(tenant: Any, name: Any) -> Optional[tuple[str, str]]:
    """Whether ``tenant`` may load or unload adapter ``name``: ``None``, or ``(kind, message)``
    with kind ``"forbidden"`` (a keyed router and a key without the ``admin`` option; open
    mode has no keys to tell callers apart) or ``"invalid"`` (a name that is not 1-128 of
    letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit)."""
    if tenant is not None and not getattr(tenant, "is_admin", False):
        return "forbidden", ("loading and unloading LoRA adapters needs an admin key (the keys file's 'admin' "
                             "option); this key's tenant may only use the served adapters")
    try:
        check_adapter_name(name)
    except ValueError as exc:
        return "invalid", str(exc)
    return None


@dataclass
class ControlResult:
    """What one replica answered a control request: its JSON document, or an error."""

    replica_id: str
    document: Optional[dict] = None
    error: Optional[str] = None
    is_client_error: bool = True  # the replica refused it (4xx), vs unreachable / 5xx

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class AdminAnswer:
    """The router's answer to a load/unload: HTTP status and a document or an error message."""

    status: int
    document: dict = field(default_factory=dict)
    error: Optional[str] = None


class LoRAAdmin:
    """Served adapter names and run-time load/unload across replicas (module docstring).

    Args:
        lora_names: adapters given with ``--lora`` (served, not replayed).
        allow_runtime: accept load/unload (``--allow-runtime-lora``).
        base_model_names: names an adapter may not take (the served model, ``pagoda``).
        timeout_s: how long one replica may take to answer a control request.
    """

    def __init__(self, lora_names: Iterable[str] = (), allow_runtime: bool = False,
                 base_model_names: Iterable[str] = (), timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        self.served: dict[str, Optional[str]] = {name: None for name in lora_names}  # name -> path if known
        self.runtime: dict[str, str] = {}  # loaded through the router: replayed on rejoin
        self.allow_runtime = allow_runtime
        self.base_model_names = tuple(base_model_names)
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.served))

    def list_document(self) -> dict:
        return {"action": "list", "loaded": list(self.names()), "paths": dict(sorted(self.served.items())),
                "allow_runtime_lora": self.allow_runtime}

    # ---------------------------------------------------------------- load / unload
    async def load(self, replicas: list[Any], name: str, path: str) -> AdminAnswer:
        """Load ``name`` from ``path`` on every replica, or on none (rolled back)."""
        if name in self.base_model_names:
            return AdminAnswer(400, error=f"lora_name: {name!r} is the base model's name; pick another")
        async with self._lock:
            if name in self.served:
                return AdminAnswer(400, error=f"lora_name: an adapter named {name!r} is already loaded; "
                                              "unload it first")
            if not replicas:
                return AdminAnswer(503, error="no replica is routable: nothing to load the adapter on")
            results = await self._send_all(replicas, control_body("load", name, path))
            done = [r for r, result in zip(replicas, results) if result.ok]
            if len(done) == len(replicas):
                self.served[name] = path
                self.runtime[name] = path
                logger.info("LoRA adapter %r loaded from %s on %d replicas", name, path, len(done))
                return AdminAnswer(200, {"action": "load", "lora_name": name, "lora_path": path,
                                         "replicas": [r.replica_id for r in replicas]})
            undo = await self._send_all(done, control_body("unload", name))
            return _failure(f"loading LoRA adapter {name!r}", results, done, undo, "unloaded again")

    async def unload(self, replicas: list[Any], name: str) -> AdminAnswer:
        """Unload ``name`` from every replica, or from none (loaded again where it was unloaded)."""
        async with self._lock:
            if not replicas:
                return AdminAnswer(503, error="no replica is routable: nothing to unload the adapter from")
            results = await self._send_all(replicas, control_body("unload", name))
            for result in results:  # "not loaded here" is what we want
                if not result.ok and "unknown adapter" in result.error:
                    result.error, result.document = None, {}
            done = [r for r, result in zip(replicas, results) if result.ok and result.document]
            if all(result.ok for result in results):
                if not done and name not in self.served:
                    return AdminAnswer(404, error=f"lora_name: no adapter named {name!r} is loaded; loaded "
                                                  f"adapters: {', '.join(self.names()) or 'none'}")
                self.served.pop(name, None)
                self.runtime.pop(name, None)
                logger.info("LoRA adapter %r unloaded from %d replicas", name, len(replicas))
                return AdminAnswer(200, {"action": "unload", "lora_name": name,
                                         "replicas": [r.replica_id for r in replicas]})
            paths = {r.replica_id: result.document.get("lora_path") for r, result in zip(replicas, results)
                     if result.ok and result.document}
            undo = [await self._send(r, control_body("load", name, paths[r.replica_id])) for r in done]
            return _failure(f"unloading LoRA adapter {name!r}", results, done, undo, "loaded again")

    # ---------------------------------------------------------------- rejoin
    async def sync(self, replica: Any) -> Optional[str]:
        """Learn a (re)joining replica's adapters and replay the run-time ones it lacks.

        Returns:
            ``None`` when the replica may be routed to, else why not (a failed replay).
        """
        async with self._lock:
            listed = await self._send(replica, control_body("list"))
            if not listed.ok and not self.runtime:
                logger.warning("cannot list the LoRA adapters of replica %s: %s", replica.replica_id, listed.error)
                return None
            if not listed.ok:
                return f"LoRA replay: listing its adapters failed: {listed.error}"
            loaded = set(listed.document.get("loaded") or ())
            paths = listed.document.get("paths") or {}
            for name in sorted(loaded - set(self.served)):
                self.served[name] = paths.get(name)
                logger.info("LoRA adapter %r learned from replica %s", name, replica.replica_id)
            for name, path in sorted(self.runtime.items()):
                if name in loaded:
                    continue
                result = await self._send(replica, control_body("load", name, path))
                if not result.ok:
                    return f"LoRA replay of {name!r} failed: {result.error}"
                logger.info("LoRA adapter %r replayed on replica %s", name, replica.replica_id)
            return None

    # ---------------------------------------------------------------- transport
    async def _send_all(self, replicas: list[Any], body: dict) -> list[ControlResult]:
        return list(await asyncio.gather(*(self._send(r, body) for r in replicas)))

    async def _send(self, replica: Any, body: dict) -> ControlResult:
        """POST one control request to a replica's generate endpoint."""
        url = f"http://{replica.endpoints['http']}/v2/models/{MODEL_NAME}/generate"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
                async with session.post(url, json=body) as response:
                    data = await response.read()
                    status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return ControlResult(replica.replica_id, error=f"unreachable: {type(exc).__name__}: {exc}",
                                 is_client_error=False)
        text = data.decode("utf-8", "replace")
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if status != 200:
            message = answer.get("error", text) if isinstance(answer, dict) else text
            return ControlResult(replica.replica_id, error=str(message).strip() or f"HTTP {status}",
                                 is_client_error=400 <= status < 500)
        output = answer.get("text_output") if isinstance(answer, dict) else None
        try:
            return ControlResult(replica.replica_id, document=json.loads(output[0] if isinstance(output, list)
                                                                          else output))
        except (TypeError, ValueError, IndexError):
            return ControlResult(replica.replica_id, error=f"not a LoRA control answer: {text[:200]}",
                                 is_client_error=False)


def _failure(what: str, results: list[ControlResult], done: list[Any], undo: list[ControlResult],
             undone: str) -> AdminAnswer:
    """The answer when some replicas failed: each failure, and what was rolled back."""
    failed = [r for r in results if not r.ok]
    message = (f"{what} failed on {len(failed)} of {len(results)} replicas: "
               + "; ".join(f"{r.replica_id}: {r.error}" for r in failed) + ".")
    if done:
        message += f" It was {undone} on {', '.join(r.replica_id for r in done)}."
    bad_undo = [r for r in undo if not r.ok]
    if bad_undo:
        message += (" The rollback failed on " + "; ".join(f"{r.replica_id}: {r.error}" for r in bad_undo)
                    + ": the replicas now differ; retry, or fix them with `pagoda lora` on each.")
    status = 400 if all(r.is_client_error for r in failed) else 502
    return AdminAnswer(status, error=message)
