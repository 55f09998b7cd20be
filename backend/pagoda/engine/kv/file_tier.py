"""The KV cache's file tiers below the CPU tier: a node-local disk tier and a shared tier.

Pure Python (no torch): this module keeps the books and reads and writes whole block files
(``kv.block_file``'s format); the runner (``runner.file_tier_io``) turns host rows into
payload bytes and back, and writes on its own thread.

``BlockFileStore`` is one directory, ``<dir>/<fingerprint>/<block hash hex>.kvb``:

- **disk** (``is_shared=False``): this engine's own, capped at ``max_bytes``; evicted by
  recency (a hit refreshes a block, also its file's mtime, so the order survives a
  restart); at start its index is rebuilt from the directory listing (warm restart):
  oldest mtime first, leftover temporary files of a killed writer deleted.
- **shared** (``is_shared=True``): a directory several replicas mount (a PVC, NFS). Blocks
  are named by their content (the chained block hash names the whole prefix) under the
  fingerprint, written once (a block already there is not rewritten) through a temporary
  file and an atomic ``os.replace``, so a reader sees a whole file or none. Other replicas
  add files at any time: a miss in the in-memory index is checked with one ``stat``. No
  cap: pagoda never deletes another replica's good files (size the volume; a full volume
  fails writes, which are counted and dropped).

A read verifies the file (``block_file.decode_block``) before anything is counted: a
truncated, corrupted, foreign or misnamed file is counted by reason, deleted and reported
as a miss, so the prefix is recomputed, never served. A file deleted under a reader is a
plain miss.

``FileTiers`` is the CPU tier's view of the stores (``KVOffloadManager`` holds it): which
blocks entering the CPU tier still need writing (write-through: a block is written when it
enters the CPU tier, so a restart finds what the CPU tier held; SGLang HiCache's default
policy), the step's writes and loads keyed by host block (a host block reused within the
step cancels them: its rows no longer hold that block), and ``promote``: a prefix lookup
that ran past the CPU tier continues in the stores, in order (disk, then shared), and each
verified block found is loaded into a fresh host block under its hash, from where the
usual copy back moves it to the device.

KV events (``emit_events``): a written file is a ``BlockStored`` with medium ``"DISK"`` or
``"SHARED"`` (vLLM's field), a disk file evicted or refused a ``BlockRemoved`` with medium
``"DISK"``; emitted from the writer thread into the thread-safe ``KVEventBuffer``. The
vLLM-format stream carries them all; the fleet's Redis index skips ``DISK`` (a node-local file
is this replica's alone and not a device hit) and indexes ``SHARED`` under the shared tier's id
(``shared_tier_id``: the volume's id and the fingerprint), which the replica's heartbeat
announces, so a router credits those blocks to every replica mounting the tier.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional, Sequence

from pagoda.contracts.block_hash import BlockHash
from pagoda.contracts.kv_events import BlockRemoved, BlockStored, KVEventBuffer
from pagoda.engine.kv.block_file import (REJECT_REASONS, SUFFIX, BlockFileError, decode_block, encode_block,
                                         file_name)

logger = logging.getLogger(__name__)
_TMP = ".tmp-"


class BlockFileStore:
    """One directory of block files (see the module docstring). Thread-safe: the scheduler
    reads, the runner's writer thread writes.

    Args:
        directory: the tier's root; files go under ``directory/fingerprint``.
        fingerprint: ``block_file.make_fingerprint`` of this engine.
        payload_bytes: bytes of one block's payload (every KV tensor's row).
        max_bytes: cap on the files' bytes (disk tier); 0: no cap (shared tier).
        is_shared: the shared tier (see the module docstring).
    """

    def __init__(self, directory: str, fingerprint: str, payload_bytes: int, max_bytes: int = 0,
                 is_shared: bool = False) -> None:
        self.payload_bytes = payload_bytes
        self.name = "shared" if is_shared else "disk"
        self.fingerprint = fingerprint
        self.root = os.path.join(directory, fingerprint)
        self.max_bytes = max_bytes
        self.is_shared = is_shared
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # hash hex -> file bytes, least recent first
        self._pending: set[str] = set()  # reserved for a write not finished yet
        self.num_bytes = 0
        self.num_written = self.num_loaded = self.num_write_errors = self.num_evicted = 0
        self.num_rejected = dict.fromkeys(REJECT_REASONS, 0)
        # Told (hash, token ids) after a file is written, (hash) after one is evicted or refused: KV events.
        self.on_stored: Optional[Callable[[BlockHash, Sequence[int]], None]] = None
        self.on_removed: Optional[Callable[[BlockHash], None]] = None
        # The shared tier's identity in the fleet's prefix index: replicas announcing the same id load
        # each other's files (same volume, same fingerprint); "" for the disk tier.
        self.tier_id = shared_tier_id(directory, fingerprint) if is_shared else ""
        self._scan()

    def _scan(self) -> None:
        """Rebuild the index from the directory (warm restart), least recently used first."""
        entries = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(_TMP) and not self.is_shared:  # a killed writer's leftover
                _remove(entry.path)
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                stat = entry.stat()
                entries.append((stat.st_mtime, entry.name[:-len(SUFFIX)], stat.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self.num_bytes += size
        with self._lock:
            self._evict_over_cap()
        if entries:
            logger.info("KV %s tier: %d block files (%d bytes) found in %s", self.name, len(self._index),
                        self.num_bytes, self.root)

    @property
    def num_files(self) -> int:
        return len(self._index)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key + SUFFIX)

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the tier has the block (shared: another replica's new file counts too)."""
        key = block_hash.hex()
        with self._lock:
            if key in self._index:
                return True
        if self.is_shared and os.path.exists(self._path(key)):
            with self._lock:
                self._index.setdefault(key, 0)
            return True
        return False

    def reserve(self, block_hash: BlockHash) -> bool:
        """Claim a write of the block: False when it is here or being written already."""
        key = block_hash.hex()
        with self._lock:
            if key in self._pending or key in self._index:
                return False
        if self.is_shared and self.contains(block_hash):
            return False
        with self._lock:
            self._pending.add(key)
        return True

    def cancel(self, block_hash: BlockHash) -> None:
        """Drop a reserved write that will not happen."""
        with self._lock:
            self._pending.discard(block_hash.hex())

    def write(self, block_hash: BlockHash, token_ids: Sequence[int], payload: bytes) -> bool:
        """Write a reserved block (the runner's writer thread). Returns whether it was written."""
        key = block_hash.hex()
        data = encode_block(self.fingerprint, block_hash, token_ids, payload)
        tmp = os.path.join(self.root, f"{_TMP}{os.getpid()}-{threading.get_ident()}-{key}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))  # atomic: readers see the whole file or none
        except OSError as exc:
            _remove(tmp)
            logger.warning("KV %s tier: writing a block failed (%s); it stays uncached there", self.name, exc)
            with self._lock:
                self._pending.discard(key)
                self.num_write_errors += 1
            return False
        with self._lock:
            self._pending.discard(key)
            self._index[key] = len(data)
            self.num_bytes += len(data)
            self.num_written += 1
            evicted = self._evict_over_cap()
        if self.on_stored is not None:
            self.on_stored(block_hash, token_ids)
        self._tell_removed(evicted)
        return True

    def _evict_over_cap(self) -> list[str]:
        """Delete least recently used files until the bytes fit the cap (lock held); their keys."""
        evicted = []
        while self.max_bytes and self.num_bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.num_bytes -= size
            self.num_evicted += 1
            _remove(self._path(key))
            evicted.append(key)
        return evicted

    def _tell_removed(self, keys: Sequence[str]) -> None:
        if self.on_removed is not None:
            for key in keys:
                self.on_removed(BlockHash(bytes.fromhex(key)))

    def read(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Optional[bytes]:
        """The verified payload of the block, or None (a miss, or a file rejected and deleted)."""
        if not self.contains(block_hash):
            return None
        key = block_hash.hex()
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            payload = decode_block(data, self.fingerprint, block_hash, token_ids)
            if len(payload) != self.payload_bytes:
                raise BlockFileError("mismatch", f"{len(payload)} payload bytes, a block has {self.payload_bytes}")
        except FileNotFoundError:  # evicted or deleted meanwhile
            self._forget(key)
            return None
        except BlockFileError as exc:
            logger.warning("KV %s tier: rejected %s (%s); deleted, the prefix is recomputed", self.name, path, exc)
            _remove(path)
            self._forget(key)
            with self._lock:
                self.num_rejected[exc.reason] += 1
            self._tell_removed([key])
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.num_loaded += 1
        if not self.is_shared:
            _touch(path)
        return payload

    def _forget(self, key: str) -> None:
        with self._lock:
            self.num_bytes -= self._index.pop(key, 0)


VOLUME_ID_FILE = "pagoda-volume-id"


def shared_tier_id(directory: str, fingerprint: str) -> str:
    """16 hex digits naming (this shared volume, this fingerprint) alike on every replica mounting it.

    The volume's id is a random one kept in ``directory/pagoda-volume-id``, created once: linked
    into place whole (``os.link`` fails if another replica's is there; that one is read). A path
    would not do: pods mount one volume under different paths, and two nodes' ``hostPath`` of one
    path are different volumes.
    """
    path = os.path.join(directory, VOLUME_ID_FILE)
    if not os.path.exists(path):
        tmp = os.path.join(directory, f"{_TMP}{os.getpid()}-{threading.get_ident()}-volume-id")
        with open(tmp, "w") as f:
            f.write(os.urandom(8).hex())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another replica created it first
        finally:
            _remove(tmp)
    with open(path) as f:
        volume = f.read().strip()
    return hashlib.sha256(f"{volume}:{fingerprint}".encode()).hexdigest()[:16]


def emit_events(tiers: FileTiers, event_buffer: KVEventBuffer, block_size: int) -> None:
    """Publish the stores' writes (and the disk tier's removals) as KV events with their medium."""
    for store in tiers.stores:
        medium = store.name.upper()  # "DISK" | "SHARED" (contracts.kv_events.MEDIA)
        store.on_stored = lambda h, tokens, m=medium: event_buffer.emit(
            BlockStored([h.hex()], None, list(tokens), block_size, medium=m))
        if not store.is_shared:  # a shared file outlives this replica's view of it: never "removed" by it
            store.on_removed = lambda h, m=medium: event_buffer.emit(BlockRemoved([h.hex()], medium=m))


def check_layout(layout) -> None:
    """Refuse a KV cache layout the file tiers cannot serve hits for.

    Raises:
        ValueError: more than one paged KV cache group, or recurrent-state layers.
    """
    if len(layout.paged_groups) != 1 or layout.state_group is not None:
        raise ValueError("kv_disk_dir/kv_shared_dir: the file tiers hold prefix blocks of models with one "
                         "full-attention (or latent) KV cache group and no recurrent-state layers; this model has "
                         f"{len(layout.paged_groups)} paged group(s) and {'a' if layout.state_group else 'no'} state "
                         "group, whose hits need sliding windows' blocks or state checkpoints the tiers do not store")


class FileWrite(NamedTuple):
    """A block to write from a host block's rows, and the stores that reserved it."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    stores: tuple[BlockFileStore, ...]


class FileTiers:
    """The file stores below a CPU tier, in lookup order, and this step's writes and loads.

    Args:
        stores: disk first, then shared (either may be absent).
        block_size: tokens per block.
        write_through: write a cached block also when its last request frees it, not only when
            the device evicts it (``EngineConfig.kv_write_through``; ``kv_cache_manager`` wires it).
    """

    def __init__(self, stores: Sequence[BlockFileStore], block_size: int, write_through: bool = False) -> None:
        assert stores, "FileTiers needs at least one store"
        self.stores = tuple(stores)
        self.block_size = block_size
        self.write_through = write_through  # also when a block's last request frees it (kv_write_through)
        self._writes: dict[int, FileWrite] = {}  # host block id -> what its rows are written as
        self._loads: dict[int, bytes] = {}  # host block id -> verified payload to fill it with
        self.loaded_tokens = {store.name: 0 for store in self.stores}

    def record_write(self, host_block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """A block entered the CPU tier in ``host_block_id``: write it where it is missing."""
        stores = tuple(store for store in self.stores if store.reserve(block_hash))
        if stores:
            self._writes[host_block_id] = FileWrite(block_hash, token_ids, stores)

    def cancel(self, host_block_id: int) -> None:
        """``host_block_id`` is reused this step: its pending write or load no longer applies."""
        self._loads.pop(host_block_id, None)
        write = self._writes.pop(host_block_id, None)
        if write is not None:
            for store in write.stores:
                store.cancel(write.block_hash)

    def promote(self, pool, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int,
                end: int) -> list:
        """Load blocks ``start..end-1`` (stopping at the first miss) from the stores into host blocks.

        Args:
            pool: the CPU tier's ``HostBlockPool``.
            block_hashes, token_ids: the request's.
            start, end: block indices to try.

        Returns:
            The host blocks now holding them (cached under their hashes; filled this step).
        """
        size = self.block_size
        promoted = []
        for i in range(start, end):
            if pool.num_free_blocks == 0:
                break
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            found = self._find(block_hashes[i], tokens)
            if found is None:
                break
            block = pool.store_cached(block_hashes[i], tokens)
            if block is None:
                break
            pool.touch([block])  # not the next promotion's victim
            self._loads[block.block_id] = found[0]
            self.loaded_tokens[found[1]] += size
            promoted.append(block)
        pool.free(promoted)
        return promoted

    def _find(self, block_hash: BlockHash, tokens: tuple[int, ...]) -> Optional[tuple[bytes, str]]:
        for store in self.stores:
            payload = store.read(block_hash, tokens)
            if payload is not None:
                return payload, store.name
        return None

    def take(self) -> tuple[list[tuple[int, FileWrite]], list[tuple[int, bytes]]]:
        """This step's (writes, loads) by host block id; clears them."""
        writes, loads = list(self._writes.items()), list(self._loads.items())
        self._writes, self._loads = {}, {}
        return writes, loads

    def stats(self) -> dict[str, int | str]:
        """Counters for ``EngineStats`` (tokens loaded, blocks written, files rejected, files held), and
        the shared tier's id (``shared_tier_id``; the fleet heartbeat announces it)."""
        by_name = {store.name: store for store in self.stores}
        disk, shared = by_name.get("disk"), by_name.get("shared")
        return dict(prefix_cache_hits_disk=self.loaded_tokens.get("disk", 0),
                    prefix_cache_hits_shared=self.loaded_tokens.get("shared", 0),
                    num_disk_blocks_written=disk.num_written if disk else 0,
                    num_shared_blocks_written=shared.num_written if shared else 0,
                    num_disk_files=disk.num_files if disk else 0,
                    num_rejected_block_files=sum(sum(s.num_rejected.values()) for s in self.stores),
                    kv_shared_tier_id=shared.tier_id if shared else "")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
