"""Device memory for the KV cache groups: each layer's spec, the pools' tensors, the step's metadata.

``layer_specs`` reads what each layer keeps (``ModelConfig.layer_types``, its window, a
linear-attention layer's ``state_shapes()``) into ``engine.kv.specs`` objects; the
scheduler's ``KVCacheLayout`` comes from them (``kv.layout.group_layers``), sized by
``plan_capacity`` from the budget. ``allocate_kv_caches`` then makes, per the layout:

- ``group_size`` K/V tensor pairs ``[num_blocks, block_size, kv_heads, head_dim]``, pair
  ``j`` shared by the ``j``-th layer of every paged group (a block id belongs to one
  group at a time, so no two layers ever write one page);
- for multi-head latent attention (``ModelConfig.mla``: every DeepSeek-V3 layer), ``group_size``
  ``LatentCache`` tensors ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]`` shared the
  same way (one row per token: ``MLALatentSpec``);
- per state layer, a ``StateCache(conv_states, ssm_states)`` with the slot first
  (``[num_state_slots, *shape]``), in the dtypes the layer keeps them in;
- for a shared-KV layer (``ModelConfig.kv_source_layers``, Gemma 4), its target's entry.

Layers of different KV shapes (``ModelConfig.layer_kv_shape``, Gemma 4's sliding and full
layers) make padded pages (``kv.layout``): position ``j`` is then one raw K and one raw V buffer
``[num_blocks, largest page / 2]``, each group's layers viewing it as
``[num_blocks * page_stride, block_size, kv_heads, head_dim]`` (a ``PaddedKV`` pair that also
holds the raw buffers, which block copies, the CPU tier and connectors move whole);
``build_group_metadata`` multiplies such a group's block ids by its ``page_stride``.

``build_group_metadata`` turns a step's per-group tables into one ``AttentionMetadata``
per paged group (the first built in full; the others share its sequence tensors and
differ in ``slot_mapping`` / ``block_tables``), and sets ``layer_metadata`` and the state
slots (``state_indices``, ``has_initial_state``: the state group's slot, and whether the
step starts past position 0) on the first, which the model receives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from pagoda.engine.kv.host_tier import BlockPairs
from pagoda.engine.kv.layout import KVCacheLayout, group_layers, plan_capacity
from pagoda.engine.kv.specs import (FullAttentionSpec, KVCacheSpec, MLALatentSpec, RecurrentStateSpec, SharedKVSpec,
                                    SlidingWindowSpec)
from pagoda.kernels import AttentionMetadata, LatentCache
from pagoda.models.config import ModelConfig

LINEAR_ATTENTION = "linear_attention"


def layer_specs(model_config: ModelConfig, layers: Sequence[torch.nn.Module], kv_dtype: torch.dtype,
                kv_heads: int) -> list[KVCacheSpec]:
    """One spec per layer of the model (``layers``: the model's decoder layers, after
    tensor-parallel sharding, so shapes are this rank's)."""
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    specs: list[KVCacheSpec] = []
    for i in range(model_config.num_hidden_layers):
        kind = model_config.layer_types[i] if model_config.layer_types else "full_attention"
        heads, dim = (kv_heads, model_config.head_dim) if model_config.layer_kv_shapes is None else \
            model_config.layer_kv_shape(i)  # per-layer shapes: tensor parallelism refuses these models
        if model_config.kv_source(i) != i:
            specs.append(SharedKVSpec(model_config.kv_source(i)))
        elif kind == LINEAR_ATTENTION:
            specs.append(_state_spec(layers[i], i))
        elif model_config.mla is not None:
            specs.append(MLALatentSpec(model_config.mla.kv_lora_rank, model_config.mla.qk_rope_head_dim, elem))
        elif model_config.layer_window(i):
            specs.append(SlidingWindowSpec(heads, dim, elem, model_config.layer_window(i)))
        else:
            specs.append(FullAttentionSpec(heads, dim, elem))
    return specs


def state_module(layer: torch.nn.Module) -> torch.nn.Module:
    """The linear-attention module of a decoder layer: the submodule answering ``state_shapes()``."""
    module = next((m for m in layer.modules() if hasattr(m, "state_shapes")), None)
    if module is None:
        raise ValueError(f"{type(layer).__name__}: a linear_attention layer must have a module with state_shapes()")
    return module


def _state_spec(layer: torch.nn.Module, index: int) -> RecurrentStateSpec:
    conv_shape, ssm_shape = state_module(layer).state_shapes()
    conv_dtype, ssm_dtype = state_dtypes(layer)
    elem = lambda dtype: torch.tensor([], dtype=dtype).element_size()  # noqa: E731
    return RecurrentStateSpec(tuple(conv_shape), tuple(ssm_shape), elem(conv_dtype), elem(ssm_dtype))


def state_dtypes(layer: torch.nn.Module) -> tuple[torch.dtype, torch.dtype]:
    """(conv, ssm) dtypes a linear-attention layer keeps its state in (its ``state_dtypes()``)."""
    conv_dtype, ssm_dtype = state_module(layer).state_dtypes()
    return conv_dtype, ssm_dtype


def allocate_kv_caches(layout: KVCacheLayout, specs: Sequence[KVCacheSpec], layers: Sequence[torch.nn.Module],
                       own_layers: Sequence[int], kv_dtype: torch.dtype, device: torch.device) -> list[Any]:
    """The caches of ``own_layers`` (this stage's, in order), per ``layout`` (module docstring)."""
    pairs: dict[int, Any] = {}  # K/V pairs (or latent caches) by position in the paged groups
    caches: list[Any] = []
    for layer in own_layers:
        spec = specs[layer]
        if isinstance(spec, SharedKVSpec):
            spec = specs[spec.target_layer]
            layer = spec_owner(specs, layer)
        group, position = layout.layer_slots[layer]
        if isinstance(spec, RecurrentStateSpec):
            from pagoda.kernels import StateCache

            conv_dtype, ssm_dtype = state_dtypes(layers[layer])
            caches.append(StateCache(
                torch.zeros((layout.num_state_slots, *spec.conv_shape), dtype=conv_dtype, device=device),
                torch.zeros((layout.num_state_slots, *spec.ssm_shape), dtype=ssm_dtype, device=device)))
            continue
        if isinstance(spec, MLALatentSpec):
            if layout.is_padded:
                raise ValueError("KV cache: latent (MLA) layers beside layers of another page size are not supported")
            if position not in pairs:
                shape = (layout.num_blocks, layout.block_size, 1, spec.kv_lora_rank + spec.rope_dim)
                pairs[position] = LatentCache(torch.zeros(shape, dtype=kv_dtype, device=device))
            caches.append(pairs[position])
            continue
        if not isinstance(spec, FullAttentionSpec):
            raise ValueError(f"layer {layer}: no device allocation for {type(spec).__name__} yet")
        if layout.is_padded:
            caches.append(_padded_view(layout, spec, pairs, position, kv_dtype, device))
            continue
        if position not in pairs:
            shape = (layout.num_blocks, layout.block_size, spec.num_kv_heads, spec.head_dim)
            pairs[position] = (torch.zeros(shape, dtype=kv_dtype, device=device),
                               torch.zeros(shape, dtype=kv_dtype, device=device))
        caches.append(pairs[position])
    return caches


class PaddedKV(tuple):
    """A layer's (K, V) views of padded pages; ``raw`` is the pair of buffers they view
    (``[num_blocks, largest page / 2]`` each: what moves a whole block)."""

    raw: tuple[torch.Tensor, torch.Tensor]


def _padded_view(layout: KVCacheLayout, spec: FullAttentionSpec, pairs: dict[int, Any], position: int,
                 kv_dtype: torch.dtype, device: torch.device) -> PaddedKV:
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    if position not in pairs:
        shape = (layout.num_blocks, layout.page_bytes // 2 // elem)
        pairs[position] = (torch.zeros(shape, dtype=kv_dtype, device=device),
                           torch.zeros(shape, dtype=kv_dtype, device=device))
    stride = layout.page_bytes // spec.page_bytes(layout.block_size)
    view = (layout.num_blocks * stride, layout.block_size, spec.num_kv_heads, spec.head_dim)
    cache = PaddedKV(raw.view(view) for raw in pairs[position])
    cache.raw = pairs[position]
    return cache


def spec_owner(specs: Sequence[KVCacheSpec], layer: int) -> int:
    """The layer whose cache ``layer`` reads (itself unless it shares another's)."""
    while isinstance(specs[layer], SharedKVSpec):
        layer = specs[layer].target_layer
    return layer


def build_group_metadata(layout: KVCacheLayout, query_lens: list[int], seq_lens: list[int],
                         group_tables: list[list[list[int]]], device: torch.device) -> AttentionMetadata:
    """One step's metadata over ``layout``'s groups (``group_tables[g][s]``: sequence ``s``'s
    table in group ``g``); see the module docstring."""
    paged, state = layout.paged_groups, layout.state_group
    slots = [table[0] for table in group_tables[state.index]] if state is not None else None
    base = AttentionMetadata.build(query_lens, seq_lens, _strided(group_tables, paged[0]), layout.block_size,
                                   device, state_indices=slots)
    metas: dict[int, AttentionMetadata] = {paged[0].index: base}
    for group in paged[1:]:  # the same sequences (and state slots); their own slots and tables
        other = AttentionMetadata.build(query_lens, seq_lens, _strided(group_tables, group), layout.block_size,
                                        device)
        metas[group.index] = dataclasses.replace(base, slot_mapping=other.slot_mapping,
                                                 block_tables=other.block_tables, cpu_plans={})
    if len(metas) > 1:
        base.layer_metadata = [metas.get(group, base) for group, _ in layout.layer_slots]
    return base


def _strided(group_tables: list[list[list[int]]], group: Any) -> list[list[int]]:
    """``group``'s tables in its tensors' sub-blocks (block ``b`` is sub-block ``b * page_stride``)."""
    tables = group_tables[group.index]
    return tables if group.page_stride == 1 else [[b * group.page_stride for b in t] for t in tables]


def uniform_reason(config: Any) -> Optional[str]:
    """Why every attention layer keeps every block in one group (``kv.layout``'s uniform
    form) for this engine, or None (grouped)."""
    if config.kv_cache_layout == "uniform":
        return "kv_cache_layout='uniform'"
    if config.speculative_method is not None:
        return (f"speculative_method {config.speculative_method!r}: a draft reads one block table for all of its "
                "layers")
    return None


def make_kv_layout(config: Any, specs: Sequence[KVCacheSpec], budget_bytes: int, extra_block_bytes: int = 0,
                   own_layers: Optional[Sequence[int]] = None, group: Any = None) -> KVCacheLayout:
    """The engine's layout: ``specs`` grouped (or uniform, ``uniform_reason``), the pools sized
    from ``budget_bytes`` for ``own_layers`` (a pipeline stage's), the smallest over ``group``'s
    ranks (block and slot ids mean the same on every rank; a collective)."""
    layout = group_layers(specs, config.block_size, uniform=uniform_reason(config) is not None)
    check_state_features(config, layout)
    if config.speculative_method is not None and (layout.is_padded or any(isinstance(s, SharedKVSpec) for s in specs)):
        raise ValueError(f"speculative_method {config.speculative_method!r}: this model's layers differ in KV shape "
                         "or share KV caches (Gemma 4); drafts and their verification are not checked over padded "
                         "pages and shared layers yet; turn speculative decoding off")
    layout = plan_capacity(layout, budget_bytes, config.max_num_seqs, extra_block_bytes, config.num_state_slots,
                           config.num_gpu_blocks_override, own_layers)
    if group is not None:
        slots = group.min_int(layout.num_state_slots) if layout.num_state_slots else 0
        layout = layout.with_sizes(group.min_int(layout.num_blocks), slots)
    return layout


def check_state_features(config: Any, layout: KVCacheLayout) -> None:
    """Refuse what does not combine with recurrent states yet, naming why (ValueError)."""
    group = layout.state_group
    if group is None:
        return
    if config.speculative_method is not None:
        raise ValueError(f"speculative_method {config.speculative_method!r}: this model keeps recurrent states "
                         f"({len(group.layer_ids)} linear-attention layers); a rejected draft token would need the "
                         "state from before it to roll back, and pagoda keeps one state per sequence (vLLM keeps "
                         "one per speculative token); turn speculative decoding off")


def unique_pairs(kv_caches: Sequence[Any]) -> list[tuple[torch.Tensor, ...]]:
    """The distinct paged caches among per-layer caches: (K, V) pairs, or one-tensor
    ``LatentCache``s (shared ones once, states left out): what block copies, the host tier and
    connectors move, tensor by tensor (each tensor's block is its own size)."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for cache in kv_caches:
        if not hasattr(cache, "ssm_states"):
            cache = getattr(cache, "raw", cache)  # padded pages: the buffers, whole blocks
            seen.setdefault(id(cache[0]), cache)
    return list(seen.values())


@torch.inference_mode()
def copy_state_slots(states: Sequence, pairs: BlockPairs) -> None:
    """Copy recurrent-state slots to slots on the device (restores before a forward,
    checkpoints after it; ``kv.state_manager``); ``pairs`` are (src, dst), destinations unique."""
    if not pairs or not states:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=states[0][0].device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=src.device)
    for layer in states:
        for cache in layer:
            cache.index_copy_(0, dst, cache.index_select(0, src))
