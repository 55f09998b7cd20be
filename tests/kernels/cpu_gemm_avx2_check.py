"""Run by test_cpu_gemm_kernel.py in a process of its own (two builds cannot share the op
namespace): pagoda's C++ kernels built for an AVX2-only x86-64 (``-march=x86-64-v3``: no
AVX-512, no AMX, as on an AMD EPYC before Zen 4), the matmul's sources only, into torch's
extension cache under a name that hashes them. Checks that the build reports no vector-tile feature (so
``models.cpu_gemm`` packs for oneDNN there) and that its matmul, the plain C++ tiles, is
within the float32-accumulation bound of float64 (plus one bfloat16 rounding) and the same
whatever kernel is asked for; that its W8A8 matmul (plain C++ int8 sums) equals the float64
definition within its bound (tests/kernels/test_cpu_int8.py's); and that its decode attention (the
portable loops, not the AVX-512 tiles) equals the float64 reference within the attention bound.
Prints OK."""

from __future__ import annotations

import hashlib

import torch
from torch.utils import cpp_extension

from pagoda.kernels import cpu_native
from tests.numerics import UNIT_ROUNDOFF, gamma

FLAGS = [f for f in cpu_native._FLAGS if f != "-march=native"] + ["-march=x86-64-v3"]
SOURCES = [p for p in cpu_native._SOURCES if p.name in ("cpu_attention.cpp", "cpu_gemm.cpp", "cpu_amx.cpp",
                                                          "cpu_int8.cpp")]


def load() -> None:
    digest = hashlib.sha1("".join(FLAGS + [torch.__version__]).encode())
    for path in sorted(SOURCES + list(SOURCES[0].parent.glob("*.h"))):
        digest.update(path.read_bytes())
    name = f"pagoda_cpu_avx2_{digest.hexdigest()[:12]}"
    cpu_native._ninja_on_path()
    cpp_extension.load(name, [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)


def main() -> None:
    load()
    ops = torch.ops.pagoda_cpu
    assert ops.gemm_features() == "", ops.gemm_features()
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((208, 576), (50, 37)):
            w = torch.randn(n, k, generator=gen).to(dtype)
            packed = ops.pack_linear(w)
            for rows in (1, 9, 33):
                x = torch.randn(rows, k, generator=gen).to(dtype)
                out = ops.linear(x, packed, n, None, "auto")
                exact = x.double() @ w.double().T
                bound = gamma(k + 1, torch.float32) * (x.double().abs() @ w.double().abs().T)
                if dtype == torch.bfloat16:
                    bound = bound + UNIT_ROUNDOFF[dtype] * exact.abs()
                assert ((out.double() - exact).abs() <= bound + 1e-30).all(), (dtype, n, k, rows)
                assert torch.equal(out, ops.linear(x, packed, n, None, "vector"))
    check_w8a8(ops, gen)
    check_decode(ops)
    print("OK")


def check_w8a8(ops, gen: torch.Generator) -> None:
    from pagoda.models.w8a8 import quantize_rows, w8a8_linear_ref

    assert ops.int8_features() == "", ops.int8_features()
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(100, 70, generator=gen)
        qweight, w_scale = quantize_rows(w)
        packed, comp = ops.pack_int8(qweight)
        for rows in (1, 17):
            x = torch.randn(rows, 70, generator=gen).to(dtype)
            out = ops.linear_w8a8(x, packed, comp, w_scale, 100, None, "auto")
            ref = w8a8_linear_ref(x, qweight, w_scale)
            bound = 5 * 2.0**-24 * ref.abs() + (2.0**-8 * 1.01 if dtype == torch.bfloat16 else 0.0) * ref.abs()
            assert ((out.double() - ref).abs() <= bound + 1e-30).all(), (dtype, rows)


def check_decode(ops) -> None:
    from tests.kernels.kernel_cases import assert_close_to_reference, attention_bound, make_paged_case, \
        reference_attention

    for dtype in (torch.float32, torch.bfloat16):
        case = make_paged_case([1, 1, 1], [1000, 17, 3], 9, 3, 64, dtype, block_size=16, seed=3)
        out = torch.full_like(case.q, float("nan"))
        ops.decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens,
                             torch.arange(3), torch.arange(3), case.scale, 0, None, out)
        assert_close_to_reference(out, reference_attention(case), dtype, attention_bound(case))


if __name__ == "__main__":
    main()
