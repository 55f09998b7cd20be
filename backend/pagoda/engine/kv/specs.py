"""Cache specs: what one layer keeps between steps, and how the allocator treats it.

A model family declares, per layer, what its cache is (``ModelConfig.layer_types`` and,
for a linear-attention layer, its ``state_shapes()``); the runner turns that into one
spec per layer (``runner.kv_allocation.layer_specs``) and ``kv.layout.group_layers``
groups layers with equal specs. Everything the allocator does differently per kind of
layer is a property of the spec, so a new kind of layer is a new class here and nothing
else in ``engine/kv`` changes:

=====================  ==========  =============================================  ============================
spec                   kind        memory                                          blocks freed / hashed
=====================  ==========  =============================================  ============================
``FullAttentionSpec``  paged       K and V per token: ``2 * heads * dim * bytes``  never before the request ends
``SlidingWindowSpec``  paged       as full attention                               outside the window: reused
``MLALatentSpec``      paged       one latent per token: ``(rank + rope) * bytes``  as full attention
``RecurrentStateSpec`` state slot  conv + SSM state per sequence, any length       one working slot; checkpoints
``SharedKVSpec``       none        reads another layer's cache                     (the other layer's)
=====================  ==========  =============================================  ============================

``kind`` is vLLM's ``KVCacheSpecKind`` word (``full_attention``, ``sliding_window``,
``mla_attention``, ``mamba``): KV events carry it for groups other than the first
(``contracts.vllm_kv_events``). A paged spec's ``page_bytes(block_size)`` is what one
block of one layer takes; the block pool gives every block id the largest page of the model's
paged specs and pads the smaller ones (``kv.layout``: each must divide the largest). A state
spec's ``slot_bytes`` is one sequence's state for one layer. ``manager_kind`` names the group manager
(``kv.group_managers``) that allocates, looks up and frees the group's blocks.

No torch here: dtypes are element sizes in bytes (the runner reads them from tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import ClassVar


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """A layer's cache, as the allocator sees it (abstract)."""

    kind: ClassVar[str] = "unknown"
    is_paged: ClassVar[bool] = False  # per-token pages in the shared block pool
    is_state: ClassVar[bool] = False  # one fixed-size slot per sequence
    manager_kind: ClassVar[str] = ""  # kv.group_managers.MANAGERS key

    def page_bytes(self, block_size: int) -> int:
        """Bytes one block of one layer takes (0: not paged)."""
        return 0

    def slot_bytes(self) -> int:
        """Bytes one sequence's state takes in one layer (0: not a state)."""
        return 0

    def max_live_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens ever holds in this spec's group,
        computing at most ``max_chunk`` tokens per step (the cache's worst case for it)."""
        return 0


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Paged K and V for every token (``[num_blocks, block_size, heads, dim]`` each)."""

    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    kind: ClassVar[str] = "full_attention"
    is_paged: ClassVar[bool] = True
    manager_kind: ClassVar[str] = "full"

    def page_bytes(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def max_live_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return blocks_for(num_tokens, block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged K and V where a query at position p reads keys in ``(p - window, p]`` only.

    Blocks wholly before the window of a request's next query are returned to the pool
    (their table entries become the null block): a long generation holds about
    ``window / block_size + 1`` blocks plus the chunk being computed.
    """

    window: int = 0

    kind: ClassVar[str] = "sliding_window"
    manager_kind: ClassVar[str] = "sliding"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding window: must be >= 1 token, got {self.window}")

    def max_live_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        # A step computing c tokens from position p needs keys from p - window + 1 on: at
        # most window - 1 + c positions, spread over one more block than they fill.
        bounded = blocks_for(self.window - 1 + min(max_chunk, num_tokens), block_size) + 1
        return min(blocks_for(num_tokens, block_size), bounded)


@dataclass(frozen=True)
class MLALatentSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek): one compressed latent plus the rope key per
    token, in one tensor (``[num_blocks, block_size, kv_lora_rank + rope_dim]``)."""

    kv_lora_rank: int
    rope_dim: int
    dtype_bytes: int

    kind: ClassVar[str] = "mla_attention"
    is_paged: ClassVar[bool] = True
    manager_kind: ClassVar[str] = "full"

    def page_bytes(self, block_size: int) -> int:
        return block_size * (self.kv_lora_rank + self.rope_dim) * self.dtype_bytes

    def max_live_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return blocks_for(num_tokens, block_size)


@dataclass(frozen=True)
class RecurrentStateSpec(KVCacheSpec):
    """A linear-attention / state-space layer: a fixed-size state per sequence, whatever its
    length (Gated DeltaNet: a short-convolution state and the recurrent matrix state).

    Shapes are per sequence, without the slot dimension; ``*_dtype_bytes`` the element
    sizes the layer keeps them in.
    """

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype_bytes: int
    ssm_dtype_bytes: int

    kind: ClassVar[str] = "mamba"
    is_state: ClassVar[bool] = True
    manager_kind: ClassVar[str] = "state"

    def slot_bytes(self) -> int:
        return prod(self.conv_shape) * self.conv_dtype_bytes + prod(self.ssm_shape) * self.ssm_dtype_bytes

    def max_live_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return 1  # the working slot (checkpoints are the cache's, not the request's)


@dataclass(frozen=True)
class SharedKVSpec(KVCacheSpec):
    """A layer that reads the cache another layer (``target_layer``) wrote (cross-layer KV
    sharing, Gemma 4's ``num_kv_shared_layers``): it joins no group and takes no memory; the
    runner hands it the target's cache and the target group's metadata."""

    target_layer: int

    kind: ClassVar[str] = "shared"
