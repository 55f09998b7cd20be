"""Disaggregated prefill/decode on the router's Triton HTTP generate door (``http_api._route``).

The same two stages as the gRPC and OpenAI doors (``api.upstream``, docs/kv_transfer.md),
over HTTP: when the routable replicas include a ``prefill`` and a ``decode`` role and the
body carries no ``kv_transfer_params`` of its own, a copy of the body goes to a prefill
replica's ``generate`` (``max_tokens`` 1, ``min_tokens`` 0, ``kv_transfer_params``
``{"do_remote_decode": true}`` in ``sampling_parameters``; the top-level inputs that would
override them dropped), and its answer's ``kv_transfer_params`` output, the KV handle, goes
into the body's own ``sampling_parameters`` before the body is routed, among the other
replicas, as usual (streaming or not). A first stage that fails is logged and the request
runs whole on a decode replica: the same answer, later.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import aiohttp

from pagoda.fleet.gate.limits import LimitError, sampling_object
from pagoda.fleet.routing.router import NoReplicaAvailable

logger = logging.getLogger(__name__)

# Top-level generate inputs the prefill stage's sampling_parameters must rule over.
_STAGE_OVERRIDES = ("max_tokens", "min_tokens", "min_length", "stream")


def _sampling(document: dict[str, Any]) -> Optional[dict]:
    """The body's ``sampling_parameters`` object (``limits.sampling_object``), or None when it
    is not valid JSON (the replica names that; the body is not staged)."""
    try:
        return sampling_object(document.get("sampling_parameters"))
    except LimitError:
        return None


def is_disaggregated(router: Any, document: dict[str, Any]) -> bool:
    """Prefill and decode replicas routable, and a body that does not drive the stages itself."""
    roles = {r.role for r in router.replicas.routable()}
    sampling = _sampling(document)
    return "prefill" in roles and "decode" in roles and sampling is not None and "kv_transfer_params" not in sampling


def with_sampling(document: dict[str, Any], **values: Any) -> dict[str, Any]:
    """A copy of ``document`` with ``values`` set in its ``sampling_parameters`` JSON."""
    return {**document, "sampling_parameters": json.dumps({**(_sampling(document) or {}), **values})}


async def prefill_handle(session: aiohttp.ClientSession, router: Any, gate: Any, analysis: Any,
                         document: dict[str, Any], model: str) -> Optional[dict]:
    """Run the first stage on a prefill replica; its KV handle, or None (logged)."""
    first = with_sampling({k: v for k, v in document.items() if k not in _STAGE_OVERRIDES}, max_tokens=1,
                          min_tokens=0, kv_transfer_params={"do_remote_decode": True})
    skip = [r.replica_id for r in router.replicas.all() if r.role != "prefill"]
    try:
        decision = await gate.choose(router, analysis, skip, 1)
    except NoReplicaAvailable as exc:
        logger.warning("prefill stage: %s; the decode replica computes the prompt", exc)
        return None
    url = f"http://{decision.replica.endpoints['http']}/v2/models/{model}/generate"
    try:
        async with session.post(url, json=first) as response:
            answer = await response.json(content_type=None)
        if response.status != 200 or not isinstance(answer, dict) or not answer.get("kv_transfer_params"):
            logger.warning("prefill stage on %s gave no KV handle (%s): the decode replica computes the prompt",
                           decision.replica.replica_id, response.status)
            return None
        handle = answer["kv_transfer_params"]
        return json.loads(handle) if isinstance(handle, str) else handle
    except (aiohttp.ClientError, ValueError, TimeoutError) as exc:
        logger.warning("prefill stage on %s failed (%s); the decode replica computes the prompt",
                       decision.replica.replica_id, exc)
        return None
    finally:
        router.release(decision)
