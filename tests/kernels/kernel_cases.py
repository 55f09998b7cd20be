"""Shared builders for the kernel tests: random paged caches, metadata, poisoned buffers.

Poisoning: every cache slot that no sequence owns, the padding of the block tables and the
gaps of a strided (non-contiguous) block table all point at NaN, so a kernel that reads
past a sequence's length or through the wrong table entry produces NaN and fails.
``poisoned_allocations`` fills every tensor a wrapper allocates (outputs, split-K
workspaces) with NaN, so an element the kernel forgets to write fails too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pagoda.kernels.metadata import AttentionMetadata

# (atol, rtol) against a float64 reference, per input dtype.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (4e-2, 3e-2),
}


@dataclass
class PagedCase:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_paged_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    seed: int,
    strided_tables: bool = False,
) -> PagedCase:
    """A step whose sequences own shuffled blocks; every slot nobody owns holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = order.pop()
    tables, taken = [], 0
    for n in blocks_per_seq:
        tables.append(order[taken : taken + n])
        taken += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.tensor(
        [table[pos // block_size] * block_size + pos % block_size for table, n in zip(tables, seq_lens) for pos in range(n)],
        dtype=torch.int64,
    )
    for cache in (k_cache, v_cache):
        values = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
        cache.view(-1, num_kv_heads, head_dim)[slots] = values
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    # Padding entries of the table point at the NaN block instead of block 0.
    for s, table in enumerate(tables):
        meta.block_tables[s, len(table) :] = poison_block
    if strided_tables:
        wide = torch.full((len(tables), 2 * meta.block_tables.shape[1]), poison_block, dtype=torch.int32)
        wide[:, ::2] = meta.block_tables
        meta.block_tables = wide[:, ::2]
        assert not meta.block_tables.is_contiguous()
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(q, k_cache, v_cache, meta, head_dim**-0.5)


def reference_attention(case: PagedCase) -> torch.Tensor:
    from pagoda.kernels.reference import paged_attention_ref

    return paged_attention_ref(
        case.q.double(), case.k_cache.double(), case.v_cache.double(), case.meta, case.scale
    )


@contextlib.contextmanager
def poisoned_allocations():
    """While active, torch.empty / torch.empty_like return NaN-filled (or -1) tensors."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    torch.empty = lambda *a, **kw: poison(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(real_empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), f"{int(torch.isnan(actual).sum())} elements are NaN (unwritten or poisoned)"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)
