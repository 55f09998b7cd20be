"""The NIXL connector's receiving side: the TCP receiver's control path, data read over NIXL.

Same connection, frames, checks, caps and TTLs as ``tcp_receiver`` (docs/kv_transfer.md);
only the data phase differs when the OFFER carries a ``nixl`` section:

    OFFER(+nixl) -> ACCEPT{need, transport: "nixl"} -> READY{digests} ->
    [engine thread: allocate len(need) free blocks] -> NIXL READ into them ->
    SHA-256 of each block == its digest -> [engine thread: cache + free] -> DONE

An OFFER without ``nixl`` (a TCP connector's) is received as CHUNKs, exactly as the TCP
receiver does, so the two backends interoperate.

Invariants (beyond the TCP receiver's):
- The pool is touched only on the engine thread (``commit_ready``): allocations asked for by
  connection threads, commits, and releases of blocks whose READ or check failed. A
  connection thread waits at most ``ttl_s`` for an allocation; one it gave up on is never
  made (the engine thread sees it abandoned under its lock).
- Allocated blocks are unreferenced by any request and not in the hash map until the commit
  enters them under the offered hashes; on any failure (READ error, peer killed, deadline,
  checksum mismatch, TTL, close) they are freed uncached, so the pool ends as it was.
- A READ whose handle NIXL could not release may still write: its blocks are kept out of
  the pool for good (``num_quarantined_blocks``, logged) rather than reused.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from pagoda.engine.kv.block_pool import KVCacheBlock
from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.nixl_memory import NixlKVMemory, NixlReadError
from pagoda.engine.kv_transfer.offer import Offer
from pagoda.engine.kv_transfer.tcp_receiver import IncomingTransfer, TcpReceiver, new_blocks_dropping_evicted, take_all
from pagoda.engine.kv_transfer.wire import FrameType, WireError

logger = logging.getLogger(__name__)


@dataclass
class _Allocation:
    """A connection thread's request for free blocks, served on the engine thread."""

    num_blocks: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    blocks: Optional[list[KVCacheBlock]] = None
    error: Optional[str] = None
    abandoned: bool = False


class NixlReceiver(TcpReceiver):
    """Args: those of ``TcpReceiver``, and
    memory: this replica's registered KV caches (``NixlKVMemory``).
    read_block: block id -> its bytes (``KVBlockIO.read_block``), for the checksum.
    """

    def __init__(self, *args, memory: NixlKVMemory, read_block, **kwargs) -> None:
        self.memory = memory
        self.read_block = read_block
        self.num_quarantined_blocks = 0
        self._closing = False
        self._allocations: "queue.SimpleQueue[_Allocation]" = queue.SimpleQueue()
        self._releases: "queue.SimpleQueue[list[KVCacheBlock]]" = queue.SimpleQueue()
        super().__init__(*args, **kwargs)

    # -- engine thread -------------------------------------------------------------------

    def commit_ready(self) -> None:
        """Engine thread: serve allocations, free failed reads' blocks, then commit (TCP's)."""
        self._serve_allocations()
        self._free_released()
        super().commit_ready()

    def _serve_allocations(self) -> None:
        for a in take_all(self._allocations):
            with a.lock:
                if a.abandoned:
                    continue
                free = self.block_pool.num_free_blocks
                if self._closing:
                    a.error = "connector closed"
                elif a.num_blocks > free:
                    a.error = f"no free blocks: {a.num_blocks} needed, {free} free"
                else:
                    a.blocks = new_blocks_dropping_evicted(self.block_pool, a.num_blocks)
                a.done.set()

    def _free_released(self) -> None:
        for blocks in take_all(self._releases):
            self.block_pool.free_blocks(reversed(blocks))

    def _commit(self, t: IncomingTransfer) -> None:
        if t.offer.nixl is None:
            return super()._commit(t)
        blocks, t.blocks = t.blocks, []
        self._cache_and_free(t, dict(zip(t.need, blocks)))

    def _drop(self, t: IncomingTransfer) -> None:
        blocks, t.blocks = t.blocks, []
        self.block_pool.free_blocks(reversed(blocks))

    def close(self) -> None:
        """Refuse new allocations, wake every waiting connection thread, join them (TCP's
        close), then free whatever they left to the engine thread: the pool ends as it was."""
        self._closing = True
        self._drain()
        super().close()
        self._drain()

    def _drain(self) -> None:
        self._serve_allocations()
        for t in take_all(self._ready):
            with t.lock:
                t.abandoned = True
                t.error = t.error or "connector closed"
                self._drop(t)
                t.committed.set()
        self._free_released()

    # -- connection threads -----------------------------------------------------------------

    def _check_offer(self, offer: Offer) -> Optional[str]:
        reason = super()._check_offer(offer)
        if reason is None and offer.nixl is not None:
            try:
                self.memory.check_remote(offer.nixl, len(offer.block_hashes))
            except ValueError as e:
                reason = str(e)
        return reason

    def _accept_reply(self, offer: Offer, need: list[int]) -> dict:
        reply = super()._accept_reply(offer, need)
        if offer.nixl is not None:
            reply["transport"] = "nixl"  # the sender sends READY, not CHUNKs
        return reply

    def _receive_blocks(self, conn: socket.socket, t: IncomingTransfer) -> None:
        if t.offer.nixl is None:
            return super()._receive_blocks(conn, t)
        digests = self._recv_ready(conn, len(t.need))
        if not t.need:
            return
        blocks = self._allocate(len(t.need))
        try:
            self.memory.read(t.offer.nixl, t.need, [b.block_id for b in blocks], time.monotonic() + self.ttl_s)
            for index, block, digest in zip(t.need, blocks, digests):
                if hashlib.sha256(self.read_block(block.block_id)).hexdigest() != digest:
                    raise WireError(f"checksum mismatch in block {index} read over NIXL")
        except NixlReadError as e:
            self._release(blocks, quarantine=e.is_unsafe)
            raise WireError(str(e)) from None
        except BaseException:
            self._release(blocks)
            raise
        t.blocks = blocks

    def _recv_ready(self, conn: socket.socket, num_blocks: int) -> list[str]:
        kind, ready = wire.recv_json(conn, (FrameType.READY, FrameType.ERROR))
        if kind == FrameType.ERROR:
            raise WireError(f"sender failed: {ready.get('reason')}")
        digests = ready.get("digests")
        if not isinstance(digests, list) or len(digests) != num_blocks:
            raise WireError(f"READY must list {num_blocks} digests, got {digests!r:.80}")
        return digests

    def _allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Free blocks from the engine thread (it serves them in ``poll()``), or WireError."""
        a = _Allocation(num_blocks)
        if not self._hand_to_engine(self._allocations, a, a.done):
            raise WireError(f"the engine did not allocate blocks within the TTL of {self.ttl_s:g} s")
        if a.error is not None:
            raise WireError(a.error)
        return a.blocks

    def _release(self, blocks: list[KVCacheBlock], quarantine: bool = False) -> None:
        if quarantine:
            with self._lock:
                self.num_quarantined_blocks += len(blocks)
            logger.error("NIXL: %d blocks kept out of the pool: a READ into them could not be released",
                         len(blocks))
            return
        self._releases.put(blocks)
        self.wake()
