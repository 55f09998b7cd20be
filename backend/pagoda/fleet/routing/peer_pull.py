"""Peer prefix pull: the replica the router chose pulls a prompt prefix a peer holds.

The router's policy weighs prefix affinity against load, so a request can land on a replica
that lacks a long prefix another replica holds (the holder is busy, or the policy is
load-only). When both replicas run a KV connector (``pagoda serve --kv-transfer-listen``,
advertised as the heartbeat's ``kv`` endpoint or ``kv=`` in ``--replicas``), the router
can send the request with the holder as its ``kv_transfer_params`` (the decode stage's
handle, docs/kv_transfer.md): the chosen replica pulls the prompt's full blocks it lacks
from the holder before the request enters its engine, and computes only the rest.

It does so when moving the blocks is estimated faster than computing them, as the fleet
simulator estimates both (``routing.cost_model``): ``TransferModel`` (latency + blocks x block bytes / bandwidth;
measured by ``pagoda bench kv-transfer``) against ``StepTimeModel`` (one prefill step of
those tokens; ``pagoda bench routing --calibrate``), and only for at least ``min_blocks``
blocks (a pull has fixed costs on both replicas that the models leave out). A pull that
fails costs only time: the replica computes the prompt itself (``kv_transfer_control``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagoda.fleet.routing.cost_model import DEFAULT_STEP_MODEL, StepTimeModel, TransferModel


@dataclass
class PeerPull:
    """The router's pull-or-recompute decision. ``enabled`` False: never pull."""

    step_model: StepTimeModel = DEFAULT_STEP_MODEL
    transfer: TransferModel = field(default_factory=TransferModel)
    min_blocks: int = 4
    enabled: bool = True

    def worth_it(self, num_blocks: int, block_size: int) -> bool:
        """Whether pulling ``num_blocks`` beats recomputing their tokens."""
        if num_blocks < self.min_blocks:
            return False
        tokens = num_blocks * block_size
        return self.transfer.seconds(num_blocks) < self.step_model.step_time(tokens, tokens)

    def params(self, decision: Any, replicas: Any, block_size: int) -> Optional[dict]:
        """``kv_transfer_params`` for ``decision.replica`` to pull ``decision.peer``'s blocks,
        or None (no better holder, a replica without a connector, or not worth it)."""
        if not self.enabled or decision.peer is None or not decision.replica.kv_address:
            return None
        peer = replicas.get(decision.peer)
        if peer is None or not peer.healthy or not peer.kv_address:
            return None
        if not self.worth_it(decision.peer_blocks - decision.matched_blocks, block_size):
            return None
        host, _, port = peer.kv_address.rpartition(":")
        return {"do_remote_prefill": True, "remote_host": host, "remote_port": int(port),
                "remote_block_count": decision.peer_blocks}
