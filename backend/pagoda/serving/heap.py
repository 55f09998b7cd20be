"""Give a replica's freed heap back to the OS (glibc ``malloc_trim``).

glibc keeps freed memory in its arenas (one per thread that allocates, up to 8 x cores),
returning it only from the top of each heap. An unloaded LoRA adapter's fused tensors are
such memory: under LoRA load/unload churn beside traffic a replica's RSS grew ~0.3 MB per
cycle although nothing leaked (``malloc_trim(0)`` through gdb returned all of it), so
``lora_control`` calls ``release_free_heap`` after each unload, on its loader thread. One
trim of a 1.5 GB heap takes 3-15 ms and briefly locks each arena in turn. (A trim every
30 s as well did not lower the hostile soak's RSS drift further: docs/reliability.md.)
"""

from __future__ import annotations

import ctypes
import ctypes.util


def release_free_heap() -> bool:
    """``malloc_trim(0)``: True when memory went back to the OS; False where there is no glibc."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
