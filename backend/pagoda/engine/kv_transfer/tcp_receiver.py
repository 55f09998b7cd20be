"""The TCP connector's receiving side: a listener thread, one thread per connection.

A connection carries one transfer: OFFER -> ACCEPT(need) | REFUSE, CHUNK..., END ->
DONE | ERROR (docs/kv_transfer.md). A pull is the same exchange on a connection the
receiver opened: it sends PULL first (``pull``), and the holder answers OFFER or REFUSE; a
PULL arriving on the listener is handed to ``on_pull`` (the connector answers it as a
sender, from the engine thread). Invariants:
- Memory is bounded: at most ``max_connections`` connections are served at once (one
  more is answered REFUSE "busy" and closed), each reading at most one frame ahead; an offer is accepted only if the
  bytes of the blocks it still needs fit in ``max_inflight_bytes`` minus what other transfers have reserved; the
  reservation is returned when the transfer ends, however it ends. A frame longer than
  one chunk is refused before it is read.
- Nothing is allocated in the block pool until every needed block has arrived intact:
  a chunk whose SHA-256 does not match, an out-of-order chunk, a stalled sender
  (``ttl_s`` without a byte) or an early close drops the buffers and answers ERROR, and
  the pool never saw the transfer.
- The pool is touched only on the engine thread: the connection thread hands a complete
  transfer to ``commit_ready`` (called by ``poll()``), which writes the blocks into free
  blocks, enters them in the prefix cache and frees them (they stay cached), then wakes
  the connection thread to answer DONE. A commit that does not happen within ``ttl_s``
  answers ERROR and is dropped.
- Blocks (and state slots) taken for a commit evict cached ones without offering them to the
  CPU tier (``new_blocks_dropping_evicted``: the tier's copy would run after the write).
- A hybrid model's offer (``Offer.has_state``) carries the recurrent-state checkpoint at the
  run's last block boundary as payload ``len(block_hashes)``: needed when this replica's
  state group lacks it, committed into a free state slot and entered under the run's last
  hash with the blocks (``carry_states``), so the next request with the prefix hits in every
  group. No state slot free at the commit: the blocks are entered, the state is not, and the
  transfer ends in ERROR saying so (a hit then stops at an earlier checkpoint: never a wrong one).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from pagoda.engine.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.engine.kv_transfer import wire
from pagoda.engine.kv_transfer.connector import TransferResult
from pagoda.engine.kv_transfer.offer import Offer, check_offer, contiguous_runs
from pagoda.engine.kv_transfer.wire import FrameType, WireError


@dataclass
class IncomingTransfer:
    offer: Offer
    need: list[int]
    started: float
    data: dict[int, bytearray] = field(default_factory=dict)
    committed: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    num_stored: int = 0
    error: Optional[str] = None
    blocks: list[KVCacheBlock] = field(default_factory=list)  # pool blocks written before the commit (NIXL)


class TcpReceiver:
    """Args:
    block_pool: the receiving replica's pool (prefix caching on).
    write_block: (block id, bytes) -> None (``KVBlockIO.write_block``).
    model_id, block_size, layout: what an offer must match (``offer.check_offer``).
    host, port: where to listen (port 0: any free port; see ``address``).
    max_inflight_bytes: cap on buffered block bytes across transfers.
    chunk_bytes: largest CHUNK payload accepted.
    ttl_s: longest wait for the next frame, and for the engine thread's commit.
    max_connections: connections served at once.
    """

    def __init__(self, block_pool: BlockPool, write_block: Callable[[int, bytes], None], model_id: str,
                 block_size: int, layout: dict, host: str, port: int, max_inflight_bytes: int,
                 chunk_bytes: int, ttl_s: float,
                 on_pull: Optional[Callable[[socket.socket, dict], None]] = None,
                 max_connections: int = 64) -> None:
        self.block_pool = block_pool
        self.write_block = write_block
        self.model_id, self.block_size, self.layout = model_id, block_size, layout
        self.block_bytes = int(layout["block_bytes"])
        self.max_inflight_bytes = max_inflight_bytes
        self.chunk_bytes = chunk_bytes
        self.ttl_s = ttl_s
        self.on_pull = on_pull
        self.wake: Callable[[], None] = lambda: None  # the engine thread has work: a commit, a result
        self.max_connections = max_connections
        self.num_inflight_bytes = 0
        self.state_pool: Optional[BlockPool] = None  # carry_states: the recurrent-state group's slots
        self.state_group_idx = 0
        self.write_state: Optional[Callable[[int, bytes], None]] = None
        self._lock = threading.Lock()
        self._ready: "queue.SimpleQueue[IncomingTransfer]" = queue.SimpleQueue()
        self._results: list[TransferResult] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()  # shut down by close, waking their threads
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-recv-accept", daemon=True)
        self._accept_thread.start()

    def carry_states(self, state_pool: BlockPool, group_idx: int, write_state: Callable[[int, bytes], None]) -> None:
        """Receive state checkpoints too, into ``state_pool``'s slots (group ``group_idx``)."""
        self.state_pool, self.state_group_idx, self.write_state = state_pool, group_idx, write_state

    def close(self) -> None:
        """Stop accepting, wake every connection thread and join them all."""
        self._stop.set()
        self._accept_thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=5)

    def take_results(self) -> list[TransferResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def commit_ready(self) -> None:
        """Engine thread: write, cache and confirm every complete transfer."""
        for t in take_all(self._ready):
            with t.lock:  # the connection thread may abandon it at its TTL
                if not t.abandoned:
                    self._commit(t)
                else:
                    self._drop(t)
                t.committed.set()

    def _drop(self, t: IncomingTransfer) -> None:
        """Engine thread: a transfer abandoned before its commit. Nothing of it is in the pool
        here (its bytes are buffered); a transport that writes blocks early frees them."""

    def _commit(self, t: IncomingTransfer) -> None:
        pool, hashes = self.block_pool, t.offer.block_hashes
        missing = [i for i in t.need if i < len(hashes) and pool.get_cached_block(hashes[i]) is None]
        if len(missing) > pool.num_free_blocks:
            t.error = f"no free blocks: {len(missing)} needed, {pool.num_free_blocks} free"
            return
        blocks = new_blocks_dropping_evicted(pool, len(missing))
        by_index = dict(zip(missing, blocks))
        for i, block in by_index.items():
            self.write_block(block.block_id, t.data[i])
        self._cache_and_free(t, by_index)
        if len(t.offer.block_hashes) in t.need:
            self._commit_state(t)

    def _commit_state(self, t: IncomingTransfer) -> None:
        """Engine thread: write the offer's state checkpoint into a free state slot and enter it
        under the run's last hash (unless one is cached meanwhile; no slot free: ``t.error``)."""
        offer, pool = t.offer, self.state_pool
        last = len(offer.block_hashes) - 1
        if pool.get_cached_block(offer.block_hashes[last], self.state_group_idx) is not None:
            return
        if not pool.num_free_blocks:  # every slot is a working one: the blocks alone stay (an error says so)
            t.error = "no free recurrent-state slot for the checkpoint; the blocks were entered without it"
            return
        slot = new_blocks_dropping_evicted(pool, 1)[0]
        self.write_state(slot.block_id, t.data[last + 1])
        parent = offer.block_hashes[last - 1] if last > 0 else offer.parent_block_hash
        pool.cache_received_blocks([slot], [offer.block_hashes[last]], [offer.token_ids[last]], parent,
                                   lora_name=offer.adapter_id, cache_salt=offer.cache_salt,
                                   group_idx=self.state_group_idx)
        pool.free_blocks([slot])

    def _cache_and_free(self, t: IncomingTransfer, by_index: dict[int, KVCacheBlock]) -> None:
        """Engine thread: enter written blocks (offer index -> block) in the prefix cache under
        the offered hashes, then free them (ref 0: free, but cached until evicted, LRU). A hash
        cached meanwhile keeps its block; the duplicate is freed uncached."""
        hashes = t.offer.block_hashes
        for run in contiguous_runs(sorted(by_index)):
            parent = hashes[run[0] - 1] if run[0] > 0 else t.offer.parent_block_hash
            t.num_stored += self.block_pool.cache_received_blocks(
                [by_index[i] for i in run], [hashes[i] for i in run], [t.offer.token_ids[i] for i in run],
                parent, lora_name=t.offer.adapter_id, cache_salt=t.offer.cache_salt)
        self.block_pool.free_blocks(reversed([by_index[i] for i in sorted(by_index)]))

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                is_full = len(self._conns) >= self.max_connections
            if is_full:
                _try_send_json(conn, FrameType.REFUSE, {"reason": f"busy: {self.max_connections} connections open"})
                conn.close()
                continue
            self._start_thread(conn, None)

    def pull(self, peer: tuple[str, int], request: dict) -> None:
        """Ask ``peer`` for blocks (a PULL frame, ``request`` as its JSON), then receive them."""
        self._start_thread(None, (peer, request))

    def _start_thread(self, conn: Optional[socket.socket], pull: Optional[tuple]) -> None:
        thread = threading.Thread(target=self._serve, args=(conn, pull), name="kv-recv-conn", daemon=True)
        self._threads = [th for th in self._threads if th.is_alive()] + [thread]
        thread.start()

    def _open(self, conn: Optional[socket.socket], pull: Optional[tuple]) -> tuple[socket.socket, tuple]:
        """The connection and the first frames it may start with (a pull opens it and asks first)."""
        if pull is not None:
            conn = socket.create_connection(pull[0], timeout=self.ttl_s)
            with self._lock:
                self._conns.add(conn)
            wire.send_json(conn, FrameType.PULL, pull[1])
            return conn, (FrameType.OFFER, FrameType.REFUSE)
        with self._lock:
            self._conns.add(conn)
        conn.settimeout(self.ttl_s)
        return conn, (FrameType.OFFER, FrameType.PULL)

    def _serve(self, conn: Optional[socket.socket], pull: Optional[tuple]) -> None:
        started, reserved, offer, t = time.monotonic(), 0, None, None
        transfer_id = pull[1]["transfer_id"] if pull is not None else None
        handed_off = False
        try:
            conn, expected = self._open(conn, pull)
            kind, obj = wire.recv_json(conn, expected)
            if kind == FrameType.PULL:
                handed_off = self._hand_off_pull(conn, obj)
                return
            if kind == FrameType.REFUSE:
                raise WireError(f"peer refused the pull: {obj.get('reason')}")
            offer, t, reserved = self._accept_offer(conn, obj, started)
            if t is not None:
                self._receive_blocks(conn, t)
                self._await_commit(conn, t)
        except (OSError, WireError, ValueError) as e:
            error = f"{type(e).__name__}: {e}" if not isinstance(e, WireError) else str(e)
            _try_send_json(conn, FrameType.ERROR, {"reason": error})
            if offer is not None or transfer_id is not None:
                self._record(offer.transfer_id if offer else transfer_id, started, 0, 0, error)
        finally:
            with self._lock:
                self.num_inflight_bytes -= reserved
                self._conns.discard(conn)
            if conn is not None and not handed_off:
                conn.close()

    def _hand_off_pull(self, conn: socket.socket, obj: dict) -> bool:
        if self.on_pull is None:
            raise WireError("this replica does not serve pulls")
        self.on_pull(conn, obj)
        return True

    def _accept_offer(self, conn: socket.socket, obj: dict, started: float):
        offer = Offer.from_json(obj)
        reason = self._check_offer(offer)
        if reason is None and not self.block_pool.enable_caching:
            reason = "prefix caching is off on this replica"
        # A read of the hash map off the engine thread: a hint only. The commit re-checks on
        # the engine thread; a block "had" here but evicted before the commit leaves a gap,
        # and the prefix hit then stops at it (never a wrong hit).
        need = [i for i, h in enumerate(offer.block_hashes) if self.block_pool.get_cached_block(h) is None]
        if reason is None and offer.has_state:
            if self.state_pool is None:
                reason = "the offer carries a recurrent state and this replica keeps none"
            elif self.state_pool.get_cached_block(offer.block_hashes[-1], self.state_group_idx) is None:
                need.append(len(offer.block_hashes))
        num_bytes = sum(offer.payload_bytes(i) for i in need)
        with self._lock:
            if reason is None and self.num_inflight_bytes + num_bytes > self.max_inflight_bytes:
                reason = (f"busy: {num_bytes} bytes needed, {self.num_inflight_bytes} of "
                          f"{self.max_inflight_bytes} in flight")
            if reason is None:
                self.num_inflight_bytes += num_bytes
        if reason is not None:
            _try_send_json(conn, FrameType.REFUSE, {"reason": reason})
            self._record(offer.transfer_id, started, 0, 0, f"refused: {reason}")
            return None, None, 0
        wire.send_json(conn, FrameType.ACCEPT, self._accept_reply(offer, need))
        return offer, IncomingTransfer(offer, need, started), num_bytes

    def _check_offer(self, offer: Offer) -> Optional[str]:
        """Why this replica refuses ``offer`` (``offer.check_offer``), or None."""
        return check_offer(offer, self.model_id, self.block_size, self.layout)

    def _accept_reply(self, offer: Offer, need: list[int]) -> dict:
        """ACCEPT's body: the blocks this replica lacks (another transport adds its own keys)."""
        return {"need": need}

    def _receive_blocks(self, conn: socket.socket, t: IncomingTransfer) -> None:
        limit = wire.chunk_frame_limit(self.chunk_bytes)
        pending = {i: bytearray() for i in t.need}
        sizes = {i: t.offer.payload_bytes(i) for i in t.need}
        while True:
            kind, body = wire.recv_frame(conn, limit)
            if kind == FrameType.END:
                break
            if kind != FrameType.CHUNK:
                raise WireError(f"expected CHUNK or END, got {kind.name}")
            chunk = wire.read_chunk(body)
            buf = pending.get(chunk.block_index)
            if buf is None or chunk.offset != len(buf) or len(buf) + len(chunk.payload) > sizes[chunk.block_index]:
                raise WireError(f"unexpected chunk of block {chunk.block_index} at offset {chunk.offset}")
            buf += chunk.payload
        short = [i for i, buf in pending.items() if len(buf) != sizes[i]]
        if short:
            raise WireError(f"END before blocks {short} were complete")
        t.data = pending

    def _hand_to_engine(self, work: queue.SimpleQueue, item, done: threading.Event) -> bool:
        """Queue ``item`` for the engine thread, wake it and wait up to ``ttl_s`` for ``done``.
        False: the TTL passed; ``item.abandoned`` is then set under ``item.lock``, and the engine
        thread, which checks it under that lock, never acts on the item."""
        work.put(item)
        self.wake()
        done.wait(self.ttl_s)
        with item.lock:
            if not done.is_set():
                item.abandoned = True
            return done.is_set()

    def _await_commit(self, conn: socket.socket, t: IncomingTransfer) -> None:
        if not self._hand_to_engine(self._ready, t, t.committed):
            t.error = f"the engine did not commit within the TTL of {self.ttl_s:g} s"
        t.data = {}
        num_bytes = sum(t.offer.payload_bytes(i) for i in t.need)
        if t.error is None:
            _try_send_json(conn, FrameType.DONE, {"num_blocks_stored": t.num_stored})
        else:
            _try_send_json(conn, FrameType.ERROR, {"reason": t.error})
        self._record(t.offer.transfer_id, t.started, t.num_stored, num_bytes, t.error)

    def _record(self, transfer_id: str, started: float, num_blocks: int, num_bytes: int,
                error: Optional[str]) -> None:
        with self._lock:
            self._results.append(TransferResult(transfer_id, "receive", num_blocks, num_bytes,
                                                time.monotonic() - started, error))
        self.wake()


def new_blocks_dropping_evicted(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    """``pool.get_new_blocks`` for blocks written at once, between steps: cached blocks it evicts
    are dropped, not offered to the CPU tier (``on_evict``), whose copy would run only at the
    next step, after the received bytes overwrote them, and keep them under the old hash."""
    hook, pool.on_evict = pool.on_evict, None
    try:
        return pool.get_new_blocks(num_blocks)
    finally:
        pool.on_evict = hook


def take_all(items: queue.SimpleQueue) -> list:
    """Everything queued now, in order (the engine thread drains its work queues with it)."""
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken


def _try_send_json(conn: Optional[socket.socket], kind: FrameType, obj: dict) -> None:
    if conn is None:  # a pull whose connection never opened
        return
    try:
        wire.send_json(conn, kind, obj)
    except OSError:
        pass
