"""The runner's half of the KV cache's file tiers: host rows to block files and back.

``engine.kv.file_tier`` keeps the books and frames the files (no torch); this module owns
what touches tensors:

- **stores**: after a step's device -> host copies (``HostKVCache.execute``), each block in
  ``blocks_to_store`` has its host rows (every KV tensor's row, in ``host_caches`` order, as
  raw bytes) gathered into one flat copy, which a writer thread turns into a file. The step
  pays only that memory copy; files, CRCs and ``fsync``-free renames happen on the thread.
  The queue is bounded: when the writer falls behind, a block is dropped (its reservation
  released, counted in ``num_dropped``), never waited for.
- **loads**: before the host -> device copies, each ``blocks_to_load`` payload (already
  verified by the scheduler's read) is copied into its host block's rows; the copy back to
  the device follows in the same ``execute``.

``kv_fingerprint`` names what a block's bytes mean (``block_file.make_fingerprint``): the
model config, its weight files (names and sizes; the seed of random weights), dtypes,
quantization, block size, every KV tensor's row shape and dtype, and the KV cache groups.

``make_file_tiers`` builds the stores for ``kv_disk_dir`` / ``kv_shared_dir`` and refuses
what does not work yet, naming why: tensor or pipeline parallelism (a step's loads travel in
the scheduler's output, which the step wire to other ranks does not carry), prefix caching
off, and KV cache layouts the tiers cannot serve hits for (``file_tier.check_layout``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from typing import Optional, Sequence

import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.kv.block_file import make_fingerprint
from pagoda.engine.kv.file_tier import BlockFileStore, FileTiers, FileWrite, check_layout

logger = logging.getLogger(__name__)
_STOP = object()


class FileTierIO:
    """Captures stored blocks' rows for the writer thread and fills loaded blocks' rows.

    Args:
        host_caches: the CPU tier's per-layer host tensors (``HostKVCache.host_caches``).
        tiers: the stores and the step's bookkeeping (``kv.file_tier.FileTiers``).
        max_queued_blocks: blocks waiting for the writer before new ones are dropped.
    """

    def __init__(self, host_caches: Sequence[Sequence[torch.Tensor]], tiers: FileTiers,
                 max_queued_blocks: int = 1024) -> None:
        self.tensors = [t for layer in host_caches for t in layer]
        self.tiers = tiers
        self.num_dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued_blocks)
        self._thread = threading.Thread(target=self._write_loop, name="pagoda-kv-file-writer", daemon=True)
        self._thread.start()

    @torch.inference_mode()
    def execute(self, stores: Sequence[tuple[int, FileWrite]], loads: Sequence[tuple[int, bytes]]) -> None:
        """Capture ``stores``' rows (then queue them), then fill ``loads``' rows; both by host block id."""
        for host_block_id, write in stores:
            flat = torch.cat([_bytes_of(t[host_block_id]) for t in self.tensors])
            try:
                self._queue.put_nowait((write, flat))
            except queue.Full:  # never wait on the step's path
                self.num_dropped += 1
                for store in write.stores:
                    store.cancel(write.block_hash)
        for host_block_id, payload in loads:
            source = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            offset = 0
            for t in self.tensors:
                row = _bytes_of(t[host_block_id])
                row.copy_(source[offset:offset + row.numel()])
                offset += row.numel()
            assert offset == len(payload), f"a loaded payload of {len(payload)} bytes, rows take {offset}"

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                write, flat = item
                payload = flat.numpy().tobytes()
                for store in write.stores:
                    store.write(write.block_hash, write.token_ids, payload)
            except Exception:  # a failed write must not stop later ones; the store counted OSErrors
                logger.exception("KV file tier: writing a block failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        self._queue.put(_STOP)
        self._thread.join()


def _bytes_of(row: torch.Tensor) -> torch.Tensor:
    """A contiguous row as a flat uint8 view (fp8 and bf16 included)."""
    return row.reshape(-1).view(torch.uint8)


def kv_fingerprint(runner, model_path: str) -> str:
    """The fingerprint of ``runner``'s KV blocks (see the module docstring)."""
    config = runner.config
    weights = sorted((name, os.path.getsize(os.path.join(model_path, name))) for name in os.listdir(model_path)
                     if name.endswith((".safetensors", ".gguf", ".bin"))) if os.path.isdir(model_path) else []
    return make_fingerprint(dict(
        model_config=dataclasses.asdict(runner.model_config), weights=weights, load_format=config.load_format,
        seed=config.seed if config.load_format == "dummy" else None, dtype=str(runner.dtype),
        kv_dtype=str(runner.kv_dtype), quantization=config.quantization, block_size=runner.block_size,
        tensors=[[list(t.shape[1:]), str(t.dtype)] for layer in runner.kv_tensors for t in layer],
        groups=[[g.spec.kind, list(g.layer_ids)] for g in runner.kv_layout.groups]))


def make_file_tiers(config: EngineConfig, runner, host_caches, model_path: str) -> Optional[FileTierIO]:
    """The disk and shared tiers configured in ``config`` below the CPU tier, or None.

    Raises:
        ValueError: a combination the file tiers do not support (see the module docstring).
    """
    if config.kv_disk_dir is None and config.kv_shared_dir is None:
        return None
    if runner.group is not None:
        raise ValueError("kv_disk_dir/kv_shared_dir: not with tensor or pipeline parallelism yet (a step's loaded "
                         "blocks travel in the scheduler's output, which the step wire to other ranks does not carry)")
    if not config.enable_prefix_caching:
        raise ValueError("kv_disk_dir/kv_shared_dir: need enable_prefix_caching (the tiers hold prefix blocks)")
    check_layout(runner.kv_layout)
    fingerprint = kv_fingerprint(runner, model_path)
    payload_bytes = sum(t[0].numel() * t.element_size() for layer in host_caches for t in layer)
    stores = []
    if config.kv_disk_dir is not None:
        stores.append(BlockFileStore(config.kv_disk_dir, fingerprint, payload_bytes, config.kv_disk_bytes))
    if config.kv_shared_dir is not None:
        stores.append(BlockFileStore(config.kv_shared_dir, fingerprint, payload_bytes, is_shared=True))
    logger.info("KV file tiers: %s, fingerprint %s", ", ".join(f"{s.name} {s.root}" for s in stores), fingerprint)
    return FileTierIO(host_caches, FileTiers(stores, runner.block_size, config.kv_write_through))
