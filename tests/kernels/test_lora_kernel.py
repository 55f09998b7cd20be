"""The multi-LoRA kernels (under the interpreter) and the torch path against float64.

Tokens of several adapter slots and of none (-1) in one launch; ranks 8 to 64 (and the
fused-qkv width); odd in/out sizes off the tile grid; NaN-poisoned scratch buffers. Bound
(tests/numerics.py): the shrink sums ``in`` terms and the expand ``R`` terms in float32,
then one rounding to the output dtype, all at the scale of ``sum |B| |A| |x|``.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import kernels
from pagoda.kernels import reference, reload_settings, triton_ops
from pagoda.models.lora import LoRABatch
from tests.kernels.kernel_cases import poisoned_allocations
from tests.numerics import UNIT_ROUNDOFF, assert_within, gamma


def _case(num_tokens_per_request, slots, rank, in_f, out_f, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_slots = 3
    x = torch.randn(sum(num_tokens_per_request), in_f, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, in_f, generator=gen) / in_f**0.5).to(dtype)
    b = torch.randn(num_slots, out_f, rank, generator=gen).to(dtype)
    y = torch.randn(x.shape[0], out_f, generator=gen).to(dtype)
    batch = LoRABatch.build(slots, num_tokens_per_request, torch.device("cpu"))
    exact = y.double().clone()
    magnitude = torch.zeros_like(exact)
    for t, s in enumerate(batch.token_slots.tolist()):
        if s >= 0:
            exact[t] += b[s].double() @ (a[s].double() @ x[t].double())
            magnitude[t] = b[s].double().abs() @ (a[s].double().abs() @ x[t].double().abs())
    bound = (gamma(in_f + rank + 1, torch.float32) * magnitude
             + UNIT_ROUNDOFF[dtype] * (exact.abs() + magnitude) * (1 if dtype == torch.float32 else 2))
    return x, a, b, y, batch, exact, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [8, 64, 3 * 16])
def test_triton_lora_matches_float64(dtype, rank):
    # decode rows of slots 2, none, 0, then a prefill chunk of slot 1 and one of none
    lens, slots = [1, 1, 1, 5, 3], [2, -1, 0, 1, -1]
    x, a, b, y, batch, exact, bound = _case(lens, slots, rank, 200, 136, dtype, seed=rank)
    before = y.clone()
    with poisoned_allocations():
        out = triton_ops.lora_apply(y, x, a, b, batch.token_slots)
    assert out is y
    assert_within(y, exact, bound, f"triton lora rank {rank} {dtype}")
    untouched = batch.token_slots < 0
    assert torch.equal(y[untouched], before[untouched]), "tokens without an adapter must not change"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_lora_matches_float64(dtype):
    lens, slots = [4, 1, 2, 1], [1, -1, 1, 0]
    x, a, b, y, batch, exact, bound = _case(lens, slots, 16, 96, 40, dtype, seed=1)
    reference.lora_apply(y, x, a, b, batch.groups)
    # the torch path rounds the [tokens, R] intermediate to the dtype once more
    assert_within(y, exact, bound * 2, f"torch lora {dtype}")


def test_dispatch_picks_by_device_and_override(monkeypatch):
    lens, slots = [2, 1], [0, -1]
    x, a, b, y, batch, exact, bound = _case(lens, slots, 8, 32, 24, torch.float32)
    calls = []
    monkeypatch.setattr(triton_ops, "lora_apply", lambda *args: calls.append("triton") or args[0])
    kernels.lora_apply(y.clone(), x, a, b, batch)  # CPU tensors: torch path
    assert calls == []
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    reload_settings()
    kernels.lora_apply(y.clone(), x, a, b, batch)
    assert calls == ["triton"]
