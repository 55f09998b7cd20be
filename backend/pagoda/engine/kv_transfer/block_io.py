"""A block's KV as bytes: read from and written into the runner's per-layer caches.

The bytes of block ``b`` are, layer by layer, ``K[b]`` then ``V[b]`` of the runner's caches
(each ``[block_size, num_kv_heads, head_dim]`` contiguous; a multi-head-latent-attention layer's
one latent tensor instead of the pair), in the cache dtype's native
byte order. ``layout`` names everything that must agree between two replicas for those
bytes to mean the same thing (dtype, shape, layer count); the receiver refuses an offer
whose layout differs. Every dtype (fp8 included) is moved as its raw bytes (a ``uint8`` view).

A hybrid model's recurrent-state checkpoint travels beside its blocks (``KVStateIO``): the
bytes of slot ``s`` are, state layer by state layer, ``conv[s]`` then ``ssm[s]``, and its
``layout`` (dtypes, shapes, layer count) must agree too.

Only full, hashed blocks (and cached checkpoints) are read (they are immutable while pinned) and only freshly
allocated, unreferenced blocks are written, so neither races the forward pass on CPU.
On CUDA the copies are synchronous (``.cpu()`` / ``copy_`` on the default stream).
"""

from __future__ import annotations

import torch

from pagoda.engine.runner.host_kv_cache import KVCaches


class KVBlockIO:
    """Args:
    kv_caches: the runner's per-layer (K, V) caches, ``[num_blocks, block_size, heads, dim]``.
    """

    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches
        k = kv_caches[0][0]
        self.block_shape = tuple(k.shape[1:])
        # One block of each cache tensor in order (K then V per layer; a latent cache's one tensor).
        self.part_bytes = [t[0].numel() * t.element_size() for kv in kv_caches for t in kv]
        self.block_bytes = sum(self.part_bytes)
        self.layout = {"dtype": str(k.dtype).removeprefix("torch."), "num_layers": len(kv_caches),
                       "block_shape": list(self.block_shape), "block_bytes": self.block_bytes}

    @classmethod
    def for_runner(cls, runner) -> "KVBlockIO":
        return cls(runner.kv_tensors)

    @torch.inference_mode()
    def read_block(self, block_id: int) -> bytes:
        """Block ``block_id``'s bytes (``block_bytes`` long)."""
        parts = [t[block_id].view(torch.uint8).reshape(-1) for kv in self.kv_caches for t in kv]
        return torch.cat(parts).cpu().numpy().tobytes()

    @torch.inference_mode()
    def write_block(self, block_id: int, data: bytes) -> None:
        """Write ``data`` (from ``read_block`` on a replica of the same layout) into ``block_id``."""
        assert len(data) == self.block_bytes, f"block payload of {len(data)} bytes, expected {self.block_bytes}"
        src = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
        offset = 0
        for t, size in zip((t for kv in self.kv_caches for t in kv), self.part_bytes):
            dst = t[block_id].view(torch.uint8).view(-1)  # contiguous: writes go through to the cache
            dst.copy_(src[offset: offset + size].to(dst.device))
            offset += size


class KVStateIO:
    """Args:
    state_caches: the runner's per-state-layer ``(conv_states, ssm_states)``, slot first.
    """

    def __init__(self, state_caches) -> None:
        self.tensors = [t for cache in state_caches for t in cache]
        self.part_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.slot_bytes = sum(self.part_bytes)
        self.layout = {"state_dtypes": [str(t.dtype).removeprefix("torch.") for t in self.tensors],
                       "state_shapes": [list(t.shape[1:]) for t in self.tensors], "state_bytes": self.slot_bytes}

    @classmethod
    def for_runner(cls, runner) -> "KVStateIO":
        return cls(runner.state_caches)

    @torch.inference_mode()
    def read_slot(self, slot: int) -> bytes:
        """Slot ``slot``'s bytes (``slot_bytes`` long)."""
        parts = [t[slot].view(torch.uint8).reshape(-1) for t in self.tensors]
        return torch.cat(parts).cpu().numpy().tobytes()

    @torch.inference_mode()
    def write_slot(self, slot: int, data: bytes) -> None:
        """Write ``data`` (from ``read_slot`` on a replica of the same layout) into ``slot``."""
        assert len(data) == self.slot_bytes, f"state payload of {len(data)} bytes, expected {self.slot_bytes}"
        src = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
        offset = 0
        for t, size in zip(self.tensors, self.part_bytes):
            dst = t[slot].view(torch.uint8).view(-1)  # a slot's row is contiguous: writes reach the cache
            dst.copy_(src[offset: offset + size].to(dst.device))
            offset += size
