"""kernels/csrc/cpu_int8.cpp (+ the AMX-INT8 tiles of cpu_amx.cpp): the W8A8 matmul against its
float64 definition (models.w8a8.w8a8_linear_ref), every kernel against the others bit for bit,
batch invariance, and the op's refusals."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_native
from pagoda.models.quant import quantize_int8
from pagoda.models.w8a8 import W8A8Weight, quantize_rows, w8a8_linear_ref

pytestmark = pytest.mark.skipif(cpu_native.build() is not None, reason="no C++ kernels")
EPS32, EPS16 = 2.0**-24, 2.0**-8  # unit roundoff of float32, bfloat16


def _kernels() -> list[str]:
    features = cpu_native.loaded_ops().int8_features()
    return ["plain", "vector"] + (["amx"] if "amx-int8" in features else [])


def _bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|out - ref|: the sum is an exact integer; float(sum) (one rounding once |sum| > 2^24), the
    scale product and the product with it (two), the bias add (one): 4 float32 roundings of at
    most the result's size plus the bias's, then one rounding to ``dtype``."""
    return 5 * EPS32 * ref.abs() + (EPS16 if dtype == torch.bfloat16 else 0.0) * ref.abs() * 1.01 + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (100, 70), (576, 1536)])
def test_every_kernel_equals_the_float64_definition(dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    weight = W8A8Weight(w)
    qweight, w_scale = quantize_int8(w)
    results = []
    for rows in (1, 5, 16, 37):
        x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
        x[0, 0] = 40.0  # an outlier sets its row's scale
        bias = torch.randn(n, generator=gen)
        ref = w8a8_linear_ref(x, qweight, w_scale, bias)
        outs = []
        for kernel in _kernels():
            weight.kernel = kernel
            out = weight.matmul(x, bias)
            assert out.dtype == dtype and out.shape == (rows, n)
            assert ((out.double() - ref).abs() <= _bound(ref, dtype)).all(), (kernel, rows)
            outs.append(out)
        for other in outs[1:]:  # exact integer sums, one finishing order: the same bits
            assert torch.equal(other, outs[0])
        results.append(outs[0])
    assert results


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    gen = torch.Generator().manual_seed(1)
    weight = W8A8Weight(torch.randn(1536, 576, generator=gen))
    x = torch.randn(70, 576, generator=gen)
    whole = weight.matmul(x)  # 70 rows: AMX where granted
    for rows in (1, 7, 15, 16, 33):
        assert torch.equal(weight.matmul(x[:rows]), whole[:rows])
    assert torch.equal(weight.matmul(x.view(7, 10, 576)), whole.view(7, 10, 1536))


def test_quantization_of_a_row_and_its_extremes():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [254.0, 127.0, -1.0]])
    q, scale = quantize_rows(x)
    assert scale.tolist()[0] == 1.0 and q[0].tolist() == [0, 0, 0]  # a zero row keeps scale 1
    assert q[1].tolist() == [64, -127, 32] and q[2].tolist() == [127, 64, 0]  # halves to even: 63.5 -> 64
    weight = W8A8Weight(torch.eye(3))
    out = weight.matmul(x)
    assert torch.equal(out[0], torch.zeros(3))
    assert torch.allclose(out, (q.float() * scale[:, None]), rtol=1e-6, atol=0)


def test_the_op_names_what_is_wrong():
    ops = cpu_native.loaded_ops()
    packed, comp = ops.pack_int8(torch.zeros(32, 64, dtype=torch.int8))
    scale = torch.ones(32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.linear_w8a8(torch.zeros(2, 64, dtype=torch.float16), packed, comp, scale, 32, None)
    with pytest.raises(RuntimeError, match="packed for K=64, x has K=65"):
        ops.linear_w8a8(torch.zeros(2, 65), packed, comp, scale, 32, None)
    with pytest.raises(RuntimeError, match="w_scale must be"):
        ops.linear_w8a8(torch.zeros(2, 64), packed, comp, torch.ones(31), 32, None)
    with pytest.raises(RuntimeError, match="an int8"):
        ops.pack_int8(torch.zeros(32, 64))
    with pytest.raises(RuntimeError, match="kernel must be"):
        ops.linear_w8a8(torch.zeros(2, 64), packed, comp, scale, 32, None, "gpu")
