"""The paged KV cache: block pool, KV cache manager and the host (CPU) tier bookkeeping (no torch)."""
