"""One replica's KV caches as NIXL memory: registered once, read by peers block by block.

``NixlKVMemory`` owns a NIXL agent (``nixl`` package, UCX backend: RDMA, NVLink, CUDA IPC,
shared memory or TCP, whichever UCX finds between the two processes) and registers every
layer's K and V cache tensor with it once, at construction (``DRAM`` for a CPU cache,
``VRAM`` for a CUDA one). A sender describes where its pinned blocks lie
(``describe``): its agent's name and metadata (connection info and the registrations'
remote keys, ~0.5 KB, base64) and each cache tensor's base address and block stride. A
receiver ``read``s those blocks straight into blocks of its own cache: one NIXL READ whose
descriptors pair, for each block and each of the ``2 * num_layers`` tensors, the remote
part (``part_bytes``, one layer's K or V of one block) with the local one.

Invariants:
- The memory stays registered for the agent's lifetime; ``close`` deregisters it and
  forgets every remote agent.
- A peer's metadata is loaded once per agent name (names are unique per connector) and
  dropped after a failed READ, so a dead peer's endpoint is not reused.
- ``read`` returns only when the READ is complete, or raises ``NixlReadError`` (failed,
  peer disconnected, or past its deadline); the transfer handle is released before it
  returns or raises, which aborts a READ still in flight. If NIXL cannot release it, the
  error says so (``is_unsafe``): the destination blocks may still be written and must not be
  reused.
- The agent runs in NIXL's strict thread-sync mode: connection threads call it concurrently.

The import of ``nixl`` is guarded: without it ``nixl_unavailable_reason()`` names why, and
``NixlKVMemory`` raises ValueError with that reason. nixl's own logger (on stdout) is set to
WARNING unless ``NIXL_LOG_LEVEL`` chooses a level.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)


class NixlReadError(Exception):
    """A NIXL READ that did not complete. ``is_unsafe``: its handle could not be released, so
    the destination memory may still be written."""

    def __init__(self, message: str, is_unsafe: bool = False) -> None:
        super().__init__(message)
        self.is_unsafe = is_unsafe


def _import_nixl():
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    if not os.environ.get("NIXL_LOG_LEVEL"):  # nixl logs every agent's creation at INFO on stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def nixl_unavailable_reason() -> Optional[str]:
    """Why the NIXL connector cannot run here (the import's error), or None if it can."""
    try:
        _import_nixl()
    except Exception as e:  # the meta package raises ImportError, a broken wheel OSError
        return f"the nixl package is not usable here ({type(e).__name__}: {e}); pip install nixl"
    return None


class NixlKVMemory:
    """Args:
    kv_caches: the runner's per-layer (K, V) caches, ``[num_blocks, block_size, heads, dim]``,
        each contiguous, all on one device.
    name: the agent's name (unique: peers key their metadata by it); default a fresh one.
    Raises:
        ValueError: nixl is not importable, or its UCX backend is missing.
    """

    def __init__(self, kv_caches, name: Optional[str] = None) -> None:
        reason = nixl_unavailable_reason()
        if reason is not None:
            raise ValueError(f"KV transfer backend 'nixl': {reason}")
        nixl_agent, nixl_agent_config, sync = _import_nixl()
        self.name = name or f"pagoda-{uuid.uuid4().hex[:16]}"
        config = nixl_agent_config(backends=["UCX"], sync_mode=sync.NIXL_THREAD_SYNC_STRICT)
        self.agent = nixl_agent(self.name, config)
        if "UCX" not in self.agent.backends:
            raise ValueError(f"KV transfer backend 'nixl': its UCX plugin did not load (plugins: "
                             f"{self.agent.get_plugin_list()})")
        self.tensors = [t for kv in kv_caches for t in kv]
        first = self.tensors[0]
        assert all(t.is_contiguous() and t.device == first.device for t in self.tensors), \
            "KV caches must be contiguous tensors on one device"
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device_id = max(first.get_device(), 0)
        self.part_bytes = first[0].numel() * first.element_size()
        self.regions = [[t.data_ptr(), t.stride(0) * t.element_size()] for t in self.tensors]
        self._registered = self.agent.register_memory(self.tensors)
        self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode("ascii")
        self._remotes: set[str] = set()
        self._lock = threading.Lock()
        self.num_reads = 0  # completed READs and their bytes (what moved over NIXL, not TCP)
        self.num_bytes_read = 0

    def describe(self, block_ids: Sequence[int]) -> dict:
        """The OFFER's ``nixl`` section: where blocks ``block_ids`` lie, and how to reach them."""
        return {"agent": self.name, "metadata": self._metadata, "mem_type": self.mem_type,
                "device_id": self.device_id, "regions": self.regions, "block_ids": list(block_ids)}

    def check_remote(self, remote: dict, num_blocks: int) -> None:
        """Raises ValueError naming what in an OFFER's ``nixl`` section is unusable here."""
        try:
            regions, block_ids = remote["regions"], remote["block_ids"]
            str(remote["agent"]), base64.b64decode(remote["metadata"], validate=True)
            numbers = [remote["device_id"], *block_ids, *(x for r in regions for x in r)]
            is_valid = (all(type(x) is int and 0 <= x < 1 << 64 for x in numbers)
                        and all(len(r) == 2 for r in regions) and remote["mem_type"] in ("DRAM", "VRAM"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed OFFER nixl section: {type(e).__name__}: {e}") from None
        if not is_valid or len(regions) != len(self.regions) or len(block_ids) != num_blocks:
            raise ValueError(f"OFFER nixl section does not fit: {len(regions)} regions for this replica's "
                             f"{len(self.regions)}, {len(block_ids)} block ids for {num_blocks} blocks, "
                             f"addresses and ids must be unsigned 64-bit integers, mem_type DRAM or VRAM")

    def read(self, remote: dict, remote_indices: Sequence[int], local_block_ids: Sequence[int],
             deadline: float, clock: Callable[[], float] = time.monotonic) -> int:
        """READ the remote blocks ``remote["block_ids"][i]`` (i in ``remote_indices``) into local
        blocks ``local_block_ids``, pairwise. Returns the bytes read.

        Raises:
            NixlReadError: the READ failed, the peer disconnected, or ``deadline`` passed.
        """
        remote_ids = [int(remote["block_ids"][i]) for i in remote_indices]
        local = _descriptors(self.regions, local_block_ids, self.part_bytes, self.device_id)
        far = _descriptors(remote["regions"], remote_ids, self.part_bytes, int(remote["device_id"]))
        try:
            peer = self._load_remote(remote)
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem_type),
                                                self.agent.get_xfer_descs(far, remote["mem_type"]), peer)
        except Exception as e:  # nixl raises its own exception types (nixlRemoteDisconnectError, ...)
            self.forget(str(remote["agent"]))
            raise NixlReadError(f"NIXL READ from {remote['agent']} could not start: {type(e).__name__}: {e}")
        return self._complete(handle, str(remote["agent"]), len(local) * self.part_bytes, deadline, clock)

    def _complete(self, handle, peer: str, num_bytes: int, deadline: float, clock) -> int:
        error = None
        try:
            state = self.agent.transfer(handle)
            while state == "PROC" and clock() < deadline:
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                error = "past its deadline" if state == "PROC" else "failed (ERR)"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        try:
            handle.release()  # aborts a READ still in flight
        except Exception as e:
            logger.error("NIXL READ from %s: its handle could not be released (%s)", peer, e)
            raise NixlReadError(f"NIXL READ from {peer} {error or 'done'}, and its handle could not be "
                                f"released: {type(e).__name__}: {e}", is_unsafe=True) from None
        if error is not None:
            self.forget(peer)
            raise NixlReadError(f"NIXL READ from {peer} {error}")
        with self._lock:
            self.num_reads += 1
            self.num_bytes_read += num_bytes
        return num_bytes

    def _load_remote(self, remote: dict) -> str:
        name = str(remote["agent"])
        with self._lock:
            if name not in self._remotes:
                loaded = self.agent.add_remote_agent(base64.b64decode(remote["metadata"]))
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != name:
                    self.agent.remove_remote_agent(loaded)
                    raise ValueError(f"metadata is agent {loaded!r}'s, the offer names {name!r}")
                self._remotes.add(name)
        return name

    def forget(self, name: str) -> None:
        """Drop a peer's metadata (and its connection); the next offer from it loads it again."""
        with self._lock:
            if name in self._remotes:
                self._remotes.discard(name)
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:
                    logger.warning("NIXL: could not remove remote agent %s: %s", name, e)

    def close(self) -> None:
        for name in list(self._remotes):
            self.forget(name)
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self._registered = None


def _descriptors(regions, block_ids: Sequence[int], part_bytes: int, device_id: int) -> np.ndarray:
    """``[len(block_ids) * len(regions), 3]`` rows ``(address, part_bytes, device_id)``, block-major,
    in the order of ``regions`` (layer by layer, K then V): both sides of a READ list the same parts."""
    bases = np.array([r[0] for r in regions], dtype=np.uint64)
    strides = np.array([r[1] for r in regions], dtype=np.uint64)
    ids = np.array(list(block_ids), dtype=np.uint64)
    rows = np.empty((len(ids) * len(regions), 3), dtype=np.uint64)
    rows[:, 0] = (bases[None, :] + ids[:, None] * strides[None, :]).reshape(-1)
    rows[:, 1] = part_bytes
    rows[:, 2] = device_id
    return rows
