"""ModelRunner: owns device memory (weights and the paged KV cache) and runs one step.

The KV cache follows the model's KV cache groups (``engine.kv.layout``, allocated by
``runner.kv_allocation``): preallocated K/V tensor pairs ``[num_blocks, block_size,
num_kv_heads, head_dim]``, one per layer of a model whose layers are alike (each shared by
one layer of every group when sliding-window and full-attention layers keep separate block
tables), and a ``StateCache`` per linear-attention layer; sized from the memory budget in
``EngineConfig``: on CPU ``kv_cache_memory_bytes``; on GPU ``gpu_memory_utilization`` of
the device's memory minus what the weights took and a reserve for activations.
``kv_caches`` is per layer (what the model reads), ``kv_tensors`` the distinct pairs (what
block copies, the host tier and connectors move), ``kv_layout`` what the scheduler gets.

``execute(scheduled, before_sampling) -> ModelRunnerOutput`` runs one step:
``compute_logits`` turns the scheduled batch (a flat batch of decode tokens and prefill
chunks) into model inputs and ``AttentionMetadata``, runs the model once, and keeps the
logits of the last token of every request that samples in this step, in batch order (and
of each drafted token after it, for speculative decoding); then, once ``before_sampling``
returns (the gate: the previous step's tokens are applied on the host; it also returns
the step's grammar bitmask, filled from matchers that are current then), the runner's
``StepSampler`` samples, or verifies drafts, and the step's tokens come back as plain
Python values. The runner owns the ``Sampler`` and the ``Speculator``; the engine core
never sees logits.

``execute`` is ``start_step`` (deltas, forward) then ``finish_step`` (logits, gate,
sampling); pipeline parallelism's batch queue calls the two halves apart, so rank 0 starts
step i+1 (stage 0's layers, the hand-over) before it receives step i's logits
(``core.batch_queue``).

The step plan is a delta (``engine.scheduler_output``): ``execute`` first applies it to
``self.requests`` (``request_states.py``: each request's block table and last sampled
token), and the forward reads the resulting ``StepInput``s, never a ``ScheduledRequest``'s
table. A decode's input token is one the runner sampled, so the plan leaves it out:
placeholders (async scheduling, see ``core/sched/scheduler.py``: the step was scheduled before the
previous one's tokens reached the host) are gathered from the device, where the
``StepSampler`` keeps the previous step's tokens, so no device-to-host round trip sits
between two steps; other decodes take the host copy ``RequestStates.record`` kept.

With a draft model (speculative decoding), the draft's KV cache gets as many blocks as
the target's, and the budget pays for both: ``draft_config`` adds its per-block bytes.
A proposer that reads the target's hidden states (EAGLE-3, MTP) gets each step's final
hidden states, on the device, after sampling (``Speculator.observe_target``); such an
engine captures no CUDA graphs (logged): a replayed graph would not hand them over.

``kv_cache_dtype="fp8_e4m3"`` stores the target's cache as float8_e4m3fn (1 byte per
value, per-tensor scale 1.0): the same budget holds twice the blocks of a bf16 cache
(four times an fp32 one). The kernels quantise on write and dequantise on read; a draft
model's cache stays in the model dtype.

Tensor parallelism (``tp``, ``engine.parallel``): the model is sharded after it is built
(``models.tensor_parallel.shard_model``), the KV cache holds this rank's KV heads only,
and the number of blocks is the smallest any rank can hold, so block ids mean the same
on every rank. On rank 0 ``step_sender`` broadcasts each step's deltas right after they
are applied here (placeholders filled from the device), before the forward; the other
ranks run ``compute_logits`` on what they receive (``engine.parallel.worker``). CUDA
graphs are not captured under tensor parallelism.

Pipeline parallelism (``pp``): the model is cut to this rank's stage after it is built
(``models.pipeline_parallel.PipelineStage``: its layers only, the embedding on rank 0, the
norm and LM head on the last rank), the KV cache has one pair per layer of the stage, and
the block count is again the smallest over ranks. The step travels as under tensor
parallelism; the forward hands hidden states rank to rank and ``self.model.compute_logits``
returns, on rank 0, the logits the last stage sent. Both at once: ``tp`` is this stage's
tensor-parallel group, the model is sharded, then cut. ``group`` (``pp``, else ``tp``) spans
every rank: the block count's minimum is taken over it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.runner.cuda_graphs import DecodeGraphs
from pagoda.engine.runner.kv_allocation import (allocate_kv_caches, build_group_metadata, copy_state_slots,
                                                layer_specs, make_kv_layout, uniform_reason, unique_pairs)
from pagoda.engine.lora.manager import LoRAManager
from pagoda.engine.runner.mm_inputs import MultiModalInputs
from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.runner.prompt_logprobs import PromptRows
from pagoda.engine.runner.raw_logits import ContextRows, copy_sampled_rows, kept_rows
from pagoda.engine.runner.request_states import RequestStates
from pagoda.engine.runner.placement import kv_bytes_per_block, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.runner.step_sampler import StepSampler
from pagoda.engine.sampling.sampler import Sampler
from pagoda.engine.scheduler_output import SchedulerOutput
from pagoda.engine.spec_decode import SpeculativePlan, Speculator
from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.cpu_gemm import pack_model
from pagoda.models.config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.loader import load_model
from pagoda.models.quant import quantize_model
from pagoda.models.pipeline_parallel import PipelineGroup, PipelineStage
from pagoda.models.tensor_parallel import TensorParallelGroup, kv_head_range, shard_model
from pagoda.models.registry import build_model

logger = logging.getLogger(__name__)

# Memory kept free on a GPU for activations and the sampler (bytes).
_GPU_ACTIVATION_RESERVE = 2 * 2**30


class ModelRunner:
    """Args:
    config: the engine configuration.
    model_config: the target model's config.
    model_path: the model folder.
    spec_plan: speculative decoding (its draft's KV shares the budget), or None.
    tp: this rank's tensor-parallel group, or None (one device).
    pp: this rank's pipeline-parallel group, or None (the whole model here).
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str,
                 spec_plan: Optional[SpeculativePlan] = None, tp: Optional[TensorParallelGroup] = None,
                 pp: Optional[PipelineGroup] = None) -> None:
        kernels.reload_settings()  # the kernel choices follow the environment this engine is built in
        self.draft_config = spec_plan.draft_config if spec_plan else None
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        if config.load_format == "dummy":
            self.model = make_random_model(model_config, self.dtype, self.device, config.seed, config.quantization)
        else:
            self.model = load_model(model_path, dtype=self.dtype, device=self.device, quantization=config.quantization)
        self.tp = tp
        self.kv_heads = model_config.num_key_value_heads  # this rank's KV heads
        if tp is not None:
            shard_model(self.model, tp)
            self.kv_heads = kv_head_range(model_config.num_key_value_heads, tp.size, tp.rank)[1]
        layers = list(self.model.layers)  # every layer (a pipeline stage keeps its own only)
        if pp is not None:
            self.model = PipelineStage(self.model, pp)
        self.group = pp if pp is not None else tp  # all ranks agree on the block count (pp's spans TP x PP)
        self.kv_dtype = resolve_kv_cache_dtype(config, self.dtype)
        self._allocate_kv_cache(layers)
        self.lora = (LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
                     if config.enable_lora else None)
        pack_model(self.model, self.device, self.dtype)  # CPU: oneDNN-prepacked float weights (models.cpu_gemm)
        self.keeps_hidden = spec_plan is not None and spec_plan.needs_target_hidden
        reason = cuda_graphs_off_reason(config, self.keeps_hidden, self.device)
        if reason is not None:
            logger.warning("CUDA graphs off: %s", reason)
        # Images (runner.mm_inputs): their rows and M-RoPE positions are per step, which a replayed graph lacks.
        # (Not under TP/PP: the step's broadcast carries no images; the input processor refuses them there.)
        self.mm = (MultiModalInputs(self.model, self.device, config.multimodal.mm_encoder_cache_bytes)
                   if model_config.vision is not None and self.group is None else None)
        # Padded pages (kv.layout) scale a group's block ids in the step's metadata; the graphs' static
        # tables hold the scheduler's ids, so such a model decodes eagerly.
        no_graphs = self.keeps_hidden or self.group is not None or self.mm is not None or self.kv_layout.is_padded
        self.graphs = None if no_graphs else DecodeGraphs.maybe_capture(self)  # None on CPU or when disabled
        self._step_hidden: Optional[torch.Tensor] = None
        self.sampler = Sampler(vocab_size=model_config.vocab_size, seed=config.seed)
        speculator = spec_plan.build(model_config, self.model, self.num_blocks, self.sampler,
                                     model_config.check_max_model_len(config.max_model_len)) if spec_plan else None
        self.step_sampler = StepSampler(self.sampler, speculator, self.device)
        self.requests = RequestStates()  # block tables and last tokens, kept from the plans' deltas
        # Async scheduling keeps each step's tokens for the next step's placeholders.
        self.keeps_last_sampled = config.async_scheduling and speculator is None
        self.step_sender = None  # rank 0 of a tensor-parallel group: engine.parallel.step_wire.StepSender

    @property
    def speculator(self) -> Optional[Speculator]:
        return self.step_sampler.speculator

    def _allocate_kv_cache(self, layers: list) -> None:
        """Group the layers' caches, size the pools from the budget, allocate (``kv_allocation``)."""
        specs = layer_specs(self.model_config, layers, self.kv_dtype, self.kv_heads)
        first = getattr(self.model, "first_layer", 0)
        own = range(first, first + len(self.model.layers))
        extra = kv_bytes_per_block(self.draft_config, self.block_size, self.dtype) if self.draft_config else 0
        self.kv_layout = make_kv_layout(self.config, specs, self._kv_budget_bytes(), extra, own, self.group)
        self.num_blocks = self.kv_layout.num_blocks
        self.kv_caches = allocate_kv_caches(self.kv_layout, specs, layers, own, self.kv_dtype, self.device)
        self.kv_tensors = unique_pairs(self.kv_caches)
        self.state_caches = [c for c in self.kv_caches if hasattr(c, "ssm_states")]
        reason = uniform_reason(self.config)
        logger.info("KV cache: %d blocks of %d tokens, %d state slots, groups %s on %s (%s)%s", self.num_blocks,
                    self.block_size, self.kv_layout.num_state_slots,
                    [(g.spec.kind, len(g.layer_ids)) for g in self.kv_layout.groups], self.device, self.kv_dtype,
                    f"; uniform: {reason}" if reason and self.model_config.sliding_window else "")

    def _kv_budget_bytes(self) -> int:
        if self.device.type != "cuda":
            return self.config.kv_cache_memory_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device)
        return budget - _GPU_ACTIVATION_RESERVE

    def execute(self, scheduler_output: SchedulerOutput,
                before_sampling: Optional[Callable[[], Optional[TokenBitmask]]] = None) -> ModelRunnerOutput:
        """Run one step: the deltas into the request states, the forward pass, the gate,
        sampling (or draft verification). ``start_step`` then ``finish_step``.

        Args:
            scheduler_output: the step's plan, a delta (``engine.scheduler_output``);
                ``self.requests`` turns it into the forward's inputs.
            before_sampling: the gate, called between the forward and sampling: blocks
                until the previous step's tokens are applied (raises if that step
                failed), then returns the grammar masks of the step's logits rows (or
                None); None when there is nothing to wait for and no grammar.
        Returns:
            The sampled tokens and raw logprobs of every request with ``is_sampling``, and
            the prompt log-probabilities this step computed (``prompt_logprobs.py``).
        """
        return self.finish_step(self.start_step(scheduler_output), before_sampling)

    def start_step(self, scheduler_output: SchedulerOutput) -> "StartedStep":
        """The first half of ``execute``: the deltas applied (and sent to the other ranks), the
        forward run. On rank 0 of a pipeline that is stage 0's layers and the hand-over: the
        logits come back in ``finish_step``, so several steps can be started before the first
        is finished (``core.batch_queue``; steps are finished in the order they started)."""
        inputs = self.requests.update(scheduler_output, self.step_sampler.kept_request_ids)
        if self.mm is not None:
            self.mm.drop(scheduler_output.preempted_request_ids + scheduler_output.finished_request_ids)
        if self.step_sender is not None:  # tensor parallelism: the other ranks run the same forward
            self.step_sender.send(scheduler_output, inputs, self._placeholder_tokens)
        # Recurrent states (kv.state_manager): checkpoints restored before, taken after the forward.
        copy_state_slots(self.state_caches, scheduler_output.states_to_restore)
        forward = self.forward(inputs) if inputs else None
        copy_state_slots(self.state_caches, scheduler_output.states_to_checkpoint)
        return StartedStep(scheduler_output, forward)

    def finish_step(self, started: "StartedStep",
                    before_sampling: Optional[Callable[[], Optional[TokenBitmask]]] = None) -> ModelRunnerOutput:
        """The second half of ``execute``: the logits (received from the last stage on rank 0
        of a pipeline), the gate, sampling."""
        scheduler_output, prompt_logprobs, context = started.scheduler_output, {}, {}
        forward = started.forward
        logits = self.finish_logits(forward, prompt_logprobs, context) if forward is not None else None
        # Sampling reads state that applying the previous step changes (histories, matchers).
        token_bitmask = before_sampling() if before_sampling is not None else None
        items = [item for item in scheduler_output.scheduled if item.is_sampling]
        raw = copy_sampled_rows(logits, items, self.model_config.vocab_size) if logits is not None else {}
        output = self.step_sampler(logits, items, token_bitmask)
        output.context_logits, output.generation_logits = context, kept_rows(raw, output)
        if self._step_hidden is not None:
            self.speculator.observe_target(scheduler_output.scheduled,
                                           dict(zip(output.req_ids, output.sampled_token_ids)), self._step_hidden)
            self._step_hidden = None
        output.prompt_logprobs = prompt_logprobs
        self.requests.record(output)
        if self.keeps_last_sampled:
            self.step_sampler.keep_last(output)
        return output

    def compute_logits(self, scheduled, prompt_logprobs: Optional[dict] = None) -> torch.Tensor:
        """The step's forward pass (``forward``, then ``finish_logits``).

        Args:
            scheduled: the step's ``StepInput``s (``request_states.py``), in batch order —
                per request: ``token_ids`` (one short when its first token is gathered on
                the device), ``num_computed_tokens`` (start position),
                ``num_new_tokens``, ``block_ids`` (the whole table), ``is_sampling``,
                ``spec_token_ids``, ``adapter_id``, ``request_id``, ``prompt_logprobs``.
            prompt_logprobs: filled with request id -> (first position, entries) for the
                inputs that ask for prompt log-probabilities (``prompt_logprobs.py``).
        Returns:
            float32 logits ``[num_rows, vocab]``, in batch order: for each request with
            ``is_sampling`` set, ``1 + len(spec_token_ids)`` rows (its last known token,
            then each drafted token); empty when none samples.
        """
        return self.finish_logits(self.forward(scheduled), prompt_logprobs)

    @torch.inference_mode()
    def forward(self, scheduled) -> "Forward":
        """The model's forward over ``scheduled`` (``compute_logits``' first half)."""
        lora = self._lora_batch(scheduled)
        wants_prompt = any(getattr(item, "prompt_logprobs", None) is not None for item in scheduled)
        wants_context = any(getattr(item, "context_logits", False) for item in scheduled)
        eager = lora is not None or wants_prompt or wants_context
        if not eager and self.graphs is not None and self.graphs.can_run(scheduled):
            # Graphs hold no LoRA (nor prompt or context logits): such steps run eagerly.
            rows = [row for row, item in enumerate(scheduled) if _num_device_tokens(item)]
            logits = self.graphs.execute(scheduled, rows, self._placeholder_tokens(scheduled, rows) if rows else None)
            return Forward(logits=logits)
        flat = _FlatBatch(scheduled)
        if self.kv_layout.num_groups > 1:
            tables = [[item.group_block_ids[g] for item in scheduled] for g in range(self.kv_layout.num_groups)]
            meta = build_group_metadata(self.kv_layout, flat.query_lens, flat.seq_lens, tables, self.device)
        else:
            meta = AttentionMetadata.build(flat.query_lens, flat.seq_lens, flat.tables, self.block_size, self.device)
        ids = torch.tensor(flat.input_ids, dtype=torch.int64, device=self.device)
        if flat.placeholder_items:
            index = torch.tensor(flat.placeholder_index, dtype=torch.int64, device=self.device)
            ids.index_copy_(0, index, self._placeholder_tokens(scheduled, flat.placeholder_items))
        pos = torch.tensor(flat.positions, dtype=torch.int64, device=self.device)
        mm = self.mm.build(scheduled, flat.offsets) if self.mm is not None else None
        if mm is not None and (limits := self.mm.key_limits(scheduled)) is not None:
            meta.set_key_limits(limits, self.device)
        hidden = self.model(ids, pos, self.kv_caches, meta, lora, **({"mm": mm} if mm is not None else {}))
        if self.keeps_hidden:
            self._step_hidden = hidden
        return Forward(hidden=hidden, sample_rows=flat.sample_rows,
                       plan=PromptRows.build(scheduled, flat.offsets) if wants_prompt else None,
                       context=ContextRows.build(scheduled, flat.offsets) if wants_context else None)

    @torch.inference_mode()
    def finish_logits(self, forward: "Forward", prompt_logprobs: Optional[dict] = None,
                      context: Optional[dict] = None) -> torch.Tensor:
        """The logits of ``forward``'s sampled rows (and its prompt log-probabilities, context logits)."""
        if forward.logits is not None:
            return forward.logits
        hidden, plan = forward.hidden, forward.plan
        if forward.context is not None and context is not None:
            context.update(forward.context.compute(self.model, hidden, self.model_config.vocab_size))
        if plan is not None and prompt_logprobs is not None:
            prompt_logprobs.update(plan.compute(self.model, hidden, self.model_config.vocab_size))
        elif plan is not None:  # a tensor-parallel worker: rank 0 computes them from the gathered logits
            plan.run_head_only(self.model, hidden)
        if not forward.sample_rows:
            return torch.empty(0, self.model_config.vocab_size, device=self.device)
        rows = torch.tensor(forward.sample_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()

    def _lora_batch(self, scheduled):
        if self.lora is None:
            return None
        return self.lora.prepare([item.adapter_id for item in scheduled],
                                 [item.num_new_tokens for item in scheduled], self.device)

    def record_sampled(self, output: ModelRunnerOutput) -> None:
        """Keep a step's last sampled token per request for the next step's placeholders
        (``execute`` does it itself under async scheduling)."""
        self.step_sampler.keep_last(output)

    def _placeholder_tokens(self, scheduled, items: list[int]) -> torch.Tensor:
        """``[len(items)]`` the previous step's tokens of ``scheduled[i]`` for ``i`` in items."""
        return self.step_sampler.last_token_ids([scheduled[i].request_id for i in items])


@dataclass
class Forward:
    """A forward pass whose logits are not taken yet: the final hidden states (rank 0 of a
    pipeline: a ``[num_tokens, 0]`` placeholder), the rows to sample, the prompt-logprob plan;
    or, from a CUDA graph, the logits themselves."""

    hidden: Optional[torch.Tensor] = None
    sample_rows: list = field(default_factory=list)
    plan: Optional[PromptRows] = None
    logits: Optional[torch.Tensor] = None
    context: Optional[ContextRows] = None  # context logits' rows (runner.raw_logits)


@dataclass
class StartedStep:
    """``ModelRunner.start_step``'s result, for ``finish_step``."""

    scheduler_output: SchedulerOutput
    forward: Optional[Forward]


class _FlatBatch:
    """A step's ``StepInput``s as one flat token batch: inputs, positions, the attention
    metadata's lists, the rows to sample, the placeholders (tokens gathered on the device)
    and each input's first row (``offsets``)."""

    def __init__(self, scheduled) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.query_lens, self.seq_lens, self.tables, self.sample_rows, self.offsets = [], [], [], [], []
        self.placeholder_items, self.placeholder_index = [], []
        for i, item in enumerate(scheduled):
            start, n = item.num_computed_tokens, item.num_new_tokens
            self.offsets.append(len(self.input_ids))
            if _num_device_tokens(item):  # its first token: sampled by the previous step, on the device
                self.placeholder_items.append(i)
                self.placeholder_index.append(len(self.input_ids))
                self.input_ids.append(0)
            self.input_ids.extend(item.token_ids)
            self.positions.extend(range(start, start + n))
            self.query_lens.append(n)
            self.seq_lens.append(start + n)
            self.tables.append(item.block_ids)
            if item.is_sampling:
                end = len(self.input_ids)
                self.sample_rows.extend(range(end - 1 - len(item.spec_token_ids), end))


def cuda_graphs_off_reason(config: EngineConfig, keeps_hidden: bool, device: torch.device) -> Optional[str]:
    """Why this engine captures no decode graphs though it would (None: nothing to say)."""
    if keeps_hidden and config.enable_cuda_graphs and device.type == "cuda":
        return (f"speculative_method {config.speculative_method!r} reads the target's hidden states of every "
                "step (a replayed graph would not hand them over); decode steps run eagerly")
    return None


def _num_device_tokens(item) -> int:
    """Input tokens of ``item`` the previous step sampled, kept on the device (``StepInput.num_device_tokens``)."""
    return item.num_new_tokens - len(item.token_ids)


def make_random_model(
    model_config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int, quantization: Optional[str] = None
) -> LlamaForCausalLM:
    """The model with seeded random weights (``load_format="dummy"``: benchmarks of a shape
    without its checkpoint). Projections ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1,
    biases 0, LM head ~ N(0, 16/hidden) so logits spread (std ~4) and greedy picks are not
    near-ties. Drawn on ``device`` with its own generator: the same on every run of one
    device type. ``quantization`` is applied as ``load_model`` would."""
    model = build_model(model_config, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied LM head is listed once
            if name.endswith("norm"):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            elif name == "embed_tokens":
                param.normal_(0.0, 1.0, generator=generator)
            else:
                gain = 16.0 if name == "lm_head" else 1.0
                param.normal_(0.0, (gain / param.shape[-1]) ** 0.5, generator=generator)  # fan-in (stacked experts too)
    if quantization is not None:
        quantize_model(model, quantization)
    return model.eval()
