"""The W4A16 Triton kernel against a float64 reference under TRITON_INTERPRET=1: group sizes
(32, 128, channel), odd M/N/K (masks, a partial last group), zero points and the symmetric
form, act-order permutations, split-K and its reduction, fp16/bf16/fp32 activations,
NaN-poisoned allocations; the torch reference and the packing round trip."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import triton_w4a16, w4a16
from tests.kernels.kernel_cases import poisoned_allocations
from tests.numerics import UNIT_ROUNDOFF, assert_within, gamma

# (N, K, group) -> row counts. K=133 with group 32: a partial last group and odd K;
# K=521 at group 128 spans split-K blocks with a ragged end; group = K is channel-wise.
CASES = {(77, 133, 32): [1, 5, 17, 80], (50, 521, 128): [1, 17], (40, 96, 96): [3]}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make_weight(n: int, k: int, group: int, gen: torch.Generator, symmetric: bool):
    """Nibbles over their whole range, group scales over 4 decades, integer zero points."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int16)
    groups = -(-k // group)
    scales = torch.logspace(-4, 0, n * groups)[torch.randperm(n * groups, generator=gen)].reshape(n, groups)
    zeros = None if symmetric else torch.randint(0, 16, (n, groups), generator=gen).float()
    return q, w4a16.pack_int4(q), scales, zeros


def exact_weight(q, scales, zeros, group) -> torch.Tensor:
    g = torch.arange(q.shape[1]) // group
    zero = 8.0 if zeros is None else zeros.double()[:, g]
    return (q.double() - zero) * scales.double()[:, g]


def bound(x: torch.Tensor, weight: torch.Tensor, weight_rounding: bool) -> torch.Tensor:
    """Derived bound (tests/numerics.py): fp32 sums of K exact products, each block's partial
    scaled once and added (at most K + 2 roundings per term: ``gamma_{K+2}`` of ``sum |x w|``),
    then one rounding to the output dtype (a whole ulp, as the interpreter truncates bf16);
    the reference path also rounds the weight to the activation dtype (one more ``u``)."""
    magnitude = x.double().abs() @ weight.abs().T
    exact = x.double() @ weight.T
    u = 2 * UNIT_ROUNDOFF[x.dtype] if x.dtype != torch.float32 else 0.0
    rel = gamma(x.shape[-1] + 2, torch.float32) + (UNIT_ROUNDOFF[x.dtype] if weight_rounding else 0.0)
    return rel * magnitude * (1 + u) + u * exact.abs() + 1e-300


@pytest.mark.parametrize("symmetric", [False, True], ids=["zero-points", "symmetric"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(CASES))
def test_kernel_matches_float64_reference(shape, dtype, symmetric):
    n, k, group = shape
    gen = torch.Generator().manual_seed(n + k + group)
    q, packed, scales, zeros = make_weight(n, k, group, gen, symmetric)
    weight = exact_weight(q, scales, zeros, group)
    for m in CASES[shape]:
        x = torch.randn(m, k, generator=gen).to(dtype)
        with poisoned_allocations():
            out = triton_w4a16.w4a16_linear(x, packed, scales, zeros, group)
        assert out.dtype == dtype and out.shape == (m, n)
        cfg = w4a16.choose_config(m, n, k, group, 132, x.element_size())
        assert_within(out, x.double() @ weight.T, bound(x, weight, False), f"{dtype} M={m} {cfg}")


def test_act_order_permutation_gathers_the_activation():
    gen = torch.Generator().manual_seed(5)
    n, k, group = 48, 128, 32
    q, packed, scales, zeros = make_weight(n, k, group, gen, symmetric=False)
    perm = torch.randperm(k, generator=gen)
    x = torch.randn(7, k, generator=gen).to(torch.float16)
    weight = exact_weight(q, scales, zeros, group)  # over the permuted K order
    exact = x.double()[:, perm] @ weight.T
    with poisoned_allocations():
        out = triton_w4a16.w4a16_linear(x, packed, scales, zeros, group, perm=perm)
    assert_within(out, exact, bound(x[:, perm], weight, False), "act-order")
    ref = w4a16.w4a16_linear_ref(x, packed, scales, zeros, group, perm=perm)
    assert_within(ref, exact, bound(x[:, perm], weight, True), "act-order reference")


def test_split_k_and_group_sized_blocks():
    cfg = w4a16.choose_config(1, 50, 521, 128, 132)
    assert cfg.block_k == 128 and cfg.split_k >= 2  # decode: the K blocks spread over the SMs
    assert w4a16.choose_config(1, 4096, 4096, 128, 132).split_k == 8  # 64 tiles x 8 splits: 512 programs
    assert w4a16.choose_config(80, 77, 133, 32, 132, 4).block_k == 32
    assert w4a16.choose_config(3, 40, 96, 96, 132).block_k == 256  # one group spans K: any block
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a16.choose_config(1, 64, 64, 8, 132)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64(dtype):
    gen = torch.Generator().manual_seed(3)
    q, packed, scales, zeros = make_weight(77, 133, 32, gen, symmetric=False)
    weight = exact_weight(q, scales, zeros, 32)
    x = torch.randn(17, 133, generator=gen).to(dtype)
    out = w4a16.w4a16_linear_ref(x, packed, scales, zeros, 32)
    assert_within(out, x.double() @ weight.T, bound(x, weight, True), f"ref {dtype}")


def test_packing_round_trip_and_bad_shapes():
    q = torch.randint(0, 16, (5, 7), dtype=torch.int16)
    packed = w4a16.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 4)
    assert torch.equal(w4a16.unpack_int4(packed, 7), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)  # even k in the low nibble
    scales = torch.ones(5, 1)
    with pytest.raises(ValueError, match="w4a16_linear"):
        triton_w4a16.w4a16_linear(torch.zeros(2, 8), packed, scales, None, 7)
    assert triton_w4a16.w4a16_linear(torch.zeros(0, 7), packed, scales, None, 7).shape == (0, 5)
