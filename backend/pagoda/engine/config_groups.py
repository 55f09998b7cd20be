"""The engine's per-feature configuration groups (``engine.config``'s docstring): each a frozen
dataclass of some of ``EngineConfig``'s flat fields that validates them when built, raising a
``ValueError`` naming the field. ``config.load`` (model, dtype, device, weights, CPU threads),
``config.scheduling``, ``config.speculative``, ``config.lora``, ``config.admission``,
``config.guided`` and ``config.parallel`` live here; the KV groups in ``cache_config``, the image
limits in ``multimodal``. This module, like the scheduler that imports it, stays free of torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from pagoda.engine.thread_placement import check_spec as check_cpu_threads_bind

SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("draft", "ngram", "eagle3", "mtp")
MAX_SPECULATIVE_TOKENS = 16
# Mirrors pagoda.models.quant.QUANTIZATION_METHODS (a test keeps them equal); repeated
# here because this module, like the scheduler that imports it, stays free of torch.
QUANTIZATION_METHODS = ("int8", "fp8", "w8a8")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class LoadConfig:
    """Which model, in which dtype, on which device, with which weights."""

    model: Optional[str]
    dtype: str
    device: str
    quantization: Optional[str]
    load_format: str
    seed: int
    enable_cuda_graphs: bool
    generation_config: str
    cpu_threads_bind: Optional[str]

    def __post_init__(self) -> None:
        check_cpu_threads_bind(self.cpu_threads_bind)
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config: must be auto or none, got {self.generation_config!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype: must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format: must be safetensors or dummy, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: must be None or one of {QUANTIZATION_METHODS}, got {self.quantization!r}")


@dataclass(frozen=True)
class SchedulingConfig:
    """The batch each step may hold, the queue policy, and the overlapped loop."""

    max_model_len: Optional[int]
    max_num_seqs: int
    default_max_tokens: Optional[int]
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    scheduling_policy: str
    min_shared_prefix_to_wait: int
    async_scheduling: bool
    max_num_encoder_tokens: Optional[int]
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_encoder_tokens is not None and self.max_num_encoder_tokens < 1:
            raise ValueError(f"max_num_encoder_tokens: must be >= 1 when given, got {self.max_num_encoder_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens: must be >= 1 when given, got {self.default_max_tokens}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold: must be >= 0 (0: off), got "
                             f"{self.long_prefill_token_threshold}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (pagoda.engine.spec_decode, docs/speculative.md)."""

    speculative_method: Optional[str]
    speculative_model: Optional[str]
    speculative_draft_num_layers: Optional[int]
    num_speculative_tokens: int
    spec_adaptive: bool
    speculative_by_default: bool

    @property
    def is_enabled(self) -> bool:
        return self.speculative_method is not None

    def __post_init__(self) -> None:
        method = self.speculative_method
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: must be None or one of {SPECULATIVE_METHODS}, got {method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens: must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.speculative_draft_num_layers is not None and self.speculative_draft_num_layers < 1:
            raise ValueError(f"speculative_draft_num_layers: must be >= 1, got {self.speculative_draft_num_layers}")
        has_draft = self.speculative_model is not None or self.speculative_draft_num_layers is not None
        if method == "draft" and not has_draft:
            raise ValueError("speculative_method 'draft' needs speculative_model (a draft folder) and/or "
                             "speculative_draft_num_layers (the first N layers of the target as the draft)")
        if method == "eagle3" and self.speculative_model is None:
            raise ValueError("speculative_method 'eagle3' needs speculative_model (the EAGLE-3 head's folder)")
        if method != "draft" and self.speculative_draft_num_layers is not None:
            raise ValueError("speculative_draft_num_layers is only used with speculative_method='draft'")
        if method in (None, "ngram") and self.speculative_model is not None:
            raise ValueError("speculative_model is only used with speculative_method 'draft', 'eagle3' or 'mtp'")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (pagoda.engine.lora, docs/lora.md): adapters in PEFT's format."""

    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_modules: dict

    def __post_init__(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: adapters were given but enable_lora is False")
        if not self.enable_lora:
            return
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            _check_int(name, getattr(self, name), 1)
        if self.max_lora_rank > 256:
            raise ValueError(f"max_lora_rank: must be <= 256, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not isinstance(self.lora_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.lora_modules.items()):
            raise ValueError("lora_modules: must map adapter names to folder paths (non-empty strings)")


@dataclass(frozen=True)
class AdmissionConfig:
    """Bounds on the waiting queue (pagoda.engine.core.load_shedding, docs/reliability.md)."""

    max_waiting_requests: int
    max_waiting_prompt_tokens: int
    max_queue_delay_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_waiting_prompt_tokens"):
            _check_int(name, getattr(self, name), 1)
        delay = self.max_queue_delay_s
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < float("inf"):
            raise ValueError(f"max_queue_delay_s: must be a number of seconds >= 0 (0: off), got {delay!r}")


@dataclass(frozen=True)
class GuidedConfig:
    """Grammar compile budget (pagoda.engine.guided.pool and .limits, docs/structured_output.md)."""

    guided_compile_workers: int
    guided_compile_timeout_s: float
    guided_max_stuck_compiles: int
    guided_max_spec_chars: int
    guided_max_schema_properties: int
    guided_max_schema_depth: int
    guided_max_regex_chars: int
    guided_max_length_bound: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "guided_compile_timeout_s":
                _check_int(f.name, getattr(self, f.name), 1)
        timeout = self.guided_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"guided_compile_timeout_s: must be a number > 0, got {timeout!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism inside the replica (pagoda.engine.parallel, docs/parallelism.md)."""

    tensor_parallel_size: int
    tensor_parallel_timeout_s: float
    tensor_parallel_nodes: int
    tensor_parallel_leader: Optional[str]
    pipeline_parallel_size: int
    pipeline_micro_batches: Optional[int]

    def __post_init__(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.pipeline_micro_batches is not None:
            _check_micro_batches(self.pipeline_micro_batches, self.pipeline_parallel_size)
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s: must be > 0, got {self.tensor_parallel_timeout_s!r}")
        _check_int("tensor_parallel_nodes", self.tensor_parallel_nodes, 1)
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world % self.tensor_parallel_nodes:
            raise ValueError(f"tensor_parallel_nodes: tensor_parallel_size={self.tensor_parallel_size} x "
                             f"pipeline_parallel_size={self.pipeline_parallel_size} = {world} ranks is not a "
                             f"multiple of {self.tensor_parallel_nodes} (each node runs the same number of ranks)")
        if self.tensor_parallel_nodes > 1:
            host, _, port = (self.tensor_parallel_leader or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("tensor_parallel_leader: with tensor_parallel_nodes > 1, the HOST:PORT where this "
                                 f"engine (node 0) opens the group's store, got {self.tensor_parallel_leader!r}")


def _check_micro_batches(micro_batches: int, pp: int) -> None:
    _check_int("pipeline_micro_batches", micro_batches, 1)
    if micro_batches > 1 and pp == 1:
        raise ValueError(f"pipeline_micro_batches={micro_batches}: steps in flight need pipeline_parallel_size > 1 "
                         "(one device runs one step at a time); leave it unset or set 1")
    if micro_batches > pp:
        raise ValueError(f"pipeline_micro_batches={micro_batches}: at most pipeline_parallel_size={pp} (a step "
                         "per stage keeps every stage busy; more would only queue)")
