"""The fused MoE kernels (kernels/triton_moe.py, under the interpreter) against float64.

Cases: tokens spread over the experts with some idle, every token routed to one expert,
top-k equal to the number of experts, odd token counts and hidden/intermediate sizes off
the tile grid, in fp32/bf16/fp16, with NaN-poisoned scratch buffers (every row the kernels
leave unwritten would show). Reference: every expert on every token in float64, masked by
the routing (``tests.numerics.moe_dense_reference``); bound: ``moe_rounding_bound`` (a
first-order bound for fp32-accumulated matmuls rounded once to the dtype, derived in its
docstring).
"""

from __future__ import annotations

import pytest
import torch

from pagoda import kernels
from pagoda.kernels import reference_moe, reload_settings, triton_ops
from pagoda.kernels.triton_moe import BLOCK_M, block_schedule
from pagoda.models.moe import group_by_expert, route
from tests.kernels.kernel_cases import poisoned_allocations
from tests.numerics import assert_within, moe_dense_reference, moe_rounding_bound

HIDDEN, INTER = 72, 40  # neither a multiple of the 64-wide tiles


def _case(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, routing: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if routing == "one-expert":
        logits[:, 2] += 100.0  # top-1 is expert 2 for everyone
    elif routing == "idle-experts":
        logits[:, 1::2] -= 100.0  # odd experts never chosen
    weights, ids = route(logits.to(dtype), top_k, renormalize=True)
    return x, w13, w2, weights, ids


CASES = {  # name -> (tokens, experts, top_k, routing)
    "decode-1-token": (1, 8, 2, "spread"),
    "odd-33-tokens": (33, 8, 2, "spread"),
    "idle-experts": (7, 8, 3, "idle-experts"),
    "one-expert": (19, 4, 1, "one-expert"),
    "top-k-equals-experts": (5, 4, 4, "spread"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_moe_matches_float64(name, dtype):
    num_tokens, num_experts, top_k, routing = CASES[name]
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, dtype, routing, seed=num_tokens)
    groups = group_by_expert(ids, weights, num_experts)
    with poisoned_allocations():
        out = triton_ops.moe_experts(x, groups.order, groups.weights, groups.offsets, w13, w2, top_k)
    assert out.dtype == dtype and out.shape == x.shape
    bound = moe_rounding_bound(x, ids, weights, w13, w2, dtype)
    assert_within(out, moe_dense_reference(x, ids, weights, w13, w2), bound, f"triton moe {name} {dtype}")
    torch_path = reference_moe.moe_experts(x, groups.order, groups.weights, groups.offsets, w13, w2, top_k)
    assert_within(torch_path, moe_dense_reference(x, ids, weights, w13, w2), bound, f"torch moe {name} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["decode-1-token", "odd-33-tokens", "idle-experts"])
def test_gelu_tanh_experts_match_float64(name, dtype):
    """Gemma 4's experts: ``gelu_tanh(gate) * up`` (the kernel's tanh as ``2 sigmoid(2 z) - 1``),
    gate/up scaled so that the GELU's curved region and its negative tail both occur."""
    num_tokens, num_experts, top_k, routing = CASES[name]
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, dtype, routing, seed=num_tokens + 7)
    w13 = (w13.float() * 3).to(dtype)
    groups = group_by_expert(ids, weights, num_experts)
    args = (x, groups.order, groups.weights, groups.offsets, w13, w2, top_k)
    with poisoned_allocations():
        out = triton_ops.moe_experts(*args, activation="gelu_tanh")
    expected = moe_dense_reference(x, ids, weights, w13, w2, activation="gelu_tanh")
    bound = moe_rounding_bound(x, ids, weights, w13, w2, dtype, activation="gelu_tanh")
    assert_within(out, expected, bound, f"triton gelu moe {name} {dtype}")
    assert_within(reference_moe.moe_experts(*args, activation="gelu_tanh"), expected, bound,
                  f"torch gelu moe {name} {dtype}")
    if dtype == torch.float32:  # (bf16's bound is wider than the two activations' difference)
        silu = moe_dense_reference(x, ids, weights, w13, w2)
        assert ((expected - silu).abs() > bound).any(), "the activation must matter beyond the bound"
    with pytest.raises(ValueError, match="MoE activation 'relu'"):
        triton_ops.moe_experts(*args, activation="relu")


ALPHA_LIMIT = (1.702, 7.0)  # gpt-oss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["odd-33-tokens", "idle-experts", "top-k-equals-experts"])
def test_gpt_oss_experts_match_float64(name, dtype):
    """gpt-oss experts: gate/up and down biases and the clamped SwiGLU (weights scaled up so
    that both clamps bite: some |gate| and |up| exceed the limit 7)."""
    num_tokens, num_experts, top_k, routing = CASES[name]
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, dtype, routing, seed=num_tokens + 1)
    gen = torch.Generator().manual_seed(5)
    w13 = (w13.float() * 6).to(dtype)
    b13 = torch.randn(num_experts, 2 * INTER, generator=gen).to(dtype)
    b2 = torch.randn(num_experts, HIDDEN, generator=gen).to(dtype)
    gate_up = torch.einsum("th,eoh->teo", x.double(), w13.double())
    assert (gate_up > 7).any() and (gate_up < -7).any(), "the clamps must matter"
    groups = group_by_expert(ids, weights, num_experts)
    args = (x, groups.order, groups.weights, groups.offsets, w13, w2, top_k, b13, b2, ALPHA_LIMIT)
    with poisoned_allocations():
        out = triton_ops.moe_experts(*args)
    expected = moe_dense_reference(x, ids, weights, w13, w2, b13, b2, ALPHA_LIMIT)
    bound = moe_rounding_bound(x, ids, weights, w13, w2, dtype, b13, b2, ALPHA_LIMIT)
    assert_within(out, expected, bound, f"triton gpt-oss moe {name} {dtype}")
    assert_within(reference_moe.moe_experts(*args), expected, bound, f"torch gpt-oss moe {name} {dtype}")
    plain = moe_dense_reference(x, ids, weights, w13, w2)
    assert not torch.allclose(expected, plain), "biases and the clamped SwiGLU change the result"


def test_gate_up_biases_without_the_clamped_swiglu_are_refused():
    x, w13, w2, weights, ids = _case(3, 4, 2, torch.float32, "spread")
    groups = group_by_expert(ids, weights, 4)
    with pytest.raises(ValueError, match="gate/up biases come with clamped_swiglu"):
        triton_ops.moe_experts(x, groups.order, groups.weights, groups.offsets, w13, w2, 2,
                               torch.zeros(4, 2 * INTER), None, None)


def test_idle_experts_weights_are_never_read():
    x, w13, w2, weights, ids = _case(7, 8, 3, torch.float32, "idle-experts")
    w13[1::2] = float("nan")
    w2[1::2] = float("nan")
    groups = group_by_expert(ids, weights, 8)
    out = triton_ops.moe_experts(x, groups.order, groups.weights, groups.offsets, w13, w2, 3)
    assert torch.isfinite(out).all()


def test_row_blocks_never_straddle_experts_and_cover_every_assignment():
    ids = torch.tensor([[0, 3]] * 20 + [[3, 5]] * 3)  # expert 0: 20 rows, 3: 23, 5: 3, others idle
    groups = group_by_expert(ids, torch.ones(ids.shape), 6)
    expert, start, end = block_schedule(groups.offsets, ids.numel())
    covered = []
    for e, s, stop in zip(expert.tolist(), start.tolist(), end.tolist()):
        if e == 6:
            continue  # past the padded total: the kernels return at once
        assert groups.offsets[e] <= s < stop == groups.offsets[e + 1]
        covered += range(s, min(s + BLOCK_M, stop))
    assert covered == list(range(ids.numel()))
    assert sorted(set(expert.tolist()) - {6}) == [0, 3, 5]
    # shapes only: the grid size needs no device read (meta tensors have no data)
    meta = block_schedule(torch.empty(7, dtype=torch.int64, device="meta"), 46)
    assert meta[0].shape == (46 // BLOCK_M + 1 + 6,)


def test_dispatch_picks_by_device_and_override(monkeypatch):
    x, w13, w2, weights, ids = _case(3, 4, 2, torch.float32, "spread")
    groups = group_by_expert(ids, weights, 4)
    calls = []
    monkeypatch.setattr(triton_ops, "moe_experts", lambda *args: calls.append("triton") or args[0])
    args = (x, groups.order, groups.weights, groups.offsets, w13, w2, 2)
    kernels.moe_experts(*args)  # CPU tensors: the torch path
    assert calls == []
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    reload_settings()
    kernels.moe_experts(*args)
    assert calls == ["triton"]
