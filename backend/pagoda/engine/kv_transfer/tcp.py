"""``TcpKVConnector``: the KV connector over TCP, between processes on any machines.

Composes a ``TcpSender`` (pinned blocks, one thread per transfer, a TTL) and, when given
a listen address, a ``TcpReceiver`` (bounded buffers, checked chunks, commits on the
engine thread) over one engine's block pool and KV caches. The wire protocol is
``wire`` + ``offer`` (docs/kv_transfer.md). A hybrid model (full attention + recurrent
states): an offer's run is cut at its last block whose state checkpoint is cached, and that
checkpoint travels as one more payload (``Offer.has_state``), pinned in the state pool
like the blocks; the receiver enters it in its state group. Every method except the constructor's
threads runs on the engine's thread; ``close`` joins every thread.
"""

from __future__ import annotations

import itertools
import queue
import socket
import time
import uuid
from typing import Callable, Optional, Sequence

from pagoda.contracts.block_hash import BlockHash
from pagoda.engine.kv_transfer.block_io import KVBlockIO, KVStateIO
from pagoda.engine.kv_transfer.connector import TransferResult, check_layout, parse_peer
from pagoda.engine.kv_transfer.offer import Offer
from pagoda.engine.kv_transfer.tcp_receiver import TcpReceiver, take_all
from pagoda.engine.kv_transfer.tcp_sender import TcpSender
from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.wire import FrameType

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
DEFAULT_TTL_S = 30.0
_ids = itertools.count()


