"""The engine's statistics: ``EngineStats`` (``LLMEngine.get_stats()``, after every step) and
the recent-latency window behind its TTFT fields.

``EngineStats`` is a snapshot of plain values: the server's metrics
(``pagoda.serving.metrics``) and the fleet heartbeat read it; counters only grow.
``collect_stats(engine)`` reads it off an ``LLMEngine``'s parts (scheduler, runner, output
processor, admission, speculator, host tier), so the facade holds no reporting code.

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
from typing import Any, Callable, Optional


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
    num_offloaded_states: int = 0  # state checkpoints evicted from the device, copied to the host
    num_host_state_restores: int = 0  # requests that resumed a host state checkpoint (kv.host_states)
    # Images (engine/runner/encoder_cache.py; zero for a text-only model): encoder runs, asks
    # answered from the encoder cache (an image sent again, a later chunk of one), bytes kept.
    mm_encoder_runs: int = 0
    mm_encoder_cache_hits: int = 0
    mm_encoder_cache_bytes: int = 0
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    # File tiers below the CPU tier (zero without; pagoda.engine.kv.file_tier): tokens of blocks
    # loaded from the disk / shared tier into the CPU tier (then served as host hits), blocks
    # written, the disk tier's files, and files refused (truncated, corrupt, foreign: recomputed).
    prefix_cache_hits_disk: int = 0
    prefix_cache_hits_shared: int = 0
    num_disk_blocks_written: int = 0
    num_shared_blocks_written: int = 0
    num_disk_files: int = 0
    num_rejected_block_files: int = 0
    kv_shared_tier_id: str = ""  # the shared tier's id (file_tier.shared_tier_id; the heartbeat's shared_tier)
    # Recurrent states of a hybrid model (zero without; pagoda.engine.kv.state_manager): requests
    # that resumed a state checkpoint instead of recomputing their prefix, the tokens skipped so,
    # checkpoint copies taken, and the state pool (null slot excluded).
    num_state_restores: int = 0
    num_state_restored_tokens: int = 0
    num_state_checkpoints: int = 0
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    # LoRA (vLLM's lora_requests_info): adapters of running / waiting requests, and the slot count.
    running_lora_adapters: tuple = ()
    waiting_lora_adapters: tuple = ()
    max_lora: int = 0
    # The cache configuration as vLLM's ``vllm:cache_config_info`` labels (name, value) pairs,
    # computed once: block_size and num_gpu_blocks are what GIE's prefix scorer reads.
    cache_config_info: tuple = ()
    # Text prompts the engine encoded (a router's token ids are used as they are; input_processor).
    num_prompts_tokenized: int = 0
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


def collect_stats(engine: Any) -> EngineStats:
    """The ``EngineStats`` of an ``LLMEngine`` now (it is given whole: this module sits below
    the core, which names ``EngineStats`` in its protocols)."""
    core, s, runner = engine.core, engine.core.scheduler, engine.runner
    last, total = core.timer.snapshot()
    ttft_p90, recent_ttfts = engine.output_processor.recent_ttfts.p90_snapshot()
    return EngineStats(
        num_waiting=s.num_waiting + core.num_pending + core.guided.num_waiting,
        num_running=s.num_running,
        kv_cache_usage=s.kv_cache_usage,
        num_blocks=runner.num_blocks - 1,  # block 0 is the pool's reserved null block
        num_free_blocks=s.num_free_blocks,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions_total,
        num_prompt_tokens=engine.output_processor.num_prompt_tokens,
        num_generation_tokens=engine.output_processor.num_generation_tokens,
        num_steps=core.num_steps, max_steps_in_flight=core.max_in_flight,
        max_num_running_seen=core.max_num_running_seen,
        last_step_num_seqs=core.last_step[0],
        last_step_num_decode_seqs=core.last_step[1],
        last_step_num_prefill_seqs=core.last_step[2],
        last_step_num_tokens=core.last_step[3],
        num_recomputed_preemptions=s.num_recomputed_preemptions,
        num_prompts_tokenized=engine.input_processor.num_prompts_tokenized,
        step_host_s=total.host_s, step_device_s=total.device_s, step_device_idle_s=total.device_idle_s,
        step_wait_s=total.wait_s, last_step_host_s=last.host_s, last_step_device_s=last.device_s,
        last_step_device_idle_s=last.device_idle_s,
        **_spec_stats(engine.speculator),
        **_offload_stats(s.host_tier), **s.kv_cache_manager.state_stats(),
        **_lora_stats(engine), **_mm_stats(runner),
        **engine.admission.stats(),
        ttft_p90=ttft_p90, recent_ttfts=recent_ttfts, cache_config_info=_cache_config_info(engine),
    )


def _mm_stats(runner: Any) -> dict:
    cache = runner.mm.cache if getattr(runner, "mm", None) is not None else None
    if cache is None:
        return {}
    return dict(mm_encoder_runs=cache.num_encoded, mm_encoder_cache_hits=cache.num_hits,
                mm_encoder_cache_bytes=cache.num_bytes)


def _cache_config_info(engine: Any) -> tuple:
    """vLLM's ``cache_config_info`` labels (strings, as vLLM's ``metrics_info``)."""
    c = engine.config
    values = dict(block_size=c.block_size, cache_dtype=c.kv_cache_dtype,
                  enable_prefix_caching=c.enable_prefix_caching,
                  gpu_memory_utilization=c.gpu_memory_utilization,
                  num_gpu_blocks=engine.runner.num_blocks - 1,
                  num_cpu_blocks=engine.core.scheduler.host_tier.num_blocks)
    return tuple((name, str(value)) for name, value in values.items())


def _lora_stats(engine: Any) -> dict:
    if engine.runner.lora is None:
        return {}
    s = engine.core.scheduler
    return dict(running_lora_adapters=tuple(sorted({r.adapter_id for r in s.running if r.adapter_id})),
                waiting_lora_adapters=tuple(sorted({r.adapter_id for r in engine.core.queued_requests()
                                                    if r.adapter_id})),
                max_lora=engine.config.max_loras)


def _offload_stats(tier: Any) -> dict:
    """The CPU tier's counters (``NoHostTier``: all zero)."""
    return dict(num_swapped_out=tier.num_swapped_out, num_swapped_in=tier.num_swapped_in,
                prefix_cache_hits_host=tier.prefix_cache_hits_host,
                num_offloaded_blocks=tier.num_offloaded_blocks,
                num_offloaded_states=tier.states.num_offloaded, num_host_state_restores=tier.states.num_restored,
                num_host_blocks=tier.num_blocks, num_free_host_blocks=tier.num_free_blocks,
                **(tier.file_tiers.stats() if getattr(tier, "file_tiers", None) is not None else {}))


def _spec_stats(speculator: Any) -> dict:
    if speculator is None:
        return {}
    st = speculator.stats
    return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                spec_num_accepted_tokens=st.num_accepted_tokens)


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
