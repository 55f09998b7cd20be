"""Engine configuration: one flat dataclass for users, per-feature groups for the engine.

``EngineConfig`` is what users write (``LLM(max_num_seqs=8)``, ``pagoda serve`` flags,
the CRD's engine settings, the model repository's parameters): every field flat, as vLLM's
engine arguments. The engine reads it through per-feature groups, each a frozen dataclass
that validates its own fields when built: ``config.load`` (model, dtype, device, weights),
``config.cache`` (KV blocks and budget), ``config.scheduling`` (batch limits, policy,
overlap), ``config.speculative``, ``config.offload`` (the CPU tier), ``config.lora`` and
``config.admission`` (waiting-queue bounds) and ``config.guided`` (grammar compile budget). Each
field belongs to exactly one group (a test checks it): a new feature adds its group (``config_groups``),
then its flat fields here. Building an
``EngineConfig`` builds every group, so an invalid value raises ``ValueError`` naming the
field at once; checks that span two groups stay in ``EngineConfig``.

KV memory is a budget: on GPU a fraction of total device memory
(``gpu_memory_utilization``) minus what weights and activations take; on CPU a number of
bytes (``kv_cache_memory_bytes``). The number of blocks follows from the budget and the
model's per-block footprint (see ``ModelRunner``); ``num_gpu_blocks_override`` pins it
(tests use it to force preemption with a tiny cache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, TypeVar

from pagoda.engine.cache_config import (KV_CACHE_DTYPES, KV_CACHE_LAYOUTS, PREEMPTION_MODES,  # noqa: F401 (re-exported)
                                        CacheConfig, OffloadConfig)
from pagoda.engine.config_groups import (MAX_SPECULATIVE_TOKENS, QUANTIZATION_METHODS,  # noqa: F401 (re-exported)
                                         SCHEDULING_POLICIES, SPECULATIVE_METHODS, AdmissionConfig, GuidedConfig,
                                         LoadConfig, LoRAConfig, ParallelConfig, SchedulingConfig, SpeculativeConfig)
from pagoda.engine.multimodal import MultiModalConfig


GROUPS = (LoadConfig, CacheConfig, SchedulingConfig, SpeculativeConfig, OffloadConfig, LoRAConfig, AdmissionConfig,
          GuidedConfig, ParallelConfig, MultiModalConfig)
_Group = TypeVar("_Group")


@dataclass
class EngineConfig:
    model: Optional[str] = None  # a Hugging Face folder; None means the default model
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    # KV cache storage: auto (the model dtype) | fp8_e4m3 (1 byte per value, scale 1.0:
    # twice the tokens of a bf16 cache in the same bytes; docs/kernels.md has the accuracy)
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 2**20  # CPU budget
    gpu_memory_utilization: float = 0.90  # GPU budget, fraction of device memory
    num_gpu_blocks_override: Optional[int] = None
    # KV cache groups (pagoda.engine.kv.layout, docs/engine.md): grouped (sliding-window blocks outside
    # the window reused; recurrent states in slots) | uniform (every attention layer keeps every block)
    kv_cache_layout: str = "grouped"
    num_state_slots: Optional[int] = None  # recurrent-state slots, null slot included (None: 2 per sequence + 1)
    state_checkpoint_interval: int = 0  # tokens between periodic state checkpoints (0: none; kv.state_manager)
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64
    # Cap for requests that leave max_tokens unset (None: what max_model_len leaves, as
    # vLLM); the server sets one so a request nobody waits for cannot run for minutes.
    default_max_tokens: Optional[int] = None
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # A waiting request whose next this-many tokens are being prefilled for another request
    # in the same step waits one step and hits them (bursts sharing a prompt); 0: off.
    min_shared_prefix_to_wait: int = 128
    # Chunked prefill: a request's chunk in one step is at most this many tokens (vLLM's name), so
    # one long prompt cannot take a step's whole budget from the prompts arriving behind it; 0: off.
    long_prefill_token_threshold: int = 0
    seed: int = 0
    max_block_events: int = 100_000  # retained for the fleet layer before the oldest drop
    # Speculative decoding (pagoda.engine.spec_decode, docs/speculative.md).
    speculative_method: Optional[str] = None  # None (off) | draft | ngram (prompt lookup) | eagle3 | mtp
    speculative_model: Optional[str] = None  # draft / EAGLE-3 head / MTP checkpoint folder (mtp: default the target)
    speculative_draft_num_layers: Optional[int] = None  # keep the draft's first N layers (+ its norm and head)
    num_speculative_tokens: int = 4  # the largest window k
    spec_adaptive: bool = True  # adapt k per request and step; False: always num_speculative_tokens
    speculative_by_default: bool = True  # requests with SamplingParams.speculative=None speculate
    quantization: Optional[str] = None  # None | int8 | fp8 (weights only; pagoda.models.quant, .fp8)
    enable_cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA + Triton kernels only)
    load_format: str = "safetensors"  # safetensors | dummy (seeded random weights: benchmarks)
    # Sampling defaults for fields a request leaves unset: auto (the model folder's
    # generation_config.json, as vLLM's) | none (SamplingParams' own). models.config.generation_defaults.
    generation_config: str = "auto"
    # Bind torch's CPU threads, one per CPU (engine.thread_placement): None (unbound) | auto | "0-3".
    cpu_threads_bind: Optional[str] = None
    # Overlap the host's work (scheduling, outputs) with the device's, one step deep
    # (pagoda.engine.core.engine_core). Ignored, with a warning, under speculative decoding.
    async_scheduling: bool = False
    # KV offload (pagoda.engine.kv.host_tier, docs/kv_offload.md): a host-memory tier of the
    # KV cache for preemption by swap and for prefix blocks evicted from the device.
    cpu_offload_bytes: int = 0  # host KV pool size; 0 disables the tier
    preemption_mode: str = "auto"  # auto (cost model) | recompute | swap (needs cpu_offload_bytes)
    # Cost model inputs; None: measured at start (runner.host_kv_cache.calibrate).
    offload_copy_bandwidth: Optional[float] = None  # bytes/s, one direction
    offload_copy_latency_s: Optional[float] = None  # fixed cost of one batched copy
    prefill_s_per_token: Optional[float] = None  # seconds per recomputed token
    # File tiers below the CPU tier (pagoda.engine.kv.file_tier, docs/kv_offload.md): a node-local
    # directory capped at kv_disk_bytes, and a directory shared by replicas. None: off.
    kv_disk_dir: Optional[str] = None
    kv_disk_bytes: int = 0
    kv_shared_dir: Optional[str] = None
    kv_write_through: bool = False  # also write a full cached block when its last request frees it
    # Multi-LoRA (pagoda.engine.lora.manager, docs/lora.md): adapters in PEFT's format.
    enable_lora: bool = False
    max_loras: int = 4  # device adapter slots = most distinct adapters in one step
    max_lora_rank: int = 16  # slots are sized for this rank; larger adapters are refused
    max_cpu_loras: int = 64  # adapters registered (host copies) at once
    lora_modules: dict = field(default_factory=dict)  # name -> PEFT folder, loaded at start
    # Admission control (pagoda.engine.core.load_shedding, docs/reliability.md): past these bounds on
    # the waiting queue a new request is refused at once with an overload error. Sized so a
    # full queue holds ~100 MB of host memory at most, whatever the clients send.
    max_waiting_requests: int = 1024
    max_waiting_prompt_tokens: int = 1_000_000
    # ... and past this expected wait for a running slot, from the replica's measured
    # capacity (max_num_seqs slots, the mean service time of recent requests); 0: off. Off
    # for the engine and LLM; the server turns it on (30 s, pagoda.serving.model_config).
    max_queue_delay_s: float = 0.0
    # Grammar compile budget (pagoda.engine.guided, docs/structured_output.md): compile threads
    # (fair across tenants), the time one compile may take (past it only its requests fail),
    # timed-out compiles still running in C++ before new compiles are refused (overload), and
    # size/complexity limits checked before compiling (a 400 naming the limit).
    guided_compile_workers: int = 2
    guided_compile_timeout_s: float = 30.0
    guided_max_stuck_compiles: int = 2
    # Measured (docs/structured_output.md): a 55 KB schema, an enum of 5,000 strings and
    # [a-z]{1,50000} each compile in under 2 s; what passes these and still compiles slowly
    # meets guided_compile_timeout_s.
    guided_max_spec_chars: int = 65_536
    guided_max_schema_properties: int = 256
    guided_max_schema_depth: int = 32  # nesting of the schema document's objects and arrays
    guided_max_regex_chars: int = 1_000  # a regex, or a schema's "pattern"
    guided_max_length_bound: int = 65_536  # sum of bounded repetitions, nested ones multiplied
    # Tensor parallelism (pagoda.engine.parallel, docs/parallelism.md): ranks in this replica
    # (rank 0 is this process, the others spawned workers), and how long a collective waits
    # for a silent peer before the step fails.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 300.0
    # Several nodes (docs/parallelism.md): this engine is node 0 and opens the group's store on
    # the port of tensor_parallel_leader (HOST:PORT, the address the other nodes' `pagoda serve
    # --node-rank R` connect to); its own node runs world_size / nodes ranks (TP x PP).
    tensor_parallel_nodes: int = 1
    tensor_parallel_leader: Optional[str] = None
    # Pipeline parallelism (docs/parallelism.md): the layers cut into this many stages of
    # tensor_parallel_size ranks each (rank 0 this process: embedding and the first layers;
    # the last stage: the LM head).
    pipeline_parallel_size: int = 1
    # Steps in flight through the stages (vLLM v1's batch queue, pagoda.engine.core.batch_queue; TP x PP too):
    # None: pipeline_parallel_size (also the most); 1: one step at a time (async_scheduling
    # applies); > 1: rank 0 issues a step before the previous ones' logits are back
    # (async_scheduling is then ignored, with a warning).
    pipeline_micro_batches: Optional[int] = None
    # Images (docs/multimodal.md): per prompt, pixels of one image as sent, and the encoder
    # cache's bytes (image embeddings by content hash, LRU; engine/runner/encoder_cache.py).
    limit_images_per_prompt: int = 4
    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 20 * 2**20  # one encoded image as sent (a door's decoded base64 / data URL)
    mm_encoder_cache_bytes: int = 256 * 2**20
    max_num_encoder_tokens: Optional[int] = None  # image placeholders encoded per step (None: max_num_batched_tokens)

    def __post_init__(self) -> None:
        for group in GROUPS:  # each validates its own fields
            self._group(group)
        if self.enable_lora and self.speculative_method is not None:
            raise ValueError("enable_lora: speculative decoding with LoRA adapters is not supported yet; "
                             "turn one of them off")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) > 1 and self.cpu_threads_bind is not None:
                raise ValueError(f"cpu_threads_bind: not supported with {name} > 1 yet (each rank would bind "
                                 "the same CPUs)")
            if getattr(self, name) > 1 and self.speculative_method in ("draft", "eagle3", "mtp"):
                raise ValueError(f"speculative_method: {self.speculative_method!r} is not supported with "
                                 f"{name} > 1 yet; use 'ngram' or turn one of them off")

    @property
    def world_size(self) -> int:
        """Ranks (processes) in this replica: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def micro_batches(self) -> int:
        """Steps in flight: ``pipeline_micro_batches``, resolved (None: one per stage)."""
        if self.pipeline_micro_batches is not None:
            return self.pipeline_micro_batches
        return self.pipeline_parallel_size

    def _group(self, cls: type[_Group]) -> _Group:
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    # The groups, built from the current flat values (fields may be set after construction).
    @property
    def load(self) -> LoadConfig:
        return self._group(LoadConfig)

    @property
    def cache(self) -> CacheConfig:
        return self._group(CacheConfig)

    @property
    def scheduling(self) -> SchedulingConfig:
        return self._group(SchedulingConfig)

    @property
    def speculative(self) -> SpeculativeConfig:
        return self._group(SpeculativeConfig)

    @property
    def offload(self) -> OffloadConfig:
        return self._group(OffloadConfig)

    @property
    def lora(self) -> LoRAConfig:
        return self._group(LoRAConfig)

    @property
    def admission(self) -> AdmissionConfig:
        return self._group(AdmissionConfig)

    @property
    def guided(self) -> GuidedConfig:
        return self._group(GuidedConfig)

    @property
    def parallel(self) -> ParallelConfig:
        return self._group(ParallelConfig)

    @property
    def multimodal(self) -> MultiModalConfig:
        return self._group(MultiModalConfig)
