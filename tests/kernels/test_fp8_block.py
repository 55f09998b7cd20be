"""Block-scaled FP8 (DeepSeek-V3's 128 x 128 ``weight_scale_inv``) in the Triton kernels, interpreted,
against float64: the W8A16 GEMM with block scales (decode rows with split-K, a 17-row tile, a
64-row tile; N and K that end inside a block, so the last block row and column are partial) and
the fused MoE experts with e4m3 stacks, each within a bound derived from its reduction lengths
(float32) or a few units of the last place (bf16); NaN-poisoned allocations, so an unwritten
element fails. The CPU paths (``dequantize_blocks`` + ``F.linear``; the experts loop) equal the
float weights they stand for exactly."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference_moe, triton_moe, triton_w8a16, w8a16
from pagoda.models.moe import group_by_expert, route
from tests.kernels.kernel_cases import poisoned_allocations
from tests.numerics import assert_within, gamma, moe_dense_reference, moe_rounding_bound

BLOCK = 128


def block_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values over their range and a scale per 128 x 128 block spanning 3 decades."""
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.logspace(-3, 0, -(-n // BLOCK) * -(-k // BLOCK))[torch.randperm(-(-n // BLOCK) * -(-k // BLOCK),
                                                                                  generator=gen)]
    return q, scale.view(-(-n // BLOCK), -(-k // BLOCK))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_scaled_gemm_equals_float64(dtype):
    gen = torch.Generator().manual_seed(0)
    n, k = 200, 300  # 2 x 3 blocks, the last of each partial
    q, scale = block_weight(n, k, gen)
    weight = w8a16.dequantize_blocks(q, scale, BLOCK, torch.float64)
    for m in (1, 17, 64):
        x = torch.randn(m, k, generator=gen).to(dtype)
        with poisoned_allocations():
            out = triton_w8a16.w8a16_linear(x, q, scale, block=BLOCK)
        exact = x.double() @ weight.T
        magnitude = x.double().abs() @ weight.abs().T
        if dtype == torch.float32:  # K products and a scale per block, in fp32: gamma_{K + blocks}
            assert_within(out, exact, gamma(k + 3, torch.float32) * magnitude, f"{m} rows")
        else:  # plus the output's rounding to bf16 (the interpreter truncates: a whole ulp)
            assert_within(out, exact, gamma(k + 3, torch.float32) * magnitude + 2 ** -7 * exact.abs(), f"{m} rows")


def test_block_scaled_gemm_cpu_path_is_the_dequantized_weight():
    gen = torch.Generator().manual_seed(1)
    q, scale = block_weight(130, 260, gen)
    x = torch.randn(5, 260, generator=gen)
    expected = torch.nn.functional.linear(x, w8a16.dequantize_blocks(q, scale, BLOCK, torch.float32))
    assert torch.equal(w8a16.w8a16_block_linear_ref(x, q, scale, BLOCK), expected)
    with pytest.raises(ValueError, match="block 128"):
        triton_w8a16.w8a16_linear(x, q, scale[:1], block=BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_experts_equal_float64(dtype):
    """4 experts of intermediate 128 (one block row each for gate and up), hidden 160 (two
    block columns, the second partial), top-2 over 9 tokens."""
    gen = torch.Generator().manual_seed(2)
    experts, hidden, inter, top_k, tokens = 4, 160, 128, 2, 9
    w13, s13 = zip(*(block_weight(2 * inter, hidden, gen) for _ in range(experts)))
    w2, s2 = zip(*(block_weight(hidden, inter, gen) for _ in range(experts)))
    w13, s13, w2, s2 = torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype) * 0.002
    weights, ids = route(torch.randn(tokens, experts, generator=gen).to(dtype), top_k, True)
    groups = group_by_expert(ids, weights, experts)
    args = (x, groups.order, groups.weights, groups.offsets, w13, w2, top_k)
    with poisoned_allocations():
        out = triton_moe.moe_experts(*args, block_scales=(s13, s2, BLOCK))
    float13 = torch.stack([w8a16.dequantize_blocks(w13[e], s13[e], BLOCK, torch.float64) for e in range(experts)])
    float2 = torch.stack([w8a16.dequantize_blocks(w2[e], s2[e], BLOCK, torch.float64) for e in range(experts)])
    expected = moe_dense_reference(x, ids, weights, float13, float2)
    bound = moe_rounding_bound(x, ids, weights, float13, float2, dtype)
    assert_within(out, expected, bound, "fused fp8 experts")
    cpu = reference_moe.moe_experts(*args, block_scales=(s13, s2, BLOCK))
    assert_within(cpu, expected, bound, "fp8 experts, CPU path")
