"""FP8 (e4m3) KV cache: the write kernel quantises, attention dequantises in registers.

Three checks, all against float64 (Triton's interpreter on CPU):

* the write kernel stores every value within e4m3's rounding error of the input (half a
  relative step, 2^-4, or 2^-6 absolute below the smallest normal), saturates outliers at
  +-448 * scale instead of writing NaN, and skips negative slots;
* attention over an fp8 cache equals float64 attention over the same stored values
  (times the scales) to the query dtype's usual tolerance, for one- and two-launch steps
  and split-K;
* written and attended together, the output stays within the first-order propagation of
  the per-element quantisation bound through the softmax, computed from the case's own
  magnitudes (``propagated_bound``).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels import reference, triton_attention, triton_kv_write
from pagoda.kernels.triton_attention import AttentionConfig
from tests.kernels.kernel_cases import (
    E4M3_ABS,
    E4M3_REL,
    TOLERANCES,
    assert_close_to_reference,
    attention_bound,
    make_paged_case,
    poisoned_allocations,
    quantization_bound,
    reference_attention,
    to_fp8_case,
)
from tests.numerics import assert_within

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MIXED_STEP = ([1, 7, 5, 1, 4, 1], [9, 7, 13, 4, 8, 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_write_kv_quantises_within_e4m3_rounding(dtype, scale):
    gen = torch.Generator().manual_seed(3)
    num_tokens, kv_heads, head_dim = 5, 3, 80
    k = (4 * torch.randn(num_tokens, kv_heads, head_dim, generator=gen)).to(dtype)
    v = (4 * torch.randn(num_tokens, kv_heads, head_dim, generator=gen)).to(dtype)
    k[0, 0, :3] = torch.tensor([1000.0, -1000.0, 1e-4]).to(dtype) * scale  # saturate, saturate, tiny
    shape = (4, 4, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan")).to(FP8)
    v_cache = torch.full(shape, float("nan")).to(FP8)
    slots = torch.tensor([3, 0, -1, 9, 14], dtype=torch.int64)
    triton_kv_write.write_kv(k, v, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    written = slots >= 0
    for x, cache in ((k, k_cache), (v, v_cache)):
        stored = cache.view(-1, kv_heads, head_dim)[slots[written]].double() * scale
        expect = x[written].double().clamp(-448 * scale, 448 * scale)
        assert_within(stored, expect, quantization_bound(expect, scale), "fp8 write vs float64 input")
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[slots[written]] = False
        assert torch.isnan(cache.view(-1, kv_heads, head_dim)[untouched].float()).all(), "wrote an unowned slot"
    assert k_cache.view(-1, kv_heads, head_dim)[3, 0, 0].float() == 448.0


def test_reference_write_matches_kernel_rounding_bound():
    # The CPU reference (torch's e4m3 rounding) obeys the same bound: the engine's CPU path.
    x = 3 * torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(1))
    cache = torch.zeros(2, 4, 2, 64, dtype=FP8)
    reference.write_kv(x, x, cache, cache.clone(), torch.arange(7), k_scale=0.5)
    stored = cache.view(-1, 2, 64)[:7].double() * 0.5
    assert_within(stored, x.double(), quantization_bound(x, 0.5), "reference fp8 write")


def _run(case, k_scale, v_scale, config=None, decode_config=None):
    with poisoned_allocations():
        return triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                                config, decode_config=decode_config, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_over_fp8_cache_matches_float64(dtype):
    case = to_fp8_case(make_paged_case(*MIXED_STEP, 8, 2, 80, dtype, block_size=4, seed=21), 0.5, 0.25)
    expected = reference_attention(case, 0.5, 0.25)
    assert_close_to_reference(_run(case, 0.5, 0.25), expected, dtype, _fp8_attention_bound(case, 0.5, 0.25))


@pytest.mark.parametrize("decode_split", [1, 3])
def test_fp8_cache_two_launches_and_split(decode_split):
    case = to_fp8_case(make_paged_case([1, 13, 1, 6], [45, 13, 37, 40], 6, 2, 64, torch.bfloat16,
                                       block_size=16, seed=8), 1.0, 1.0)
    decode = AttentionConfig(block_q=8, block_n=16, num_splits=decode_split)
    prefill = AttentionConfig(block_q=4, block_n=32, num_splits=2)
    out = _run(case, 1.0, 1.0, prefill, decode)
    assert_close_to_reference(out, reference_attention(case), torch.bfloat16)


def test_torch_reference_path_reads_fp8_cache():
    # The batched torch path reads padding under a mask (SDPA then turns NaN poison into
    # NaN), so this case's unowned slots hold zeros.
    case = make_paged_case(*MIXED_STEP, 8, 2, 64, torch.float32, block_size=4, seed=4)
    case.k_cache.nan_to_num_(0.0)
    case.v_cache.nan_to_num_(0.0)
    case = to_fp8_case(case, 2.0, 0.5)
    out = reference.paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale, 2.0, 0.5)
    assert_close_to_reference(out, reference_attention(case, 2.0, 0.5), torch.float32,
                              _fp8_attention_bound(case, 2.0, 0.5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_write_then_attend_within_propagated_e4m3_bound(dtype):
    exact = make_paged_case([1, 6], [20, 6], 8, 2, 64, dtype, block_size=4, seed=12)
    k_scale, v_scale = 0.5, 0.5
    q8 = to_fp8_case(exact, 1.0, 1.0)  # allocates fp8 caches with the same NaN poison
    owned = ~torch.isnan(exact.k_cache.float().view(-1, *exact.k_cache.shape[2:]))[:, 0, 0]
    slots = torch.nonzero(owned).flatten()
    flat = lambda c: c.view(-1, *c.shape[2:])  # noqa: E731
    triton_kv_write.write_kv(flat(exact.k_cache)[slots], flat(exact.v_cache)[slots], q8.k_cache, q8.v_cache, slots,
                             k_scale=k_scale, v_scale=v_scale)
    out = _run(q8, k_scale, v_scale)
    expected = reference_attention(exact)
    atol, _ = TOLERANCES[torch.bfloat16] if dtype == torch.bfloat16 else (1e-5, 0)
    bound = propagated_bound(exact, k_scale, v_scale) + atol + TOLERANCES[torch.bfloat16][1] * expected.abs()
    assert_within(out, expected, bound, "fp8 cache written and attended vs float64 on the unquantised K/V")


def propagated_bound(case, k_scale: float, v_scale: float) -> torch.Tensor:
    """First-order bound of the output change when K and V carry e4m3 rounding errors.

    Score ``j`` moves by at most ``d_j = scale * sum_d |q_d| (2^-4 |k_jd| + 2^-6 k_scale)``;
    the softmax weights then move by ``p_j (d_j + sum_k p_k d_k)`` (times ``e^{2 max d}``
    for the higher orders), and V's own rounding adds ``2^-4 |v| + 2^-6 v_scale``.
    """
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    group = case.q.shape[1] // case.k_cache.shape[2]
    start = 0
    for s, (q_len, s_len) in enumerate(zip(case.meta.query_lens_host, case.meta.seq_lens_host)):
        table = case.meta.block_tables[s]
        k = reference._gather_context(case.k_cache, table, s_len).double().repeat_interleave(group, 1)
        v = reference._gather_context(case.v_cache, table, s_len).double().repeat_interleave(group, 1)
        q = case.q[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        visible = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        dk = E4M3_REL * k.abs() + E4M3_ABS * k_scale
        d = torch.einsum("qhd,khd->hqk", q.abs(), dk) * case.scale
        weight_err = p * (d + (p * d).sum(-1, keepdim=True)) * torch.exp(2 * d.masked_fill(~visible, 0).amax())
        dv = E4M3_REL * v.abs() + E4M3_ABS * v_scale
        out[start : start + q_len] = (torch.einsum("hqk,khd->qhd", weight_err, v.abs())
                                      + torch.einsum("hqk,khd->qhd", p, dv))
        start += q_len
    return out


def _fp8_attention_bound(case, k_scale: float, v_scale: float) -> float:
    """The float32 compute bound of ``attention_bound`` on the dequantised cache."""
    wide = type(case)(case.q, case.k_cache.double() * k_scale, case.v_cache.double() * v_scale, case.meta, case.scale)
    return attention_bound(wide)


def test_scales_rejected_for_a_non_fp8_cache():
    case = make_paged_case([1], [3], 4, 4, 64, torch.float16, block_size=4, seed=1)
    with pytest.raises(ValueError, match="fp8 cache only"):
        triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, k_scale=2.0)
    assert math.isfinite(E4M3_REL)
