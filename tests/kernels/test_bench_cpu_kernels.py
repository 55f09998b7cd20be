"""``pagoda bench cpu-kernels --small``: its three tables, every kernel's output checked
against the path it replaced (the last column), on the C++ kernels of this machine."""

from __future__ import annotations

import pytest

from pagoda.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.build() is not None, reason=f"no C++ kernels: {cpu_native.build()}")


def test_small_run_prints_each_kernel_beside_what_it_replaced(capsys):
    from pagoda.bench import cpu_kernels

    assert cpu_kernels.main(["--small", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    data = [cells for cells in rows if not cells[0].strip().startswith(("decode:", "prefill:", "matmul"))]
    prefill = 2 if "avx512f" in cpu_native.gemm_features() else 0
    assert len(data) == 1 + prefill + 2, out  # decode, prefill chunks (AVX-512 builds), matmul rows
    for cells in data:
        speedup = next(cell.strip() for cell in cells if cell.strip().endswith("x"))
        assert float(speedup[:-1]) > 0, cells
        assert float(cells[-1]) < 1e-3, cells  # float32: summation order only
