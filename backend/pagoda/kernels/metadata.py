"""Attention metadata for one engine step: the contract between ModelRunner and kernels.

One step attends over a flat batch of ``num_tokens`` query tokens belonging to
``num_seqs`` sequences, laid out back to back (decode tokens and prefill chunks mixed).
Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``; its context
after this step holds ``seq_lens[s]`` tokens, the first ``seq_lens[s] - query_len`` of
which were already in the paged cache before the step (a prefix hit, an earlier chunk,
or earlier decodes). Query row ``i`` of sequence ``s`` sits at position
``seq_lens[s] - query_len + i`` and attends causally to positions ``<=`` that.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``; the token at position ``p`` of
sequence ``s`` lives in block ``block_tables[s, p // block_size]`` at offset
``p % block_size``. ``slot_mapping[t] = block * block_size + offset`` is where query token
``t``'s new K/V are written.

Latent cache (multi-head latent attention, DeepSeek-V3): such a layer caches one row per
token, ``LatentCache.latent [num_blocks, block_size, 1, kv_lora_rank + rope_dim]`` (the
normed latent, then the rotated rope key), paged exactly as a K cache is: the same
``slot_mapping`` and ``block_tables``.

Recurrent state (linear-attention layers: Gated DeltaNet): such a layer keeps no per-token
cache but one fixed-size state per sequence, in a slot of its ``StateCache``
(``conv_states[num_slots, conv_dim, kernel_size - 1]``, ``ssm_states[num_slots, ...]``).
``state_indices[s]`` is sequence ``s``'s slot; with ``has_initial_state[s]`` false the
layer starts from zeros (the slot's old contents are never read), else from the slot.
After the step the slot holds the state after the sequence's last query token. A negative
slot marks a padding row (CUDA graphs): nothing is read or written for it. Models without
such layers leave both ``None``.

Key limits (bidirectional image attention, Gemma 3): with ``key_limits`` set, query token ``t``
sees keys up to position ``key_limits[t]`` instead of its own position (``key_limits[t] >= `` its
position; a token inside an image: the image's last position, every other token: its own).
With a sliding window it still sees no key at or below ``p - window``. A query's limit never
passes its sequence's ``seq_lens`` (a prefill chunk never ends inside such an image), and a
one-token query's limit is its own position (decode paths ignore the limits). ``set_key_limits``
puts the same limits on every KV cache group's metadata.

KV cache groups (``engine.kv.layout``): layers whose caches differ (sliding-window and
full attention) keep separate block tables, so each group has its own ``slot_mapping``
and ``block_tables`` over the same sequences. The runner then sets ``layer_metadata``
(per layer, its group's metadata) and a model's layer loop passes ``meta.for_layer(i)``
to layer ``i``; with one group it is the metadata itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch


class StateCache(NamedTuple):
    """One linear-attention layer's per-sequence state, the slot as first dimension of each."""

    conv_states: torch.Tensor  # [num_slots, conv_dim, kernel_size - 1], the model dtype
    ssm_states: torch.Tensor  # [num_slots, num_v_heads, head_k_dim, head_v_dim], float32


class LatentCache(NamedTuple):
    """One multi-head-latent-attention layer's paged cache (a one-tensor "pair": code that moves
    a layer's cache tensors block by block iterates it as it iterates a K/V pair)."""

    latent: torch.Tensor  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU paths never synchronise on device tensors.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Sequences with exactly one query token (decode); counted once per step by ``build``.
    num_decode_seqs: Optional[int] = None
    # The torch (CPU) attention path's gather indices and masks for this step, made by the
    # first layer that needs them and reused by every other (``reference.cpu_plan``).
    cpu_plans: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    # Linear-attention state slots (module docstring); None for models without such layers.
    state_indices: Optional[torch.Tensor] = None  # [num_seqs] int32, the slot of each sequence
    has_initial_state: Optional[torch.Tensor] = None  # [num_seqs] bool: read the slot (else zeros)
    state_indices_host: Optional[list[int]] = None
    has_initial_state_host: Optional[list[bool]] = None
    # Per query token, the last key position it sees (module docstring); None: causal everywhere.
    key_limits: Optional[torch.Tensor] = None  # [num_tokens] int64
    key_limits_host: Optional[list[int]] = None
    # Per layer, its KV cache group's metadata (None: one group, this one).
    layer_metadata: Optional[list["AttentionMetadata"]] = field(default=None, repr=False, compare=False)

    def for_layer(self, layer_idx: int) -> "AttentionMetadata":
        """The metadata layer ``layer_idx`` reads (its KV cache group's block tables)."""
        return self if self.layer_metadata is None else self.layer_metadata[layer_idx]

    def set_key_limits(self, limits: list[int], device: torch.device | str) -> None:
        """Give every query token its last visible key position (module docstring), on this
        metadata and on each KV cache group's."""
        tensor = torch.tensor(limits, dtype=torch.int64, device=device)
        for meta in {id(m): m for m in [self, *(self.layer_metadata or [])]}.values():
            meta.key_limits, meta.key_limits_host = tensor, list(limits)
            meta.cpu_plans.clear()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def decode_count(self) -> int:
        """How many sequences bring exactly one query token (host values only)."""
        if self.num_decode_seqs is None:
            self.num_decode_seqs = sum(1 for n in self.query_lens_host if n == 1)
        return self.num_decode_seqs

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        state_indices: Optional[list[int]] = None,
        has_initial_state: Optional[list[bool]] = None,
    ) -> "AttentionMetadata":
        """Build metadata from host lists.

        Args:
            query_lens: new tokens per sequence this step.
            seq_lens: context length per sequence after this step (>= query_lens).
            block_tables: block ids per sequence, covering at least ``seq_lens`` tokens.
            block_size: tokens per block.
            state_indices: the state slot of each sequence (models with linear-attention
                layers; negative: a padding row), or None.
            has_initial_state: per sequence, whether its slot holds the state to start from
                (default when ``state_indices`` is given: ``seq_lens > query_lens``).
        """
        assert len(query_lens) == len(seq_lens) == len(block_tables), "ragged metadata"
        if state_indices is None and has_initial_state is not None:
            raise ValueError("has_initial_state needs state_indices")
        if state_indices is not None:
            if has_initial_state is None:
                has_initial_state = [s > q for q, s in zip(query_lens, seq_lens)]
            if not len(state_indices) == len(has_initial_state) == len(query_lens):
                raise ValueError(f"state_indices ({len(state_indices)}) and has_initial_state "
                                 f"({len(has_initial_state)}) need one entry per sequence ({len(query_lens)})")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            assert 0 < q_len <= s_len, f"bad lengths q={q_len} s={s_len}"
            assert len(table) * block_size >= s_len, "block table too short"
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(block_tables), max_blocks),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
            num_decode_seqs=sum(1 for n in query_lens if n == 1),
            state_indices=None if state_indices is None else torch.tensor(
                state_indices, dtype=torch.int32, device=device),
            has_initial_state=None if has_initial_state is None else torch.tensor(
                has_initial_state, dtype=torch.bool, device=device),
            state_indices_host=None if state_indices is None else list(state_indices),
            has_initial_state_host=None if has_initial_state is None else [bool(b) for b in has_initial_state],
        )