class TcpKVConnector:
    """Args:
    engine: an ``LLMEngine`` (its scheduler's block pool, its runner's KV caches,
        ``model_id``, ``config.block_size``).
    listen: ``"host:port"`` to receive on (port 0 picks a free one), or None (send only).
    ttl_s: the longest a sent block stays pinned, and a receiver's idle limit.
    max_inflight_bytes: cap on the receiver's buffered bytes.
    chunk_bytes: payload bytes per CHUNK frame.
    clock: monotonic seconds for the senders' TTL (injected in tests).
    Raises:
        ValueError: a bad listen address or a non-positive limit.
    """

    # The two sides; another transport (``nixl.NixlKVConnector``) subclasses them.
    sender_class = TcpSender
    receiver_class = TcpReceiver
    carries_states = True  # moves a recurrent-state checkpoint beside the blocks (connector.check_layout)

    def __init__(self, engine, listen: Optional[str] = None, ttl_s: float = DEFAULT_TTL_S,
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("ttl_s", ttl_s), ("max_inflight_bytes", max_inflight_bytes),
                            ("chunk_bytes", chunk_bytes)):
            if value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        check_layout(engine.runner.kv_layout, self.carries_states)
        if getattr(engine.config, "world_size", 1) > 1:
            raise ValueError("KV transfer: not supported with tensor_parallel_size or pipeline_parallel_size > 1 "
                             "yet (each rank holds only its KV heads or layers; the connector reads rank 0's)")
        self.block_pool = engine.scheduler.block_pool
        self.block_io = KVBlockIO.for_runner(engine.runner)
        self.model_id = engine.model_id
        self.block_size = engine.config.block_size
        self.sender = self.sender_class(self.block_pool, self.block_io.read_block, chunk_bytes, ttl_s, clock)
        state = engine.scheduler.kv_cache_manager.state  # the recurrent-state group, or None
        self.layout = dict(self.block_io.layout)
        if state is not None:
            self.state_io = KVStateIO.for_runner(engine.runner)
            self.state_pool, self.state_group_idx = state.pool, state.group_idx
            self.layout.update(self.state_io.layout)
            self.sender.carry_states(state.pool, self.state_io.read_slot)
        self.receiver: Optional[TcpReceiver] = None
        self._pulls: "queue.SimpleQueue[tuple[socket.socket, dict]]" = queue.SimpleQueue()
        self._wake: Callable[[], None] = lambda: None
        if listen is not None:
            host, port = parse_peer(listen) if not listen.endswith(":0") else (listen[:-2], 0)
            self.receiver = self.receiver_class(
                self.block_pool, self.block_io.write_block, self.model_id, self.block_size, self.layout,
                host, port, max_inflight_bytes, chunk_bytes, ttl_s, on_pull=self._queue_pull,
                **self._receiver_options())
            if state is not None:
                self.receiver.carry_states(state.pool, state.group_idx, self.state_io.write_slot)

    def _receiver_options(self) -> dict:
        """Extra keyword arguments of ``receiver_class`` (another transport's own)."""
        return {}

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called from the connector's threads whenever ``poll()`` has work (a
        pull to answer, a transfer to commit, a result): a serving loop that idles on a queue
        passes its own wake-up, so a transfer never waits for the loop's idle timeout."""
        self._wake = wake
        if self.receiver is not None:
            self.receiver.wake = wake

    def _queue_pull(self, conn: socket.socket, obj: dict) -> None:
        self._pulls.put((conn, obj))
        self._wake()

    @property
    def address(self) -> Optional[str]:
        return self.receiver.address if self.receiver is not None else None

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks the sending side holds for transfers in flight."""
        return self.sender.num_pinned_blocks

    def send(self, peer: str, block_hashes: Sequence[BlockHash], *, transfer_id: Optional[str] = None,
             parent_block_hash: Optional[BlockHash] = None, cache_salt: Optional[str] = None,
             adapter_id: Optional[str] = None) -> str:
        """Pin the leading cached run of ``block_hashes`` and start sending it to ``peer``.

        Returns:
            The transfer id (``poll`` reports its result).
        Raises:
            ValueError: a bad peer address, or none of the blocks is cached here.
        """
        parse_peer(peer)
        transfer_id = transfer_id or _new_id()
        offer, blocks = self._make_offer(transfer_id, block_hashes, parent_block_hash, cache_salt, adapter_id)
        self._start(peer, offer, blocks)
        return transfer_id

    def pull(self, peer: str, block_hashes: Sequence[BlockHash], *, transfer_id: Optional[str] = None,
             parent_block_hash: Optional[BlockHash] = None, cache_salt: Optional[str] = None,
             adapter_id: Optional[str] = None) -> str:
        """Ask ``peer`` (a listening connector) for the cached run of ``block_hashes`` it holds.

        The peer answers from its engine thread's ``poll`` as if it had called ``send``; the
        blocks arrive as a ``receive`` result here. Raises ValueError without a listener here.
        """
        if self.receiver is None:
            raise ValueError("KV transfer: pull needs a connector made with listen=...")
        transfer_id = transfer_id or _new_id()
        self.receiver.pull(parse_peer(peer), {
            "version": wire.PROTOCOL_VERSION, "transfer_id": transfer_id,
            "block_hashes": [h.hex() for h in block_hashes],
            "parent_block_hash": parent_block_hash.hex() if parent_block_hash else None,
            "cache_salt": cache_salt, "adapter_id": adapter_id})
        return transfer_id

    def _make_offer(self, transfer_id, block_hashes, parent_block_hash, cache_salt, adapter_id):
        blocks = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            raise ValueError("KV transfer: none of the offered blocks is cached on this replica")
        has_state = "state_bytes" in self.layout
        if has_state:  # a hit needs the state where it ends: the run ends at its last checkpoint
            blocks = blocks[:self._last_checkpoint(blocks)]
        offer = Offer(transfer_id, self.model_id, self.block_size, self.layout,
                      [b.block_hash for b in blocks], [list(b.token_ids) for b in blocks],
                      parent_block_hash, cache_salt, adapter_id, has_state=has_state)
        return offer, blocks

    def _last_checkpoint(self, blocks) -> int:
        """How many of ``blocks`` lead up to the last one with a cached state checkpoint after it.
        Raises ValueError when none has one (the blocks alone would never be a hit)."""
        for n in range(len(blocks), 0, -1):
            if self.state_pool.get_cached_block(blocks[n - 1].block_hash, self.state_group_idx) is not None:
                return n
        raise ValueError("KV transfer: no recurrent-state checkpoint is cached at a block boundary of the "
                         "offered run on this replica (its blocks alone would never be a hit)")

    def _start(self, peer: str, offer: Offer, blocks, sock: Optional[socket.socket] = None) -> None:
        """Start sending ``offer`` (with its state checkpoint, when it has one)."""
        slot = (self.state_pool.get_cached_block(offer.block_hashes[-1], self.state_group_idx)
                if offer.has_state else None)
        self.sender.start(peer, offer, blocks, sock=sock, state_slot=slot)

    def _answer_pulls(self) -> None:
        """Engine thread: pin and start sending what each queued PULL asks for, or REFUSE it."""
        for conn, obj in take_all(self._pulls):
            try:
                if obj.get("version") != wire.PROTOCOL_VERSION:
                    raise ValueError(f"protocol version {obj.get('version')!r}; this replica speaks "
                                     f"{wire.PROTOCOL_VERSION}")
                parent = obj.get("parent_block_hash")
                offer, blocks = self._make_offer(
                    str(obj["transfer_id"]), [BlockHash(bytes.fromhex(h)) for h in obj["block_hashes"]],
                    BlockHash(bytes.fromhex(parent)) if parent else None, obj.get("cache_salt"), obj.get("adapter_id"))
                self._start("pulled", offer, blocks, sock=conn)
            except (KeyError, TypeError, ValueError) as e:
                try:
                    wire.send_json(conn, FrameType.REFUSE, {"reason": str(e)})
                except OSError:
                    pass
                conn.close()

    def poll(self) -> list[TransferResult]:
        """Answer pulls, commit received transfers, unpin finished or expired sends; every
        finished result."""
        self._answer_pulls()
        results: list[TransferResult] = []
        if self.receiver is not None:
            self.receiver.commit_ready()
            results += self.receiver.take_results()
        return results + self.sender.finish_ready()

    def close(self) -> None:
        self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        for conn, _ in take_all(self._pulls):
            conn.close()


def _new_id() -> str:
    """Unique across replicas: a holder may serve pulls from many machines at once."""
    return f"kvx-{uuid.uuid4().hex[:16]}-{next(_ids)}"
