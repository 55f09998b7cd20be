"""``NixlKVConnector``: the KV connector whose bytes move over NIXL (UCX: RDMA, NVLink, shm, TCP).

The TCP connector's control path, unchanged: one TCP connection per transfer carries
PULL / OFFER / ACCEPT / REFUSE / DONE / ERROR (docs/kv_transfer.md), so push and pull, the
hash-chain and layout checks, pinning with a TTL, the in-flight cap and the results of
``poll()`` are the TCP connector's. What differs is the data phase:

- The sender's KV caches are registered with a NIXL agent once (``NixlKVMemory``). Its
  OFFER carries a ``nixl`` section: the agent's name and metadata and where the offered
  (pinned) blocks lie.
- The receiver answers ACCEPT with ``transport: "nixl"``; the sender then sends READY with
  the SHA-256 of each needed block (read while pinned) instead of CHUNKs.
- The receiver's engine thread allocates free blocks; its connection thread READs the
  sender's blocks straight into them (one NIXL READ: no staging buffer, no Python copy),
  checks each digest, and hands them to the engine thread, which enters them in the prefix
  cache and frees them (cached, LRU); DONE then releases the sender's pins.

Either side falls back to the TCP data phase with a peer that does not speak NIXL (an OFFER
without ``nixl``, an ACCEPT without ``transport``), so a fleet can mix backends.
Completion is signalled on the control connection (DONE / ERROR), not by NIXL notifications:
the receiver must check and commit before the sender may unpin.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.nixl_memory import NixlKVMemory
from pagoda.engine.kv_transfer.nixl_receiver import NixlReceiver
from pagoda.engine.kv_transfer.tcp import DEFAULT_TTL_S, TcpKVConnector
from pagoda.engine.kv_transfer.tcp_sender import OutgoingTransfer, TcpSender
from pagoda.engine.kv_transfer.wire import FrameType


class NixlSender(TcpSender):
    """The TCP sender with NIXL's data phase: READY{digests}, then the receiver reads."""

    def _send_blocks(self, t: OutgoingTransfer, need: list[int], accept: dict) -> bool:
        if accept.get("transport") != "nixl" or t.offer.nixl is None:
            return super()._send_blocks(t, need, accept)
        digests = []
        for index in need:
            with t.lock:  # read only while pinned (see tcp_sender's invariants)
                if t.cancelled:
                    return False
                data = self.read_block(t.blocks[index].block_id)
            digests.append(hashlib.sha256(data).hexdigest())
            t.num_bytes_sent += len(data)
        wire.send_json(t.sock, FrameType.READY, {"digests": digests})
        t.num_blocks_sent = len(need)  # offered to the receiver's READ; DONE confirms it
        return True


class NixlKVConnector(TcpKVConnector):
    """Args: those of ``TcpKVConnector``.
    Raises:
        ValueError: nixl is not usable here (the message says why), or as ``TcpKVConnector``.
    """

    sender_class = NixlSender
    receiver_class = NixlReceiver
    carries_states = False  # its READs address the registered paged KV memory only

    def __init__(self, engine, listen: Optional[str] = None, ttl_s: float = DEFAULT_TTL_S, **kwargs) -> None:
        self.memory = NixlKVMemory(engine.runner.kv_tensors)
        try:
            super().__init__(engine, listen=listen, ttl_s=ttl_s, **kwargs)
        except BaseException:
            self.memory.close()
            raise

    def _receiver_options(self) -> dict:
        return {"memory": self.memory, "read_block": self.block_io.read_block}

    def _make_offer(self, transfer_id, block_hashes, parent_block_hash, cache_salt, adapter_id):
        offer, blocks = super()._make_offer(transfer_id, block_hashes, parent_block_hash, cache_salt, adapter_id)
        return dataclasses.replace(offer, nixl=self.memory.describe([b.block_id for b in blocks])), blocks

    @property
    def num_quarantined_blocks(self) -> int:
        """Blocks kept out of the pool because a READ into them could not be released (0 normally)."""
        return self.receiver.num_quarantined_blocks if self.receiver is not None else 0

    def close(self) -> None:
        super().close()
        self.memory.close()
