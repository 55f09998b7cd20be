"""The W8A16 Triton kernel (int8 and fp8 e4m3 weights) against a float64 reference, under
TRITON_INTERPRET=1: decode and prefill row counts, odd N and K (masks), split-K and its
reduction, all three activation dtypes, strided activations, NaN-poisoned allocations
(an output element the kernel forgets to write fails); and the dispatch point's choice."""

from __future__ import annotations

import pytest
import torch

from pagoda import kernels
from pagoda.kernels import reload_settings, triton_w8a16, w8a16
from tests.kernels.kernel_cases import poisoned_allocations
from tests.numerics import UNIT_ROUNDOFF, assert_within, gamma

# (N, K) -> row counts: odd N and K at every row count; K=521 spans three 256-wide K
# blocks (split-K 2 with a ragged last split), at fewer rows to keep the interpreter quick.
CASES = {(77, 133): [1, 5, 16, 17, 80], (50, 521): [1, 17]}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make_weight(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit weight using its whole range, and per-channel scales spanning 4 decades."""
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.logspace(-4, 0, n)[torch.randperm(n, generator=gen)]
    return q, scale


def w8a16_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, weight_rounding: bool) -> torch.Tensor:
    """Derived bound on ``|kernel - exact|`` (tests/numerics.py).

    fp32 accumulation of K products, then the scale and the output rounding: ``gamma_{K+2}``
    of ``sum_k |x_k w_nk|``, plus one rounding to the output dtype of the result. The
    8-bit-to-activation conversion is exact (every int8 and e4m3 value fits fp16/bf16/fp32).
    ``weight_rounding``: the reference path rounds the dequantized weight to the activation
    dtype first (one more ``u`` of the magnitude). The output rounding is allowed a whole
    ulp (``2u``): the Triton interpreter converts fp32 to bf16 by truncation (measured:
    errors up to 2^-7 relative), compiled code rounds to nearest.
    """
    deq = q.double() * scale.double()[:, None]
    magnitude = x.double().abs() @ deq.abs().T
    exact = x.double() @ deq.T
    u = 2 * UNIT_ROUNDOFF[x.dtype] if x.dtype != torch.float32 else 0.0
    rel = gamma(x.shape[-1] + 2, torch.float32) + (UNIT_ROUNDOFF[x.dtype] if weight_rounding else 0.0)
    return rel * magnitude * (1 + u) + u * exact.abs() + 1e-300


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(CASES))
def test_kernel_matches_float64_reference(kind, dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    q, scale = make_weight(kind, n, k, gen)
    for m in CASES[shape]:
        x = torch.randn(m, k, generator=gen).to(dtype)
        with poisoned_allocations():
            out = triton_w8a16.w8a16_linear(x, q, scale)
        assert out.dtype == dtype and out.shape == (m, n)
        exact = x.double() @ (q.double() * scale.double()[:, None]).T
        cfg = w8a16.choose_config(m, n, k, 132, x.element_size())
        assert_within(out, exact, w8a16_bound(x, q, scale, False), f"{kind} {dtype} M={m} {cfg}")


def test_split_k_is_exercised():
    assert w8a16.choose_config(1, 50, 521, 132).split_k == 2
    assert w8a16.choose_config(80, 77, 133, 132, 4).split_k == 4
    assert w8a16.choose_config(1, 4096, 4096, 132).split_k == 8  # Llama-3-8B o_proj at batch 1: 512 programs
    assert w8a16.choose_config(4096, 4096, 4096, 132).split_k == 1


def test_strided_and_batched_activations():
    gen = torch.Generator().manual_seed(1)
    q, scale = make_weight("int8", 77, 133, gen)
    wide = torch.randn(2, 3, 200, generator=gen).to(torch.float16)
    x = wide[..., 10:143]  # [2, 3, 133], row stride 200
    with poisoned_allocations():
        out = triton_w8a16.w8a16_linear(x, q, scale)
    assert out.shape == (2, 3, 77)
    flat = x.reshape(-1, 133)
    exact = flat.double() @ (q.double() * scale.double()[:, None]).T
    assert_within(out.reshape(-1, 77), exact, w8a16_bound(flat, q, scale, False), "strided x")
    assert triton_w8a16.w8a16_linear(x[:0], q, scale).shape == (0, 3, 77)
    with pytest.raises(ValueError, match="w8a16_linear"):
        triton_w8a16.w8a16_linear(torch.zeros(2, 132), q, scale)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64(kind, dtype):
    gen = torch.Generator().manual_seed(2)
    q, scale = make_weight(kind, 77, 133, gen)
    x = torch.randn(17, 133, generator=gen).to(dtype)
    exact = x.double() @ (q.double() * scale.double()[:, None]).T
    assert_within(w8a16.w8a16_linear_ref(x, q, scale), exact, w8a16_bound(x, q, scale, True), f"ref {kind} {dtype}")


def test_e4m3_bit_conversion_is_exact_on_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = ~codes.float().isnan()
    assert torch.equal(w8a16.e4m3_to_half_over_256(codes).float()[finite] * 256, codes.float()[finite])


def test_dispatch_point_picks_kernel_by_device_and_rows(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    q, scale = make_weight("int8", 77, 133, gen)
    x = torch.randn(5, 133, generator=gen)
    calls = []
    real = triton_w8a16.w8a16_linear
    monkeypatch.setattr(triton_w8a16, "w8a16_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.delenv("PAGODA_KERNELS", raising=False)
    reload_settings()
    kernels.w8a16_linear(x, q, scale)  # CPU tensor: the reference
    assert calls == []
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    reload_settings()
    kernels.w8a16_linear(x, q, scale)
    assert calls == [5]
    monkeypatch.setattr(w8a16, "DEQUANT_ROWS", 5)  # from DEQUANT_ROWS rows: dequantize + BLAS
    kernels.w8a16_linear(x, q, scale)
    kernels.w8a16_linear(x[:4], q, scale)
    assert calls == [5, 4]
