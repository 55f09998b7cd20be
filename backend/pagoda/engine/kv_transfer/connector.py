"""The ``KVConnector`` seam: move KV blocks, named by their block hashes, between replicas.

A connector has a sending side and a receiving side, both driven by the engine's thread
through ``poll()``; the bytes move on the connector's own threads. Life cycle of a send:

1. ``send(peer, block_hashes)`` (engine thread) looks the hashes up in the block pool,
   *pins* the leading run that is cached (one reference each, so they are neither
   evicted nor reused) and returns a transfer id at once.
2. The connector's thread offers the blocks, the receiver answers which it lacks, and
   only those are sent.
3. ``poll()`` (engine thread) unpins the blocks of every transfer that the receiver has
   confirmed, that failed, or whose TTL has passed, and returns one ``TransferResult``
   per finished transfer. No pinned block outlives its TTL.

Pulling: ``pull(peer, block_hashes)`` asks a peer for the blocks; the peer's ``poll()``
answers exactly as if it had called ``send`` (pins, TTL), over the connection the puller
opened. Receiving: incoming blocks are buffered on the connector's thread (bounded by
``max_inflight_bytes``) and checked; ``poll()`` writes them into free blocks and enters
them in the prefix cache under the same hashes (so the next request with that prefix is
a hit and the KV-event publisher tells the global index), then confirms to the sender.

Implementations, chosen by name through ``registry.make_kv_connector``: ``tcp.TcpKVConnector``
and ``nixl.NixlKVConnector`` (the same control path, the bytes read over NIXL); a
shared-memory connector would implement the same members. This module is pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from pagoda.contracts.block_hash import BlockHash


@dataclass(frozen=True)
class TransferResult:
    """One finished transfer, as ``poll()`` reports it on either side.

    ``num_blocks``: blocks sent (sender) or entered in the prefix cache (receiver);
    ``num_bytes``: payload bytes moved; ``error``: None on success, else why it failed.
    """

    transfer_id: str
    direction: str  # "send" | "receive"
    num_blocks: int
    num_bytes: int
    elapsed_s: float
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class KVConnector(Protocol):
    def send(self, peer: str, block_hashes: Sequence[BlockHash], *, transfer_id: Optional[str] = None,
             parent_block_hash: Optional[BlockHash] = None, cache_salt: Optional[str] = None,
             adapter_id: Optional[str] = None) -> str:
        """Start sending the cached run of ``block_hashes`` to ``peer``; returns the transfer id."""

    def pull(self, peer: str, block_hashes: Sequence[BlockHash], *, transfer_id: Optional[str] = None,
             parent_block_hash: Optional[BlockHash] = None, cache_salt: Optional[str] = None,
             adapter_id: Optional[str] = None) -> str:
        """Ask ``peer`` to send the cached run of ``block_hashes`` it holds here; the transfer id."""

    def poll(self) -> list[TransferResult]:
        """Engine thread: finish transfers (commit received blocks, unpin sent ones)."""

    @property
    def address(self) -> Optional[str]:
        """Where peers send to (``host:port``), or None for a send-only connector."""

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` from the connector's threads whenever ``poll()`` has work."""

    def close(self) -> None:
        """Stop and join every thread; unpin what is still held. Idempotent."""


def check_layout(layout, carries_states: bool = False) -> None:
    """Refuse a KV cache layout (``engine.kv.layout``) the connector cannot serve hits for.

    A connector names blocks by hash and moves group 0's blocks, and the receiver enters them
    as group 0's; a hit needs every group's. A recurrent-state group's part is the checkpoint
    at the run's last block boundary, which a connector with ``carries_states`` (TCP) moves
    beside the blocks (``offer.Offer.has_state``); a sliding-window group's part is its
    window's blocks, which no connector tracks, so such layouts are refused (the uniform
    layout keeps every block in one table and is served). Raises ValueError naming the
    groups, why, and what to do.
    """
    if layout is None or layout.num_groups == 1:
        return
    if len(layout.paged_groups) == 1 and layout.state_group is not None and carries_states:
        return
    kinds = ", ".join(sorted({g.spec.kind for g in layout.groups}))
    if len(layout.paged_groups) == 1:
        remedy = ("this connector moves no recurrent-state checkpoint (its reads address paged blocks only); "
                  "a recurrent-state model can use KV transfer over the TCP connector")
    else:
        remedy = ("a sliding-window group's hit needs its window's blocks, which no connector tracks; "
                  "serve it with kv_cache_layout='uniform' (one block table; sliding-window blocks are kept)")
    raise ValueError(f"KV transfer: the model's KV cache has {layout.num_groups} groups ({kinds}) and a connector "
                     f"moves group 0's blocks, named by hash; {remedy}")


def parse_peer(peer: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises ValueError naming a bad address."""
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV transfer peer must be 'host:port', got {peer!r}")
    return host.strip("[]"), int(port)
