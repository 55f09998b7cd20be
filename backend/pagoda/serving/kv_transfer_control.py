"""Disaggregated prefill and decode on a replica: vLLM's ``kv_transfer_params`` request option.

A client (or a router) drives the two stages itself, as vLLM's disaggregation proxy does
with the same option names (``sampling_parameters`` key or request parameter
``kv_transfer_params``, a JSON object):

1. **Prefill** replica: ``{"do_remote_decode": true}``. The request runs as usual (send
   ``max_tokens: 1``); its final response carries the ``kv_transfer_params`` output, the KV
   handle: ``{"do_remote_prefill": true, "remote_host", "remote_port",
   "remote_block_count"}`` (the replica's KV connector, ``engine.kv_transfer``, and how
   many full prompt blocks it holds).
2. **Decode** replica: the same prompt and sampling parameters, with that handle as its
   ``kv_transfer_params``. Before the request enters the engine the replica pulls the
   prompt's full blocks it lacks from the peer (``KVConnector.pull``, named by their block
   hashes: same model, block size, cache salt and adapter give the same hashes on both
   replicas) into its prefix cache; then the request is added and hits them, computing
   only the last partial block and sampling the first token itself. Greedy and seeded
   outputs are those of one replica (the sampler's randomness is per request and
   position). A pull that fails (peer gone, integrity check, TTL) is logged and the
   request computes its prompt itself: the same output, later.

Life cycle of a parked request (owned here, read by the loop): ``start_pull`` parks it
under its transfer id; ``poll`` (the loop's thread, once per iteration) finishes transfers
and returns the requests ready to add; an abort takes it back (``take``); a stop takes all.
The prefill side holds nothing for the pull: the prompt's blocks stay in its prefix cache
(LRU) after the request ends and are pinned only while a pull reads them, so a handle used
after heavy traffic evicted them pulls fewer blocks (the decode side computes the rest).

Image prompts are refused (``check``, a 400 naming ``kv_transfer_params``): the blocks that
overlap an image are hashed with its content hash (``contracts.block_hash``'s ``mm`` keys), and
neither the pull (which names blocks by hashes of the prompt's text) nor an offer (which the
receiver verifies by rehashing token ids, ``engine.kv_transfer.offer``) carries those keys yet.
The router runs an image request in one stage and never with a peer pull.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any, Optional

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.contracts.request_options import check_kv_transfer_params

logger = logging.getLogger(__name__)

class KVTransferControl:
    """The serving loop's KV transfers (module docstring). ``connector`` is a listening
    ``KVConnector`` made from the loop's engine, or ``None`` (requests asking for a transfer
    are then refused, naming the flag)."""

    def __init__(self, engine: Any, connector: Any = None, advertise_host: Optional[str] = None) -> None:
        self._engine = engine
        self._connector = connector
        self._parked: dict[str, Any] = {}  # transfer id -> ServingRequest
        self.num_pulled_blocks = 0  # blocks entered in the prefix cache by pulls (all requests)
        self.num_failed_pulls = 0
        self._advertise_host = advertise_host or os.environ.get("PAGODA_ADVERTISE_HOST")

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def check(self, params: Optional[dict[str, Any]], has_images: bool = False) -> None:
        """Refuse a transfer this replica cannot do (no connector, an image prompt: module
        docstring). Raises ValueError."""
        if params and has_images and (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            raise ValueError("kv_transfer_params: prompts with images do not take part in KV transfers yet (the "
                             "blocks overlapping an image are keyed by its content, which transfers do not carry); "
                             "send the request without kv_transfer_params")
        if params and (params.get("do_remote_decode") or params.get("do_remote_prefill")) and self._connector is None:
            raise ValueError("kv_transfer_params: this replica has no KV connector (start it with pagoda serve "
                             "--kv-transfer-listen HOST:PORT)")

    def start_pull(self, request: Any, token_ids: list[int]) -> bool:
        """Park ``request`` until its prompt's blocks arrived from the peer its handle names.
        Returns False (nothing parked) when the prompt has no full block to pull."""
        options = request.wire.options
        params = options.kv_transfer_params
        hashes = hash_prompt_blocks(token_ids, self._engine.config.block_size, self._engine.model_id,
                                    options.cache_salt, options.lora_name)
        if not hashes:
            return False
        peer = f"{params['remote_host']}:{params['remote_port']}"
        transfer_id = self._connector.pull(peer, hashes, cache_salt=options.cache_salt, adapter_id=options.lora_name)
        self._parked[transfer_id] = request
        return True

    def poll(self) -> list[Any]:
        """The loop's thread: finish transfers; the parked requests now ready to add."""
        if self._connector is None:
            return []
        ready = []
        for result in self._connector.poll():
            request = self._parked.pop(result.transfer_id, None)
            if request is None:
                continue
            self.num_pulled_blocks += result.num_blocks if result.ok else 0
            self.num_failed_pulls += 0 if result.ok else 1
            if not result.ok:
                logger.warning("KV pull for %s failed (%s); computing its prompt here", request.request_id,
                               result.error)
            ready.append(request)
        return ready

    def take(self, request_id: str) -> Optional[Any]:
        """A parked request, removed (its abort); None when it is not parked."""
        for transfer_id, request in list(self._parked.items()):
            if request.request_id == request_id:
                return self._parked.pop(transfer_id)
        return None

    def take_all(self) -> list[Any]:
        requests, self._parked = list(self._parked.values()), {}
        return requests

    def handle(self, num_prompt_tokens: int) -> str:
        """The prefill side's KV handle (the ``kv_transfer_params`` output), JSON."""
        host, _, port = self._connector.address.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = self._advertise_host or socket.gethostname()
        return json.dumps({"do_remote_prefill": True, "remote_host": host, "remote_port": int(port),
                           "remote_block_count": num_prompt_tokens // self._engine.config.block_size})

    def close(self) -> None:
        if self._connector is not None:
            self._connector.close()
