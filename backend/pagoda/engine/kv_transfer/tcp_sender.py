"""The TCP connector's sending side: one thread per transfer, pinned blocks, a TTL.

Invariants:
- A transfer's blocks are pinned (``BlockPool.touch``) on the engine thread in ``start``
  and unpinned exactly once on the engine thread in ``finish_ready`` (or ``close``): after
  the receiver's DONE or ERROR, after a connection failure, or once ``clock()`` passes
  the transfer's deadline (``ttl_s`` after it started), whichever comes first.
- The thread reads a block's bytes only while holding the transfer's lock and only if the
  transfer is not cancelled; unpinning takes the lock after cancelling, so a block is
  never read after it could be reused.
- Cancelling shuts the socket down, which wakes the thread from any blocking call.
- A hybrid model's transfer also pins its state checkpoint slot (``carry_states``) in the
  state pool, read and released under the same rules, as payload ``len(blocks)``.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from pagoda.engine.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.connector import TransferResult, parse_peer
from pagoda.engine.kv_transfer.offer import Offer
from pagoda.engine.kv_transfer.wire import FrameType, WireError


@dataclass
class OutgoingTransfer:
    offer: Offer
    peer: str
    blocks: list[KVCacheBlock]
    started: float
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    sock: Optional[socket.socket] = None
    thread: Optional[threading.Thread] = None
    state_slot: Optional[KVCacheBlock] = None  # the checkpoint after the last block (hybrid models)
    num_blocks_sent: int = 0
    num_bytes_sent: int = 0
    error: Optional[str] = None
    done: bool = False  # the thread has finished (error set on failure)


class TcpSender:
    """Args:
    block_pool: the sending replica's pool.
    read_block: block id -> its bytes (``KVBlockIO.read_block``).
    chunk_bytes: payload bytes per CHUNK frame.
    ttl_s: how long blocks stay pinned for one transfer at most.
    clock: monotonic seconds (injected in tests).
    """

    def __init__(self, block_pool: BlockPool, read_block: Callable[[int], bytes], chunk_bytes: int,
                 ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_pool = block_pool
        self.read_block = read_block
        self.chunk_bytes = chunk_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.transfers: dict[str, OutgoingTransfer] = {}
        self.state_pool: Optional[BlockPool] = None
        self.read_state: Optional[Callable[[int], bytes]] = None
        self._threads: list[threading.Thread] = []  # joined in close, expired ones included

    def carry_states(self, state_pool: BlockPool, read_state: Callable[[int], bytes]) -> None:
        """Send state checkpoints too: slots of ``state_pool``, read by ``read_state``."""
        self.state_pool, self.read_state = state_pool, read_state

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(t.blocks) for t in self.transfers.values())

    def start(self, peer: str, offer: Offer, blocks: list[KVCacheBlock],
              sock: Optional[socket.socket] = None, state_slot: Optional[KVCacheBlock] = None) -> None:
        """Engine thread: pin ``blocks`` (and ``state_slot``) and start the transfer's thread (over
        ``sock``, a connection the peer opened to pull, or a new connection to ``peer``)."""
        if sock is None:
            parse_peer(peer)
        if offer.transfer_id in self.transfers:
            raise ValueError(f"transfer id {offer.transfer_id!r} is already in flight")
        assert (state_slot is not None) == offer.has_state, "an offer with a state needs its checkpoint slot"
        self.block_pool.touch(blocks)
        if state_slot is not None:
            self.state_pool.touch([state_slot])
        now = self.clock()
        t = OutgoingTransfer(offer, peer, blocks, now, now + self.ttl_s, sock=sock, state_slot=state_slot)
        self.transfers[offer.transfer_id] = t
        t.thread = threading.Thread(target=self._run, args=(t,), name=f"kv-send-{offer.transfer_id}", daemon=True)
        self._threads = [th for th in self._threads if th.is_alive()] + [t.thread]
        t.thread.start()

    def finish_ready(self) -> list[TransferResult]:
        """Engine thread: unpin finished or expired transfers; their results."""
        now = self.clock()
        results = []
        for transfer_id, t in list(self.transfers.items()):
            if not t.done and now < t.deadline:
                continue
            if not t.done:
                t.error = f"TTL of {self.ttl_s:g} s passed before the receiver confirmed"
            results.append(self._release(t, now))
            del self.transfers[transfer_id]
        return results

    def close(self) -> None:
        for t in list(self.transfers.values()):
            if not t.done:
                t.error = t.error or "connector closed"
            self._release(t, self.clock())
        self.transfers.clear()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads = []

    def _release(self, t: OutgoingTransfer, now: float) -> TransferResult:
        with t.lock:
            t.cancelled = True
        _shutdown(t.sock)
        self.block_pool.free_blocks(reversed(t.blocks))
        if t.state_slot is not None:
            self.state_pool.free_blocks([t.state_slot])
        return TransferResult(t.offer.transfer_id, "send", t.num_blocks_sent, t.num_bytes_sent,
                              now - t.started, t.error)

    def _run(self, t: OutgoingTransfer) -> None:
        try:
            self._exchange(t)
        except (OSError, WireError, ValueError) as e:
            t.error = t.error or f"{type(e).__name__}: {e}"
        finally:
            _shutdown(t.sock)
            t.done = True

    def _exchange(self, t: OutgoingTransfer) -> None:
        with t.lock:
            if t.cancelled:
                return
            if t.sock is None:
                t.sock = socket.create_connection(parse_peer(t.peer), timeout=max(self.ttl_s, 0.1))
        t.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire.send_json(t.sock, FrameType.OFFER, t.offer.to_json())
        kind, reply = wire.recv_json(t.sock, (FrameType.ACCEPT, FrameType.REFUSE))
        if kind == FrameType.REFUSE:
            raise WireError(f"receiver refused: {reply.get('reason')}")
        need = reply.get("need", [])
        for index in need:
            if not isinstance(index, int) or not 0 <= index < t.offer.num_payloads:
                raise WireError(f"receiver asked for payload {index} of {t.offer.num_payloads}")
        if not self._send_blocks(t, need, reply):
            return
        kind, reply = wire.recv_json(t.sock, (FrameType.DONE, FrameType.ERROR))
        if kind == FrameType.ERROR:
            raise WireError(f"receiver failed: {reply.get('reason')}")

    def _send_blocks(self, t: OutgoingTransfer, need: list[int], accept: dict) -> bool:
        """The data phase: the needed blocks as CHUNKs, then END. False: cancelled meanwhile.
        (``accept`` is the receiver's ACCEPT; another transport reads its own keys there.)"""
        for index in need:
            with t.lock:
                if t.cancelled:
                    return False
                data = (self.read_block(t.blocks[index].block_id) if index < len(t.blocks)
                        else self.read_state(t.state_slot.block_id))
            for offset in range(0, len(data), self.chunk_bytes):
                wire.send_chunk(t.sock, index, offset, data[offset: offset + self.chunk_bytes])
            t.num_blocks_sent += 1 if index < len(t.blocks) else 0  # blocks; the bytes count the state too
            t.num_bytes_sent += len(data)
        wire.send_frame(t.sock, FrameType.END)
        return True


def _shutdown(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
