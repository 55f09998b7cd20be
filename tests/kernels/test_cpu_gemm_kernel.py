"""pagoda's C++ CPU matmul (kernels/csrc/cpu_gemm.cpp, cpu_amx.cpp) against float64.

Every path (the vector tiles, the plain C++ tiles a CPU without AVX-512 runs, AMX for
bfloat16) within the bound of its arithmetic: float32 sums of K products
(``gamma_K * sum |x w|``), plus one bfloat16 rounding of the output for bfloat16. The plain
tiles must equal the vector tiles bit for bit (same products, same order), which is how the
fallback is checked on a machine that never runs it; a row's result must not depend on the
rows beside it. Shapes cover a partial last panel, an odd K, K past one k block and the
row-count edges of the tiles (8) and of AMX's (16, 32).
"""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.kernels import cpu_native
from tests.numerics import UNIT_ROUNDOFF, gamma

pytestmark = pytest.mark.skipif(cpu_native.build() is not None, reason=f"no C++ kernels: {cpu_native.build()}")

SHAPES = [(208, 576), (50, 37), (17, 3), (33, 300)]  # (N, K): 13 panels (a partial group), odd K, K > one 128 block
ROWS = [1, 7, 9, 17, 33, 70]


def ops():
    return cpu_native.loaded_ops()


def bound(x, w, bias, dtype):
    """|out - exact| for float32 sums of K products, then (bfloat16) one rounding of the output."""
    magnitude = x.double().abs() @ w.double().abs().T + (bias.double().abs() if bias is not None else 0)
    exact = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    out_rounding = UNIT_ROUNDOFF[dtype] * exact.abs() if dtype == torch.bfloat16 else 0
    return exact, gamma(x.shape[1] + 1, torch.float32) * magnitude + out_rounding + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_vector_tiles_within_the_bound_and_equal_to_the_plain_ones(dtype, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    packed = ops().pack_linear(w)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen) if rows % 2 else None
        out = ops().linear(x, packed, n, bias, "vector")
        exact, limit = bound(x, w, bias, dtype)
        assert out.dtype == dtype and out.shape == (rows, n)
        assert ((out.double() - exact).abs() <= limit).all(), (rows, ((out.double() - exact).abs() / limit).max())
        assert torch.equal(ops().linear(x, packed, n, bias, "plain"), out)  # the fallback, bit for bit
        assert torch.equal(ops().linear(x[-1:].contiguous(), packed, n, bias, "vector"), out[-1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_packing_puts_every_element_where_the_layout_says(dtype, n, k):
    """float32 ``[P, K, 16]``: ``packed[p, kk, j] = w[16p + j, kk]``; bfloat16 ``[P, Kp/2, 16, 2]``
    (Kp: K rounded up to 32): ``packed[p, kk // 2, j, kk % 2] = w[16p + j, kk]``; zero past N
    and K. Also from a transposed (non-contiguous) weight."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(dtype)  # no zero: padding shows
    assert (w != 0).all()
    panels, kp = -(-n // 16), (k if dtype == torch.float32 else -(-k // 32) * 32)
    padded = torch.zeros(panels * 16, kp, dtype=dtype)
    padded[:n, :k] = w
    expected = padded.view(panels, 16, kp).transpose(1, 2)  # [P, Kp, 16]
    if dtype == torch.bfloat16:
        expected = expected.reshape(panels, kp // 2, 2, 16).transpose(2, 3)
    for weight in (w, w.T.contiguous().T):
        packed = ops().pack_linear(weight)
        assert packed.is_contiguous() and torch.equal(packed, expected)


@pytest.mark.skipif(not cpu_native.loaded_ops() or not torch.cpu._is_amx_tile_supported(), reason="no AMX here")
@pytest.mark.parametrize("n,k", [(208, 576), (50, 64), (33, 96)])
def test_amx_within_the_bound(n, k):
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    packed = ops().pack_linear(w)
    for rows in (1, 5, 16, 17, 31, 32, 33, 70):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen) if rows % 2 else None
        out = ops().linear(x, packed, n, bias, "amx")
        exact, limit = bound(x, w, bias, torch.bfloat16)
        assert ((out.double() - exact).abs() <= limit).all(), (rows, ((out.double() - exact).abs() / limit).max())


def test_what_each_kernel_refuses():
    w = torch.randn(40, 24)
    packed = ops().pack_linear(w)
    with pytest.raises(RuntimeError, match="AMX serves bfloat16 only"):
        ops().linear(torch.randn(2, 24), packed, 40, None, "amx")
    with pytest.raises(RuntimeError, match="kernel must be auto, vector, plain or amx"):
        ops().linear(torch.randn(2, 24), packed, 40, None, "fast")
    with pytest.raises(RuntimeError, match="share one dtype"):
        ops().linear(torch.randn(2, 24).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="packed for K=24, x has K=25"):
        ops().linear(torch.randn(2, 25), packed, 40, None)
    odd = ops().pack_linear(torch.randn(40, 24).bfloat16())
    with pytest.raises(RuntimeError, match="AMX cannot serve this call"):  # K=24 is not a multiple of 32
        ops().linear(torch.randn(20, 24).bfloat16(), odd, 40, None, "amx")


def test_the_features_are_this_cpus():
    """The build is ``-march=native``: its vector tiles are those this CPU's flags allow."""
    with open("/proc/cpuinfo") as info:
        flags = next(line for line in info if line.startswith("flags")).split()
    features = cpu_native.gemm_features()
    assert ("avx512f" in features) == ("avx512f" in flags)
    assert ("avx512bf16" in features) == ("avx512_bf16" in flags)
    assert "amx" not in features or "amx_bf16" in flags


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PAGODA_TEST_AVX2_BUILD") != "1",
                    reason="PAGODA_TEST_AVX2_BUILD=1: compiles a second build (~1-2 min the first time)")
def test_an_avx2_only_build_serves_with_the_plain_tiles():
    """The build an AVX2-only EPYC makes (``-march=x86-64-v3``), compiled and run here in a
    process of its own (tests/kernels/cpu_gemm_avx2_check.py; cached after the first time).
    Opt-in so the suite does not pay the compile; the plain tiles' arithmetic is checked by
    default above (bit for bit against the vector tiles)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tests.kernels.cpu_gemm_avx2_check"], capture_output=True,
                          text=True, timeout=800)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
