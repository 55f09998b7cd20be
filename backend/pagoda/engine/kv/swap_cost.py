"""The swap-vs-recompute model of the CPU tier (``kv.host_tier``): which is cheaper for a
preempted request to get its KV back.

Per preempted request with ``n`` computed tokens in ``b`` blocks of ``bytes_per_block`` bytes::

    swap      = 2 * (copy_latency_s + b * bytes_per_block / copy_bandwidth)   # out + in
    recompute = n * prefill_s_per_token

Swap when ``swap < recompute``. The fixed latency (launches, synchronisation, per-layer
loop) makes recompute win for short contexts; bandwidth vs prefill speed decides long
ones. Numbers come from ``runner.host_kv_cache.calibrate`` at start or from ``EngineConfig``.
Attention makes true recompute superlinear in ``n``; the linear model is conservative
(it under-estimates recompute for long contexts, i.e. errs towards recompute).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapCostModel:
    """Predicted seconds to restore a preempted request's KV, by swap or by recompute."""

    bytes_per_block: int
    copy_bandwidth_bytes_per_s: float
    copy_latency_s: float
    prefill_s_per_token: float

    def swap_cost(self, num_blocks: int) -> float:
        one_way = self.copy_latency_s + num_blocks * self.bytes_per_block / self.copy_bandwidth_bytes_per_s
        return 2.0 * one_way

    def recompute_cost(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_cost(num_blocks) < self.recompute_cost(num_tokens)
