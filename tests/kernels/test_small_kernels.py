"""Triton KV write, fused RMSNorm and rotary (interpreter) vs the float64 references.

Outputs come from NaN-poisoned allocations; the KV cache is NaN before the write, so
both a missed slot and a write to a wrong slot show up. Inputs are strided views of a
fused QKV projection where the model would pass one.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels import reference, triton_ops
from pagoda.kernels.metadata import AttentionMetadata
from tests.numerics import gamma
from tests.kernels.kernel_cases import TOLERANCES, assert_close_to_reference, poisoned_allocations

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_DIMS = [64, 80, 128]


def fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen):
    """q, k, v as the strided views a fused QKV projection yields."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
def test_write_kv(dtype, head_dim, num_kv_heads):
    gen = torch.Generator().manual_seed(head_dim * 10 + num_kv_heads)
    block_size, num_blocks = 4, 12
    # A decode at a block boundary, a fresh prefill and a chunk after cached context.
    meta = AttentionMetadata.build([1, 6, 3], [5, 6, 10], [[7, 2], [0, 11], [4, 9, 1]], block_size)
    _, k, v = fused_qkv(10, 2, num_kv_heads, head_dim, dtype, gen)
    assert not k.is_contiguous()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    reference.write_kv(k, v, k_ref, v_ref, meta.slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


def test_write_kv_skips_negative_slots():
    k = torch.randn(3, 2, 64)
    cache = torch.zeros(2, 4, 2, 64)
    v_cache = torch.zeros_like(cache)
    triton_ops.write_kv(k, k, cache, v_cache, torch.tensor([5, -1, 0]))
    flat = cache.view(-1, 2, 64)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[0], k[2])
    assert int((flat.abs().sum((1, 2)) != 0).sum()) == 2, "the padding token was written somewhere"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype) if with_residual else None
    x_before = x.clone()
    with poisoned_allocations():
        out, new_residual = triton_ops.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(x, x_before), "input modified"
    if residual is None:
        ref_out, _ = reference.rms_norm(x.double(), weight.double(), 1e-6)
        assert new_residual is None
    else:
        # The residual sum is rounded to the input dtype before the norm, as in the reference.
        summed = (x.double() + residual.double()).to(dtype)
        ref_out, _ = reference.rms_norm(summed.double(), weight.double(), 1e-6)
        ref_sum = reference.rms_norm(x, weight, 1e-6, residual)[1]
        # Exact, except that the interpreter rounds fp32 -> bf16 toward zero (the GPU
        # rounds to nearest): allow one bf16 ulp there.
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0
        torch.testing.assert_close(new_residual, ref_sum, atol=0, rtol=ulp)
    assert out.dtype == dtype and out.shape == x.shape
    # float32: the mean square sums `hidden` terms (relative error gamma_hidden, halved by the
    # rsqrt), then two roundings of the product with x and the weight.
    fp32_bound = (gamma(hidden, torch.float32) + 3 * 2.0**-24) * ref_out.abs().max().item()
    assert_close_to_reference(out, ref_out, dtype, fp32_bound)


def test_rms_norm_fp32_weight_with_bf16_activations():
    x = torch.randn(3, 128).bfloat16()
    weight = torch.rand(128) + 0.5
    out, _ = triton_ops.rms_norm(x, weight, 1e-5)
    ref, _ = reference.rms_norm(x.double(), weight.double(), 1e-5)
    assert_close_to_reference(out, ref, torch.bfloat16)


def llama3_cos_sin_cache(head_dim: int, max_positions: int, base: float = 500000.0) -> torch.Tensor:
    """cos | sin per position with llama3 frequency scaling (factor 8, original 8192)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= original / low) & (wavelen >= original / high)
    scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * scaled[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", [(8, 2), (9, 3)], ids=str)
def test_apply_rotary(dtype, head_dim, heads):
    gen = torch.Generator().manual_seed(head_dim + heads[0])
    q, k, _ = fused_qkv(6, *heads, head_dim, dtype, gen)
    positions = torch.tensor([0, 17, 3, 9000, 17, 1], dtype=torch.int64)  # unsorted, repeated, > 8192
    cache = llama3_cos_sin_cache(head_dim, 9001)
    q_before, k_before = q.clone(), k.clone()
    with poisoned_allocations():
        q_out, k_out = triton_ops.apply_rotary(q, k, positions, cache)
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "input modified"
    q_ref, k_ref = reference.apply_rotary(q.double(), k.double(), positions, cache.double())
    assert_close_to_reference(q_out, q_ref, dtype)
    assert_close_to_reference(k_out, k_ref, dtype)


def test_apply_rotary_cache_in_model_dtype():
    gen = torch.Generator().manual_seed(0)
    q, k, _ = fused_qkv(4, 4, 2, 64, torch.bfloat16, gen)
    cache = llama3_cos_sin_cache(64, 32).bfloat16()
    positions = torch.tensor([3, 31, 0, 7])
    q_out, k_out = triton_ops.apply_rotary(q, k, positions, cache)
    q_ref, k_ref = reference.apply_rotary(q.double(), k.double(), positions, cache.double())
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(q_out.double(), q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out.double(), k_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_torch_rotary_is_the_two_halves_formula_bit_for_bit(dtype):
    """reference.apply_rotary computes ``x * [c, c] + roll(x) * [-s, s]`` with tables made once
    per step; it must equal the textbook ``(x1 c - x2 s, x2 c + x1 s)`` exactly, and see a
    positions buffer refilled in place (the tables are keyed by the tensor and its version)."""
    def textbook(x, positions, cache):
        half = cache.shape[1] // 2
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        cs = cache[positions].unsqueeze(1).to(acc)
        x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
        c, s = cs[..., :half], cs[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(37, 8, 128, generator=gen).to(dtype), torch.randn(37, 2, 128, generator=gen).to(dtype)
    positions, cache = torch.randint(0, 4000, (37,), generator=gen), torch.randn(4096, 128, generator=gen)
    for _ in range(2):
        q_out, k_out = reference.apply_rotary(q, k, positions, cache)
        assert torch.equal(q_out, textbook(q, positions, cache)) and torch.equal(k_out, textbook(k, positions, cache))
        positions.add_(1)  # the next step, in the same buffer
