"""KV cache groups: which layers share a block table, and how groups share memory.

Layers with equal specs (``kv.specs``) form a *group*; each request holds one block table
per group (``kv.kv_cache_manager``). There are two pools:

- **The block pool** (paged groups: full attention, sliding window, MLA). One pool of
  ``num_blocks`` blocks, shared by every paged group in the manner of vLLM's hybrid
  allocator: the paged layers are cut into groups of the same size ``group_size`` (the
  fewest layers of any paged kind; a kind with more layers makes several groups of it),
  and the runner allocates ``group_size`` tensors (K/V pairs), tensor ``j`` shared by the
  ``j``-th layer of every group. A block id is therefore one page in each of the
  ``group_size`` tensors, used by exactly one group at a time; a block a sliding-window
  group frees can next hold a full-attention group's tokens, with no fragmentation
  and no budget split between them. A block id takes the largest page of any paged spec
  (``page_bytes``) in each tensor. Specs with smaller pages (Gemma 4: sliding layers of
  ``head_dim`` 256 beside full ones of 512) are *padded* to the largest page:
  the runner views each shared tensor, per spec, as ``page_stride`` (largest page / its
  page) sub-blocks per block id and addresses block ``b`` as sub-block ``b * page_stride``
  (``KVCacheGroup.page_stride``; only the step's metadata changes, the scheduler's ids do
  not); the other sub-blocks are the padding. A page that does not divide the largest is
  refused by ``group_layers``, naming the layers. The padding costs ``1 - 1/page_stride``
  of a padded group's blocks; the alternatives cost more code: more tokens per block for the
  small pages (one block size per group: block hashes, the scheduler and the events assume
  one) or one pool per page size (a budget split and a second free queue). A group with fewer
  layers than ``group_size`` (the last of a kind) leaves its share of the other tensors unused.
- **Shared-KV layers** (``SharedKVSpec``, Gemma 4's ``num_kv_shared_layers``) join no group and
  take no memory: their slot in ``layer_slots`` is their target's, so they read its blocks
  through its group's metadata.
- **The state pool** (recurrent-state groups). ``num_state_slots`` slots, each one
  sequence's state in every state layer (one tensor pair per layer, the slot first): a
  running request holds one *working* slot; free slots may hold *checkpoints* of the state
  at a block boundary of a cached prefix (``kv.state_manager``). A state (tens of MB for
  a large model) is far bigger than an attention page, so it does not share the block
  pool's page size (vLLM raises the attention block to the state's size, which makes
  prefix caching as coarse as that: no hit below ~500 tokens on Qwen3.5); the budget is
  split instead, by ``plan_capacity``: the state pool takes ``num_state_slots`` slots
  (default: two per ``max_num_seqs``, at most half the budget), the block pool the rest.

``uniform=True`` merges every attention kind into one full-attention group (sliding
layers keep every block, as before groups existed): used where a feature reads one block
table for all layers (a draft model, a KV connector) and for the capacity benchmark's
comparison. State layers have no uniform form: they always make a state group.

Group order: full attention first, then the other paged kinds, then the state group, so
group 0 is the group whose blocks cover every position when the model has one (its block
table is the one a draft model or a connector reads, its events the fleet index keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pagoda.engine.kv.specs import FullAttentionSpec, KVCacheSpec, SharedKVSpec, SlidingWindowSpec, blocks_for

_KIND_ORDER = {"full_attention": 0, "mla_attention": 1, "sliding_window": 2, "mamba": 9}


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with one spec and one block table per request."""

    index: int
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]
    page_stride: int = 1  # sub-blocks of the spec's page per block id (padded pages, module docstring)


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's groups and the pools' sizes (what the scheduler and the runner agree on).

    Attributes:
        groups: in group order (see the module docstring).
        block_size: tokens per block (every paged group).
        num_blocks: blocks of the block pool, including the null block 0.
        num_state_slots: slots of the state pool, including the null slot 0 (0: no state group).
        group_size: tensors the paged groups share (layers per paged group).
        layer_slots: per layer, ``(group index, position in the group)``; a shared-KV layer
            has its target's.
    """

    groups: tuple[KVCacheGroup, ...]
    block_size: int
    num_blocks: int
    num_state_slots: int
    group_size: int
    layer_slots: tuple[tuple[int, int], ...]

    @property
    def paged_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if g.spec.is_paged)

    @property
    def state_group(self) -> Optional[KVCacheGroup]:
        return next((g for g in self.groups if g.spec.is_state), None)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def page_bytes(self) -> int:
        """Bytes one block id takes in one shared tensor position: the largest paged spec's page."""
        return max((g.spec.page_bytes(self.block_size) for g in self.paged_groups), default=0)

    @property
    def is_padded(self) -> bool:
        """Whether some paged group's pages are padded to a larger page (``page_stride > 1``)."""
        return any(g.page_stride > 1 for g in self.paged_groups)

    @property
    def block_bytes(self) -> int:
        """Bytes one block id takes across the shared tensors."""
        return self.group_size * self.page_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes one state slot takes across the state layers."""
        group = self.state_group
        return len(group.layer_ids) * group.spec.slot_bytes() if group else 0

    def bytes_for(self, layer_ids: Sequence[int]) -> tuple[int, int]:
        """(bytes per block, bytes per state slot) the layers ``layer_ids`` take (one pipeline
        stage's: a stage allocates only the shared tensors and state layers its layers use)."""
        positions, slot_bytes = set(), 0
        for layer in layer_ids:
            group, position = self.layer_slots[layer]
            spec = self.groups[group].spec
            if spec.is_paged:
                positions.add(position)
            elif spec.is_state and layer in self.groups[group].layer_ids:
                slot_bytes += spec.slot_bytes()
        return len(positions) * self.page_bytes, slot_bytes

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """Blocks of the block pool a request of ``num_tokens`` tokens may hold at once, over
        its paged groups (the admission check: a request alone must always fit)."""
        return sum(g.spec.max_live_blocks(num_tokens, self.block_size, max_chunk) for g in self.paged_groups)

    def with_sizes(self, num_blocks: int, num_state_slots: int) -> "KVCacheLayout":
        return KVCacheLayout(self.groups, self.block_size, num_blocks, num_state_slots, self.group_size,
                             self.layer_slots)


def single_group_layout(num_blocks: int, block_size: int, num_layers: int = 1) -> KVCacheLayout:
    """One full-attention group of ``num_layers`` layers (the shape every model had before
    groups; tests of the scheduler build it without a model)."""
    spec = FullAttentionSpec(num_kv_heads=1, head_dim=1, dtype_bytes=1)
    layer_ids = tuple(range(num_layers))
    return KVCacheLayout((KVCacheGroup(0, spec, layer_ids),), block_size, num_blocks, 0, num_layers,
                         tuple((0, j) for j in layer_ids))


def group_layers(specs: Sequence[KVCacheSpec], block_size: int, uniform: bool = False) -> KVCacheLayout:
    """Group ``specs`` (one per layer) into a layout with unsized pools (see the module docstring).

    Raises:
        ValueError: paged layers whose pages differ in size, a shared-KV layer pointing at
            a layer that owns no cache, no layer with a cache at all, or no attention layer.
    """
    specs = [_uniform(s) for s in specs] if uniform else list(specs)
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if not isinstance(spec, SharedKVSpec):
            by_spec.setdefault(spec, []).append(layer)
    if not by_spec:
        raise ValueError("KV cache: no layer keeps a cache")
    strides = _page_strides(by_spec, block_size)
    paged = {s: ids for s, ids in by_spec.items() if s.is_paged}
    if not paged:  # group 0's table is what the scheduler, the events and a draft read
        raise ValueError("KV cache: every layer keeps a recurrent state; a model without an attention layer "
                         "(a pure state-space model) is not supported yet")
    group_size = min((len(ids) for ids in paged.values()), default=0)
    groups: list[KVCacheGroup] = []
    for spec in sorted(by_spec, key=lambda s: (_KIND_ORDER.get(s.kind, 5), by_spec[s][0])):
        ids = by_spec[spec]
        chunk = group_size if spec.is_paged else len(ids)
        for start in range(0, len(ids), chunk):
            groups.append(KVCacheGroup(len(groups), spec, tuple(ids[start:start + chunk]), strides.get(spec, 1)))
    slots: dict[int, tuple[int, int]] = {}
    for group in groups:
        for position, layer in enumerate(group.layer_ids):
            slots[layer] = (group.index, position)
    for layer, spec in enumerate(specs):
        if isinstance(spec, SharedKVSpec):
            if spec.target_layer not in slots:
                raise ValueError(f"KV cache: layer {layer} shares layer {spec.target_layer}'s cache, which has none")
            slots[layer] = slots[spec.target_layer]
    return KVCacheLayout(tuple(groups), block_size, 0, 0, group_size, tuple(slots[i] for i in range(len(specs))))


def _uniform(spec: KVCacheSpec) -> KVCacheSpec:
    if isinstance(spec, SlidingWindowSpec):
        return FullAttentionSpec(spec.num_kv_heads, spec.head_dim, spec.dtype_bytes)
    return spec


def _page_strides(by_spec: dict[KVCacheSpec, list[int]], block_size: int) -> dict[KVCacheSpec, int]:
    """Each paged spec's ``page_stride`` (the largest page over its own); refuses a page that does
    not divide the largest (the padded views need whole sub-blocks)."""
    pages = {s: s.page_bytes(block_size) for s in by_spec if s.is_paged}
    largest = max(pages.values(), default=0)
    uneven = {s: size for s, size in pages.items() if largest % size}
    if uneven:
        detail = "; ".join(f"layers {ids[:4]}{'...' if len(ids) > 4 else ''}: {pages[s]} bytes"
                           for s, ids in by_spec.items() if s.is_paged)
        raise ValueError(f"KV cache: paged layers share the block pool with pages padded to the largest "
                         f"({largest} bytes), which every page must divide ({detail})")
    return {s: largest // size for s, size in pages.items()}


def plan_capacity(layout: KVCacheLayout, budget_bytes: int, max_num_seqs: int, extra_block_bytes: int = 0,
                  num_state_slots: Optional[int] = None, num_blocks: Optional[int] = None,
                  layer_ids: Optional[Sequence[int]] = None) -> KVCacheLayout:
    """Size the pools from a memory budget.

    Args:
        layout: from ``group_layers``.
        budget_bytes: memory for the KV cache (both pools).
        max_num_seqs: the scheduler's sequence limit (the default state pool holds a working
            slot and a checkpoint per sequence, plus the null slot).
        extra_block_bytes: bytes each block id also costs elsewhere (a draft model's cache).
        num_state_slots / num_blocks: overrides (``EngineConfig.num_state_slots`` /
            ``num_gpu_blocks_override``), including the null slot / block.
        layer_ids: the layers this budget holds (a pipeline stage's); default every layer.
    Returns:
        ``layout`` with ``num_blocks`` and ``num_state_slots`` set.
    Raises:
        ValueError: the budget holds no block, or (with a state group) fewer than two slots.
    """
    block_bytes, slot_bytes = (layout.block_bytes, layout.slot_bytes) if layer_ids is None else \
        layout.bytes_for(layer_ids)
    slots = 0
    if layout.state_group is not None:
        slots = num_state_slots if num_state_slots is not None else \
            min(2 * max_num_seqs + 1, (budget_bytes // 2) // max(1, slot_bytes))
        if slots < 2:
            raise ValueError(f"KV cache budget of {budget_bytes} bytes holds {slots} recurrent-state slots "
                             f"({slot_bytes} bytes each) and needs at least 2 (the null slot and one "
                             "sequence's); raise kv_cache_memory_bytes / gpu_memory_utilization")
    if num_blocks is None:
        per_block = block_bytes + extra_block_bytes
        left = budget_bytes - slots * slot_bytes
        num_blocks = left // per_block if per_block else 2
        if num_blocks < 2:
            raise ValueError(f"KV cache budget of {budget_bytes} bytes ({left} after the state slots) is smaller "
                             f"than two blocks ({per_block} bytes each); raise kv_cache_memory_bytes / "
                             "gpu_memory_utilization")
    return layout.with_sizes(int(num_blocks), int(slots))


__all__ = ["KVCacheGroup", "KVCacheLayout", "blocks_for", "group_layers", "plan_capacity",
           "single_group_layout"]
