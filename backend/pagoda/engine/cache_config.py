"""``CacheConfig``: the KV cache's settings (a group of ``EngineConfig``, validated when built).

Block size, storage dtype, the memory budget, prefix caching, and the KV cache groups
(``pagoda.engine.kv.layout``): whether sliding-window layers free their out-of-window
blocks (``kv_cache_layout``), how many recurrent-state slots a hybrid model gets
(``num_state_slots``) and how often its state is checkpointed besides the adaptive
points (``state_checkpoint_interval``, ``pagoda.engine.kv.state_manager``); ``OffloadConfig``:
the tiers below the device (the CPU tier, the disk and shared file tiers). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model dtype; fp8_e4m3: see docs/kernels.md
KV_CACHE_LAYOUTS = ("grouped", "uniform")  # see pagoda.engine.kv.layout
PREEMPTION_MODES = ("auto", "recompute", "swap")  # see pagoda.engine.kv.host_tier


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


@dataclass(frozen=True)
class OffloadConfig:
    """The CPU tier of the KV cache (pagoda.engine.kv.host_tier, docs/kv_offload.md)."""

    cpu_offload_bytes: int
    preemption_mode: str
    offload_copy_bandwidth: Optional[float]
    offload_copy_latency_s: Optional[float]
    prefill_s_per_token: Optional[float]
    kv_disk_dir: Optional[str] = None
    kv_disk_bytes: int = 0
    kv_shared_dir: Optional[str] = None
    kv_write_through: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.cpu_offload_bytes, bool) or not isinstance(self.cpu_offload_bytes, int) \
                or self.cpu_offload_bytes < 0:
            raise ValueError(f"cpu_offload_bytes: must be an integer >= 0 (0 disables), got {self.cpu_offload_bytes!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.cpu_offload_bytes == 0:
            raise ValueError("preemption_mode: 'swap' needs a CPU tier; set cpu_offload_bytes > 0")
        for name in ("offload_copy_bandwidth", "prefill_s_per_token"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 when given, got {value!r}")
        if self.offload_copy_latency_s is not None and not self.offload_copy_latency_s >= 0:
            raise ValueError(f"offload_copy_latency_s: must be >= 0 when given, got {self.offload_copy_latency_s!r}")
        self._check_file_tiers()

    def _check_file_tiers(self) -> None:
        """The disk and shared tiers (engine.kv.file_tier) sit below the CPU tier."""
        if isinstance(self.kv_disk_bytes, bool) or not isinstance(self.kv_disk_bytes, int) or self.kv_disk_bytes < 0:
            raise ValueError(f"kv_disk_bytes: must be an integer >= 0, got {self.kv_disk_bytes!r}")
        if self.kv_disk_dir is not None and self.kv_disk_bytes == 0:
            raise ValueError("kv_disk_bytes: the disk tier needs a size cap > 0 with kv_disk_dir")
        if self.kv_disk_dir is None and self.kv_disk_bytes:
            raise ValueError("kv_disk_bytes: set kv_disk_dir too (the directory the disk tier writes)")
        for name in ("kv_disk_dir", "kv_shared_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}: must be a directory path, got {value!r}")
            if value is not None and self.cpu_offload_bytes == 0:
                raise ValueError(f"{name}: the file tiers are written from and read into the CPU tier; "
                                 "set cpu_offload_bytes > 0")
        if not isinstance(self.kv_write_through, bool):
            raise ValueError(f"kv_write_through: must be a boolean, got {self.kv_write_through!r}")
        if self.kv_write_through and self.kv_disk_dir is None and self.kv_shared_dir is None:
            raise ValueError("kv_write_through: writes freed blocks to the disk or shared tier; set kv_disk_dir "
                             "or kv_shared_dir")
        if self.kv_disk_dir is not None and self.kv_disk_dir == self.kv_shared_dir:
            raise ValueError("kv_shared_dir: must differ from kv_disk_dir (the disk tier evicts its files)")
