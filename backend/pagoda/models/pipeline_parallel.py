"""Pipeline parallelism of a built decoder: ``PipelineStage(model, group)`` runs one rank's layers.

The decoder's layers are cut into ``group.size`` contiguous ranges (``stage_layers``, vLLM's
``get_pp_indices`` split: even, a remainder going to the stages just before the last, so the
first and the last stage — which also hold the embedding and the LM head — are not the
longest). Rank ``r``'s stage keeps only its layers (the others are dropped with the whole
model it was cut from) and:

* rank 0 (first): the embedding, its layers, then one ``send`` of ``[2, num_tokens, hidden]``
  (the hidden states and the residual stream, stacked) to rank 1;
* a middle rank: ``recv`` from ``r - 1``, its layers, ``send`` to ``r + 1``;
* the last rank: ``recv``, its layers, the final norm; its ``compute_logits`` applies the
  LM head and ``send``s the float32 logits ``[rows, vocab]`` to rank 0.

Rank 0's ``compute_logits`` ``recv``s those logits (its ``forward`` returns a
``[num_tokens, 0]`` placeholder, so the runner's row selection works unchanged and only
the row count matters); a middle rank's returns an empty tensor. Every rank runs the same
step (the engine broadcasts it), so each knows ``num_tokens`` and the rows: no shapes
travel. The runner calls ``compute_logits`` in the same order on every rank (prompt
log-probability rows, then the sampled rows), so the sends and receives pair up without tags.

Families: any decoder that runs ``LlamaForCausalLM``'s own layer loop (Llama, Mistral, Qwen2/3,
Mixtral, Qwen3-MoE, gpt-oss: a layer is ``layer(h, residual, positions, cos_sin, kv, meta,
lora)``) splits this way, whatever its weights (float, int8, fp8, int4). A family with its own
``forward`` (Gemma 3: two rotary tables, scaled embeddings, soft-capped logits) is refused by
name, as is a model that keeps auxiliary hidden states (EAGLE-3).

With tensor parallelism too (``models.tensor_parallel.shard_model`` first, then the stage):
each stage is a tensor-parallel group of its own; the first stage's embedding is
vocabulary-parallel as without stages, every rank of a stage sends its (replicated) hidden
states to the rank of the same tensor-parallel index in the next stage, and the last
stage's tensor-parallel rank 0 gathers the logits and sends them to rank 0.

This module never imports the engine: ``group`` is anything with ``rank`` and ``size`` (the
stage index and the number of stages), ``send(tensor, dst_stage)`` and ``recv(tensor,
src_stage)`` (point to point, to the peer of this rank's tensor-parallel index; ``recv``
blocks, ``send`` may return before the peer received: with several steps in flight the
engine's sends do not wait, so a sent tensor is never changed here).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import ModelConfig
from pagoda.models.llama import KVCache, LlamaForCausalLM
from pagoda.models.quant import linear


class PipelineGroup(Protocol):
    rank: int
    size: int

    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int) -> None: ...


def stage_layers(num_layers: int, pp: int, rank: int) -> range:
    """The layers stage ``rank`` of ``pp`` runs: ``num_layers // pp`` each, one more for each of
    the ``num_layers % pp`` stages just before the last (vLLM's split)."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def check_stages(config: ModelConfig, pp: int) -> None:
    """Raise ``ValueError`` when ``pp`` stages cannot each get a layer, or the family is not split yet."""
    if config.gemma4 is not None:
        raise ValueError(f"pipeline_parallel_size={pp}: {config.architecture} runs its own layer loop (per-layer "
                         "inputs, KV-shared layers reading earlier layers' caches); it is not split into stages yet")
    if config.num_hidden_layers < pp:
        raise ValueError(f"pipeline_parallel_size={pp}: num_hidden_layers={config.num_hidden_layers} must be at "
                         "least the pipeline-parallel size (each stage runs one layer or more)")


def _check_supported(model: LlamaForCausalLM) -> None:
    cls = type(model)
    for name in ("forward", "embed", "compute_logits"):
        if getattr(cls, name) is not getattr(LlamaForCausalLM, name):
            raise ValueError(f"pipeline parallelism: {cls.__name__} has its own {name}; only families that run "
                             "the Llama layer loop (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE, gpt-oss) are split "
                             "into stages so far")
    if model.aux_layer_ids:
        raise ValueError("pipeline parallelism: the model keeps auxiliary hidden states (EAGLE-3), which a stage "
                         "cannot hand over")


class PipelineStage(nn.Module):
    """Stage ``group.rank`` of ``model`` (see the module docstring); ``first_layer`` is the
    model-wide index of ``layers[0]`` (LoRA adapters are indexed by it)."""

    def __init__(self, model: LlamaForCausalLM, group: PipelineGroup) -> None:
        super().__init__()
        check_stages(model.config, group.size)
        _check_supported(model)
        self.config, self.dtype, self.device, self.group = model.config, model.dtype, model.device, group
        owned = stage_layers(model.config.num_hidden_layers, group.size, group.rank)
        self.first_layer = owned.start
        self.layers = nn.ModuleList(model.layers[i] for i in owned)
        self.is_first, self.is_last = group.rank == 0, group.rank == group.size - 1
        self.embed_tokens: Optional[torch.Tensor] = model.embed_tokens if self.is_first else None
        self.norm: Optional[torch.Tensor] = model.norm if self.is_last else None
        self.lm_head: Optional[torch.Tensor] = model.lm_head if self.is_last else None
        self.register_buffer("cos_sin_cache", model.cos_sin_cache, persistent=False)
        self.tp, self.vocab_start = model.tp, model.vocab_start  # a tensor-parallel stage: its shard
        self.tp_rank = model.tp.rank if model.tp is not None else 0

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64 (read by the first stage only)
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCache],  # one per layer of this stage
        meta: AttentionMetadata,
        lora=None,
    ) -> torch.Tensor:  # last stage: [num_tokens, hidden]; others: [num_tokens, 0]
        assert len(kv_caches) == len(self.layers), f"need {len(self.layers)} KV caches, got {len(kv_caches)}"
        num_tokens = positions.shape[0]
        if self.is_first:
            h, residual = LlamaForCausalLM.embed(self, input_ids), None  # vocabulary-parallel under TP
        else:
            both = torch.empty(2, num_tokens, self.config.hidden_size, dtype=self.dtype, device=self.device)
            self.group.recv(both, self.group.rank - 1)
            h, residual = both[0], both[1]
        for idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches), start=self.first_layer):
            h, residual = layer(h, residual, positions, self.cos_sin_cache, kv_cache, meta.for_layer(idx), lora)
        if not self.is_last:
            self.group.send(torch.stack([h, residual]), self.group.rank + 1)  # [2, num_tokens, hidden]
            return h.new_empty(num_tokens, 0)
        h, _ = kernels.rms_norm(h, self.norm, self.config.rms_norm_eps, residual)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, *] -> [rows, vocab] float32 on rank 0
        """Last stage: the LM head (gathered to its tensor-parallel rank 0), sent to rank 0
        (returns an empty tensor); rank 0: the received logits of ``hidden.shape[0]`` rows;
        any other rank: an empty tensor."""
        rows, vocab = hidden.shape[0], self.config.vocab_size
        if self.is_last:
            logits = linear(hidden, getattr(self, "lm_head_packed", None) or self.lm_head).float()
            if self.tp is not None:
                logits = self.tp.gather_logits(logits)  # [rows, vocab] on TP rank 0, empty elsewhere
            if rows and self.tp_rank == 0:
                self.group.send(logits.contiguous(), 0)
            return logits[:0]
        if not self.is_first or self.tp_rank != 0 or not rows:
            return torch.empty(0, vocab, device=self.device)
        logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        self.group.recv(logits, self.group.size - 1)
        return logits
