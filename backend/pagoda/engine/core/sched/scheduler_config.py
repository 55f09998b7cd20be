"""``SchedulerConfig``: the scheduler's limits and features, validated.

Built from the ``EngineConfig`` (``from_engine_config``) once the runner knows how many KV
blocks fit; tests build it directly with tiny caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.sched.policy import get_policy
from pagoda.engine.kv.host_tier import PREEMPTION_MODES
from pagoda.engine.kv.layout import KVCacheLayout, single_group_layout
from pagoda.engine.request import Request


@dataclass
class SchedulerConfig:
    num_blocks: int  # including the reserved null block
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    model_id: str = ""  # seeds the block-hash root
    max_block_events: int = 100_000
    num_host_blocks: int = 0  # CPU tier of the KV cache (kv.host_tier); 0: off
    preemption_mode: str = "auto"  # auto | recompute | swap (needs num_host_blocks > 0)
    default_max_tokens: Optional[int] = None  # cap for max_tokens=None (EngineConfig's)
    max_loras: int = 0  # most distinct LoRA adapters running at once (device slots); 0: LoRA off
    # A waiting request whose next this-many (or more) tokens are being prefilled for
    # another request in the same step waits one step to hit them; 0 disables.
    min_shared_prefix_to_wait: int = 128
    # With chunked prefill, no request gets more than this many tokens in one step (0: no cap
    # but the budget): EngineConfig's, vLLM's long_prefill_token_threshold.
    long_prefill_token_threshold: int = 0
    # Steps in flight (EngineConfig.micro_batches). 1: async scheduling may run one step ahead on
    # placeholders. N > 1 (the batch queue, core.batch_queue): a request with a step not applied
    # yet is not scheduled (nor admitted back after a preemption) until it is, and a step takes
    # at most ceil(min(live requests, max_num_seqs) / N) requests, so N steps share them.
    micro_batches: int = 1
    # KV cache groups and pool sizes (engine.kv.layout, from the runner); None: one full-attention
    # group of num_blocks blocks. num_blocks is the layout's when one is given.
    kv_layout: Optional[KVCacheLayout] = None
    num_host_state_slots: int = 0  # the CPU tier's recurrent-state slots (swaps of hybrid models)
    state_checkpoint_interval: int = 0  # EngineConfig's (kv.state_manager)
    max_num_encoder_tokens: Optional[int] = None  # images' placeholders a step encodes (None: the token budget)

    @property
    def layout(self) -> KVCacheLayout:
        if self.kv_layout is not None:
            return self.kv_layout
        return single_group_layout(self.num_blocks, self.block_size)

    def __post_init__(self) -> None:
        get_policy(self.policy)  # raises ValueError naming the policies
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold: must be >= 0, got {self.long_prefill_token_threshold}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks: must be >= 0, got {self.num_host_blocks}")
        for name in ("num_blocks", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled, or long prompts could never run"
            )

    @classmethod
    def from_engine_config(cls, config: EngineConfig, num_blocks: int, max_model_len: int, model_id: str,
                           num_host_blocks: int = 0, kv_layout: Optional[KVCacheLayout] = None,
                           num_host_state_slots: int = 0) -> "SchedulerConfig":
        sched, cache, lora, offload = config.scheduling, config.cache, config.lora, config.offload
        return cls(
            kv_layout=kv_layout,
            num_host_state_slots=num_host_state_slots,
            state_checkpoint_interval=cache.state_checkpoint_interval,
            num_blocks=kv_layout.num_blocks if kv_layout is not None else num_blocks,
            max_model_len=max_model_len,
            block_size=cache.block_size,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            enable_prefix_caching=cache.enable_prefix_caching,
            policy=sched.scheduling_policy,
            model_id=model_id,
            max_block_events=cache.max_block_events,
            num_host_blocks=num_host_blocks,
            preemption_mode=offload.preemption_mode,
            default_max_tokens=sched.default_max_tokens,
            max_loras=lora.max_loras if lora.enable_lora else 0,
            min_shared_prefix_to_wait=sched.min_shared_prefix_to_wait,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            micro_batches=config.micro_batches,
            max_num_encoder_tokens=sched.max_num_encoder_tokens,
        )

    def resolve_max_tokens(self, request: Request, num_usable_blocks: int) -> int:
        """The request's ``max_tokens`` (``None`` resolved to what ``max_model_len`` leaves, at
        most ``default_max_tokens``) if it can ever run under these limits.

        Raises:
            ValueError: empty prompt, too long for max_model_len, or more KV blocks than
                the whole cache (``num_usable_blocks``).
        """
        cfg = self
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = cfg.max_model_len - prompt_len
            if cfg.default_max_tokens is not None:
                max_tokens = min(max_tokens, cfg.default_max_tokens)
            if max_tokens < 1:
                raise ValueError(
                    f"request {request.request_id!r}: prompt of {prompt_len} tokens leaves no room to generate "
                    f"within max_model_len {cfg.max_model_len}"
                )
        if prompt_len + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {prompt_len} tokens + max_tokens {max_tokens} = "
                f"{prompt_len + max_tokens} exceeds max_model_len {cfg.max_model_len}"
            )
        # Summed over the KV cache groups (a sliding window's bounded by its window and a chunk).
        num_blocks_needed = self.layout.max_blocks_per_request(prompt_len + max_tokens, cfg.max_num_batched_tokens)
        if num_blocks_needed > num_usable_blocks:
            raise ValueError(
                f"request {request.request_id!r}: needs {num_blocks_needed} KV blocks for {prompt_len + max_tokens} "
                f"tokens but the whole cache has {num_usable_blocks}; lower max_tokens"
            )
        return max_tokens
