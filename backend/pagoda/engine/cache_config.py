"""``CacheConfig``: the KV cache's settings (a group of ``EngineConfig``, validated when built).

Block size, storage dtype, the memory budget, prefix caching, and the KV cache groups
(``pagoda.engine.kv.layout``): whether sliding-window layers free their out-of-window
blocks (``kv_cache_layout``), how many recurrent-state slots a hybrid model gets
(``num_state_slots``) and how often its state is checkpointed besides the adaptive
points (``state_checkpoint_interval``, ``pagoda.engine.kv.state_manager``). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model dtype; fp8_e4m3: see docs/kernels.md
KV_CACHE_LAYOUTS = ("grouped", "uniform")  # see pagoda.engine.kv.layout


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, storage dtype, memory budget, prefix caching, groups."""

    block_size: int
    kv_cache_dtype: str
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    num_gpu_blocks_override: Optional[int]
    enable_prefix_caching: bool
    max_block_events: int
    kv_cache_layout: str = "grouped"
    num_state_slots: Optional[int] = None
    state_checkpoint_interval: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size: must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes: must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override: must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout: must be one of {KV_CACHE_LAYOUTS}, got {self.kv_cache_layout!r}")
        if self.num_state_slots is not None and (isinstance(self.num_state_slots, bool) or self.num_state_slots < 2):
            raise ValueError(f"num_state_slots: must be >= 2 (the null slot and one sequence's), "
                             f"got {self.num_state_slots!r}")
        interval = self.state_checkpoint_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0 or interval % self.block_size:
            raise ValueError(f"state_checkpoint_interval: must be 0 or a positive multiple of block_size "
                             f"({self.block_size}), got {interval!r}")
