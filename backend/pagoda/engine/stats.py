"""The engine's statistics: ``EngineStats`` (``LLMEngine.get_stats()``, after every step) and
the recent-latency window behind its TTFT fields.

``EngineStats`` is a snapshot of plain values: the server's metrics
(``pagoda.serving.metrics``) and the fleet heartbeat read it; counters only grow.

Recent latencies: what the replica's heartbeat reports and the autoscaler reads.

``LatencyWindow`` keeps the latencies observed in the last ``window_s`` seconds (at most
``max_samples`` of the newest, so a flood costs bounded memory). The engine feeds it each
request's time to first token (``OutputProcessor``); ``EngineStats.ttft_p90`` and
``EngineStats.recent_ttfts`` come from it, and the fleet publisher turns the samples into
histogram bucket counts in the heartbeat, so the operator can compute one P90 over every
replica's recent requests together (``pagoda_operator.autoscaler.FleetLoad``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class EngineStats:
    """What ``LLMEngine.get_stats()`` reports (also importable from ``pagoda.engine.llm_engine``)."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_steps: int
    max_num_running_seen: int
    last_step_num_seqs: int
    last_step_num_decode_seqs: int
    last_step_num_prefill_seqs: int
    last_step_num_tokens: int
    # Pipeline parallelism's batch queue (pagoda.engine.core.batch_queue): the most steps with
    # requests it had in flight at once (1 without it).
    max_steps_in_flight: int = 1
    # Speculative decoding (zero without it); see SpecStats.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # KV offload (zero without a CPU tier); see pagoda.engine.kv.host_tier.
    num_swapped_out: int = 0  # preemptions by swap
    num_swapped_in: int = 0
    num_recomputed_preemptions: int = 0  # preemptions by recompute (with or without the tier)
    prefix_cache_hits_host: int = 0  # tokens, included in prefix_cache_hits
    num_offloaded_blocks: int = 0  # cached blocks evicted from the device, copied to the host
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    # LoRA (vLLM's lora_requests_info): adapters of running / waiting requests, and the slot count.
    running_lora_adapters: tuple = ()
    waiting_lora_adapters: tuple = ()
    max_lora: int = 0
    # The cache configuration as vLLM's ``vllm:cache_config_info`` labels (name, value) pairs,
    # computed once: block_size and num_gpu_blocks are what GIE's prefix scorer reads.
    cache_config_info: tuple = ()
    # Admission control (pagoda.engine.core.load_shedding).
    num_admission_refused: int = 0  # refused at add_request: the waiting queue was full
    num_admission_displaced: int = 0  # waiting requests ended by a more urgent one
    num_deadline_expired: int = 0  # requests ended by their timeout
    # Time to first token over the last 30 s (LatencyWindow below; the fleet heartbeat).
    ttft_p90: float = 0.0
    recent_ttfts: tuple = ()
    # Step timing, seconds summed over steps (see pagoda.engine.runner.device_worker).
    step_host_s: float = 0.0  # host work inside step(), not counting waits on the device
    step_device_s: float = 0.0  # device jobs: KV-tier copies, forward, sampling
    step_device_idle_s: float = 0.0  # the device waiting for the host between steps
    step_wait_s: float = 0.0  # the host blocked waiting for the device
    last_step_host_s: float = 0.0
    last_step_device_s: float = 0.0
    last_step_device_idle_s: float = 0.0


class LatencyWindow:
    def __init__(self, window_s: float = 30.0, max_samples: int = 1024,
                 clock: Callable[[], float] = time.time) -> None:
        assert window_s > 0 and max_samples > 0
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (when, latency)
        self._snapshot: Optional[tuple[float, tuple]] = None
        self._snapshot_time = float("-inf")

    def observe(self, latency: float, now: Optional[float] = None) -> None:
        self._samples.append((self.clock() if now is None else now, max(0.0, latency)))

    def samples(self, now: Optional[float] = None) -> list[float]:
        """Latencies observed within the window, oldest first."""
        now = self.clock() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return [latency for _, latency in self._samples]

    def p90_snapshot(self, max_age_s: float = 0.5) -> tuple[float, tuple]:
        """``(quantile(0.9), samples)``, recomputed at most every ``max_age_s`` seconds: the
        engine asks for stats after every step, the heartbeat reads them once a second, so
        the sort stays off the step's path."""
        now = self.clock()
        if self._snapshot is None or now - self._snapshot_time >= max_age_s:
            values = self.samples(now)
            self._snapshot = (_nearest_rank(sorted(values), 0.9), tuple(values))
            self._snapshot_time = now
        return self._snapshot

    def quantile(self, q: float, now: Optional[float] = None) -> float:
        """The ``q`` quantile (nearest rank) of the window; 0.0 when it is empty."""
        return _nearest_rank(sorted(self.samples(now)), q)


def _nearest_rank(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
