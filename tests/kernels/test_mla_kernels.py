"""Multi-head latent attention's kernels (interpreted Triton, and the CPU path) vs float64 references.

A case is one step's decode rows over a paged latent cache whose unowned slots, table padding
and allocations (``poisoned_allocations``: outputs and split-K workspaces) hold NaN: the decode
rows are a subset of the step's sequences, out of order (``seq_ids``), with contexts that end on
and off block boundaries. The absorbed decode is checked against ``mla_decode_ref`` in float64,
float32 within a bound derived from its reduction lengths (``decode_bound``), 16-bit within a
few units of the last place; with default, odd and oversized split counts (splits past a
sequence's end weigh nothing), an fp8 cache with a scale, widths that are not powers of two and
DeepSeek-V3's own (rank 512, rope 64). The latent write skips negative slots and quantizes as
the K/V write does.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference_mla, triton_mla
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.reference import quantize_fp8
from tests.kernels.kernel_cases import TOLERANCES, poisoned_allocations, quantization_bound
from tests.numerics import assert_within, gamma

SEQ_LENS = [9, 33, 1, 16, 70, 5]
DECODES = [4, 0, 2, 5, 1]  # rows decode these sequences (sequence 3 is a prefill chunk's, not read)


def make_case(rank: int, rope: int, heads: int, dtype: torch.dtype, block_size: int = 4, seed: int = 0):
    """(q_lat, q_pe, cache, meta, seq ids) with every slot no sequence owns NaN."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in SEQ_LENS]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poison = order.pop()
    tables, taken = [], 0
    for n in per_seq:
        tables.append(order[taken:taken + n])
        taken += n
    cache = torch.full((num_blocks, block_size, 1, rank + rope), float("nan"), dtype=dtype)
    for table, length in zip(tables, SEQ_LENS):
        for pos in range(length):
            cache[table[pos // block_size], pos % block_size, 0] = torch.randn(rank + rope, generator=gen).to(dtype)
    meta = AttentionMetadata.build([1] * len(SEQ_LENS), SEQ_LENS, tables, block_size)
    for s, table in enumerate(tables):
        meta.block_tables[s, len(table):] = poison
    q_lat = torch.randn(len(DECODES), heads, rank, generator=gen).to(dtype)
    q_pe = torch.randn(len(DECODES), heads, rope, generator=gen).to(dtype)
    return q_lat, q_pe, cache, meta, torch.tensor(DECODES, dtype=torch.int32)


def reference(q_lat, q_pe, cache, meta, scale, kv_scale=1.0):
    """float64 (an fp8 cache's stored values, exact in float64, times ``kv_scale``)."""
    cache = cache.double() * kv_scale if cache.dtype == torch.float8_e4m3fn else cache.double()
    return reference_mla.mla_decode_ref(q_lat.double(), q_pe.double(), cache, meta, DECODES, scale)


def decode_bound(q_lat, q_pe, cache, scale, splits: int, kv_scale: float = 1.0) -> float:
    """float32 vs float64: a score's error (``rank + rope`` terms of at most ``scale * max|q| max|c|``)
    moves its weight by as much relatively, twice (numerator and sum); softmax's sum and P@C add
    ``2 * context`` terms, the split combine ``2 * splits + 4`` more; all at the scale of ``max|c|``."""
    finite = lambda t: t.double()[torch.isfinite(t.double())].abs().max().item()  # noqa: E731  (NaN poison)
    width = q_lat.shape[-1] + q_pe.shape[-1]
    magnitude = scale * kv_scale * width * max(finite(q_lat), finite(q_pe)) * finite(cache)
    return (2 * gamma(width, torch.float32) * magnitude + gamma(2 * max(SEQ_LENS) + 2 * splits + 4, torch.float32)) \
        * finite(cache) * kv_scale


def check(actual, expected, dtype, fp32_bound):
    assert not torch.isnan(actual).any(), "NaN: an unwritten element or a poisoned read"
    if dtype == torch.float32:
        assert_within(actual, expected, fp32_bound, "float32 kernel vs float64 reference")
    else:
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("splits", [None, 3, 8])
def test_decode_kernel_equals_the_float64_definition(dtype, splits):
    """Widths that are not powers of two (rank 24, rope 8 padded to 32 and 16), 6 heads (a
    partial head block), blocks of 4; one split, three (odd), eight (most past every end)."""
    q_lat, q_pe, cache, meta, seq_ids = make_case(24, 8, 6, dtype, seed=1)
    scale = 32 ** -0.5
    with poisoned_allocations():
        out = triton_mla.mla_decode(q_lat, q_pe, cache, meta, seq_ids, scale, num_splits=splits)
    check(out, reference(q_lat, q_pe, cache, meta, scale), dtype, decode_bound(q_lat, q_pe, cache, scale, splits or 1))


def test_decode_kernel_at_deepseek_v3_widths():
    """rank 512, rope 64 (DeepSeek-V3 / Kimi K2), 16 heads, pages of 16 tokens, split in 4."""
    q_lat, q_pe, cache, meta, seq_ids = make_case(512, 64, 16, torch.float32, block_size=16, seed=2)
    scale = 192 ** -0.5
    with poisoned_allocations():
        out = triton_mla.mla_decode(q_lat, q_pe, cache, meta, seq_ids, scale, num_splits=4)
    check(out, reference(q_lat, q_pe, cache, meta, scale), torch.float32, decode_bound(q_lat, q_pe, cache, scale, 4))


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_fp8_cache_is_read_times_its_scale(path):
    """An e4m3 cache (scale 0.5): both paths equal the definition over the stored values."""
    q_lat, q_pe, cache, meta, seq_ids = make_case(24, 8, 6, torch.float32, seed=3)
    stored = quantize_fp8(cache, 0.5)
    scale = 32 ** -0.5
    expected = reference(q_lat, q_pe, stored, meta, scale, kv_scale=0.5)
    if path == "triton":
        with poisoned_allocations():
            out = triton_mla.mla_decode(q_lat, q_pe, stored, meta, seq_ids, scale, kv_scale=0.5, num_splits=2)
    else:
        plan = reference_mla.MlaPlan(torch.arange(len(DECODES)), seq_ids, DECODES)
        out = reference_mla.mla_decode_torch(q_lat, q_pe, stored, meta, plan, scale, kv_scale=0.5)
    check(out, expected, torch.float32, decode_bound(q_lat, q_pe, stored.float(), scale, 2, kv_scale=0.5))
    assert not torch.allclose(out.double(), reference(q_lat, q_pe, stored, meta, scale)), "the scale counts"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_path_equals_the_definition(dtype):
    """The batched torch path (buckets of similar length, padding masked to zero) of the CPU."""
    q_lat, q_pe, cache, meta, seq_ids = make_case(24, 8, 6, dtype, seed=4)
    plan = reference_mla.MlaPlan(torch.arange(len(DECODES)), seq_ids, DECODES)
    out = reference_mla.mla_decode_torch(q_lat, q_pe, cache, meta, plan, 0.2)
    check(out, reference(q_lat, q_pe, cache, meta, 0.2), dtype, decode_bound(q_lat, q_pe, cache, 0.2, 1))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_latent_write_skips_padding_and_quantizes(cache_dtype):
    rows = (torch.randn(5, 24) * 3).to(torch.float32 if cache_dtype.itemsize == 1 else cache_dtype)  # the model's
    slots = torch.tensor([7, -1, 0, 13, -1])
    cache = torch.zeros(4, 4, 1, 24, dtype=cache_dtype)
    expected = torch.zeros(4, 4, 1, 24, dtype=cache_dtype)
    triton_mla.write_latent(rows, cache, slots, scale=0.25)
    kept = slots >= 0
    reference_mla.write_latent(rows[kept], expected, slots[kept], scale=0.25 if cache_dtype.itemsize == 1 else 1.0)
    if cache_dtype == torch.float8_e4m3fn:
        flat = cache.view(-1, 24)[slots[kept]].float() * 0.25
        assert_within(flat, rows[kept], quantization_bound(rows[kept], 0.25), "fp8 latent rows")
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    else:
        assert torch.equal(cache, expected)
