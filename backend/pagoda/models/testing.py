"""Helpers for tests that drive the model directly on a paged KV cache (no engine).

``run_step`` plays the part of ModelRunner for one step: it builds the positions and the
``AttentionMetadata`` from per-sequence (new tokens, tokens already cached, block table)
and returns the logits of every new token. Tests use it to compare prefill, decode and
mixed batches against a full-sequence reference forward.

Hybrid models (linear-attention layers, ``models/gated_deltanet.py``): ``make_layer_caches``
gives each such layer a ``StateCache`` of ``num_slots`` slots (the others a KV pair), and a
``StepInput`` names its sequence's ``state_slot``; the slot is read when the sequence has
tokens cached (``num_computed_tokens > 0``), as the engine's allocator will arrange.
Multi-head latent attention (``models/mla.py``): each layer gets a ``LatentCache``. Layers with
their own KV shapes (``ModelConfig.layer_kv_shapes``, Gemma 4) get pairs of their shape; a layer
that shares another's cache (``kv_source_layers``) gets that layer's pair.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch

from pagoda.kernels import AttentionMetadata, LatentCache, StateCache
from pagoda.models.config import ModelConfig
from pagoda.models.llama import KVCache, LlamaForCausalLM


@dataclass
class StepInput:
    token_ids: list[int]  # the sequence's new tokens this step
    num_computed_tokens: int  # tokens of this sequence already in the cache
    block_table: list[int]  # block ids covering at least num_computed_tokens + len(token_ids)
    state_slot: Optional[int] = None  # hybrid models: the sequence's state slot


def make_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[KVCache]:
    """One zeroed (k_cache, v_cache) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]


def make_layer_caches(
    model: LlamaForCausalLM, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype = torch.float32,
    state_fill: float = 0.0, kv_heads: Optional[int] = None,
) -> list[Union[KVCache, StateCache]]:
    """Per layer a zeroed KV pair (``kv_heads`` heads: a tensor-parallel rank's; default the
    config's), or for a linear-attention layer a ``StateCache`` of ``num_slots`` slots filled
    with ``state_fill`` (NaN: slots a step must never read), shaped as the (sharded) layer says."""
    config = model.config if kv_heads is None else dataclasses.replace(model.config, num_key_value_heads=kv_heads)
    if config.mla is not None:
        shape = (num_blocks, block_size, 1, config.mla.latent_dim)
        return [LatentCache(torch.zeros(shape, dtype=dtype, device=model.device)) for _ in model.layers]
    kv = make_kv_caches(config, num_blocks, block_size, dtype, str(model.device))
    if config.layer_kv_shapes is not None or config.kv_source_layers is not None:  # per-layer shapes (Gemma 4)
        kv = [_kv_pair(config, i, num_blocks, block_size, dtype, model.device) for i in range(len(kv))]
        kv = [kv[config.kv_source(i)] for i in range(len(kv))]  # a KV-shared layer reads its source's pair
    caches: list[Union[KVCache, StateCache]] = []
    for layer, pair in zip(model.layers, kv):
        mixer = getattr(layer, "linear_attn", None) if getattr(layer, "is_linear", False) else None
        if mixer is None:
            caches.append(pair)
            continue
        shapes, dtypes = mixer.state_shapes(), mixer.state_dtypes()
        caches.append(StateCache(*(torch.full((num_slots, *shape), state_fill, dtype=dt, device=model.device)
                                   for shape, dt in zip(shapes, dtypes))))
    return caches


def _kv_pair(config: ModelConfig, layer: int, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> KVCache:
    shape = (num_blocks, block_size, *config.layer_kv_shape(layer))
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def run_step(
    model: LlamaForCausalLM, kv_caches: list, seqs: list[StepInput], block_size: int
) -> torch.Tensor:  # [total new tokens, vocab] float32
    """Run one engine-like step over several sequences and return logits for every new token."""
    input_ids: list[int] = []
    positions: list[int] = []
    for seq in seqs:
        input_ids += seq.token_ids
        positions += range(seq.num_computed_tokens, seq.num_computed_tokens + len(seq.token_ids))
    meta = AttentionMetadata.build(
        query_lens=[len(s.token_ids) for s in seqs],
        seq_lens=[s.num_computed_tokens + len(s.token_ids) for s in seqs],
        block_tables=[s.block_table for s in seqs],
        block_size=block_size,
        device=model.device,
        state_indices=None if seqs[0].state_slot is None else [s.state_slot for s in seqs],
    )
    hidden = model(
        torch.tensor(input_ids, dtype=torch.int64, device=model.device),
        torch.tensor(positions, dtype=torch.int64, device=model.device),
        kv_caches,
        meta,
    )
    return model.compute_logits(hidden)


def ensure_test_model():
    """The default SmolLM2 folder (imported once, cached under ``~/.cache/pagoda``)."""
    from pagoda.models.gguf_import import ensure_default_model

    return ensure_default_model()
