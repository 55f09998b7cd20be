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
from tests.numerics import assert_within, gamma

# (atol, rtol) against a float64 reference for 16-bit inputs: a few units of the output's
# last place (u = 2^-11 fp16, 2^-8 bf16), which dominates there. float32 results are held to
# a bound derived from the reduction lengths instead (``attention_bound``), since a fixed
# tolerance there encodes one CPU's summation order.
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
        [table[pos // block_size] * block_size + pos % block_size
         for table, n in zip(tables, seq_lens) for pos in range(n)],
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


def reference_attention(case: PagedCase, k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention over the cache as stored (an fp8 cache upcast, times its scales)."""
    from pagoda.kernels.reference import paged_attention_ref

    return paged_attention_ref(
        case.q.double(), case.k_cache.double() * k_scale, case.v_cache.double() * v_scale, case.meta, case.scale,
        window=window, sinks=None if sinks is None else sinks.double(),
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


def attention_bound(case: PagedCase) -> float:
    """Derived float32 bound for paged attention against float64 (tests/numerics.py).

    A score's error (head_dim terms, at most ``scale * head_dim * max|q| max|k|`` in size)
    moves its softmax weight by as much, relatively, twice over (numerator and sum); the
    softmax sum and P@V add ``2 * context`` terms; all at the scale of ``max|v|``.
    """
    finite = lambda t: t.double()[torch.isfinite(t.double())].abs().max().item()  # noqa: E731  (NaN poison)
    head_dim, context = case.q.shape[-1], max(case.meta.seq_lens_host)
    score_magnitude = case.scale * head_dim * finite(case.q) * finite(case.k_cache)
    return (2 * gamma(head_dim, torch.float32) * score_magnitude + gamma(2 * context, torch.float32)) \
        * finite(case.v_cache)


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                              fp32_bound: float | None = None) -> None:
    """16-bit: ulp-based ``TOLERANCES``; float32: ``fp32_bound`` (derived) when given."""
    assert not torch.isnan(actual).any(), f"{int(torch.isnan(actual).sum())} elements are NaN (unwritten or poisoned)"
    if dtype == torch.float32 and fp32_bound is not None:
        assert_within(actual, expected, fp32_bound, "float32 kernel vs float64 reference")
        return
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# float8_e4m3fn: 3 mantissa bits, so a relative step of 2^-3 and round-to-nearest errs by
# at most half of it; below the smallest normal (2^-6) the absolute error is at most 2^-6
# (that also covers Triton's interpreter, which flushes e4m3 subnormals to zero).
E4M3_REL = 2.0**-4
E4M3_ABS = 2.0**-6


def quantization_bound(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` for ``|x| <= 448 * scale``."""
    return E4M3_REL * x.double().abs() + E4M3_ABS * scale


def to_fp8_case(case: PagedCase, k_scale: float, v_scale: float) -> PagedCase:
    """The same step with its caches stored as e4m3 (NaN poison stays NaN)."""
    from pagoda.kernels.reference import quantize_fp8

    return PagedCase(case.q, quantize_fp8(case.k_cache, k_scale), quantize_fp8(case.v_cache, v_scale),
                     case.meta, case.scale)


def pairwise(first: list, second: list, third: list) -> list[tuple]:
    """A pairwise covering of three parameters: every pair of values of any two of them occurs
    in some case, in ``len(first) * len(second)`` cases instead of the full product (the third
    is chosen by a Latin square: ``third[(i + j) % len(third)]``, which meets every value of
    ``first`` and of ``second`` when neither is shorter than ``third``). For interpreter-run
    kernel matrices, where each case costs seconds: a failure caused by one value, or by two
    together, still shows."""
    assert len(third) <= min(len(first), len(second)), "the Latin square needs the third to be shortest"
    return [(a, b, third[(i + j) % len(third)]) for i, a in enumerate(first) for j, b in enumerate(second)]
