"""Kernel side of ``pagoda bench quant``: which matmul path each quantized model takes, and
(CUDA only) the 8-bit linear layers timed against the model dtype's ``F.linear``.

``kernels_used`` names the path of a model's first quantized weight at batch 1, batch 16
and a 256-row prefill chunk (what ``Int8Weight.kernel_for`` / ``Fp8Weight.kernel_for``
report, and ``W8A8Weight.kernel_for``). ``linear_timings`` times one ``[M, K] x [N, K]^T`` product per row count on
Llama-3-8B's projection shapes (o_proj 4096x4096, gate_up 28672x4096, down 4096x14336)
with CUDA events (median of ``iters`` after a warm-up): bf16 cuBLAS, the int8 W8A16
path, and the fp8 path (W8A16 or ``_scaled_mm`` by rows), each through ``quant.linear``
exactly as the model calls it. This is where ``w8a16.DEQUANT_ROWS`` and the decode tiles
get checked on a GPU.
"""

from __future__ import annotations

import statistics

import torch

ROWS = (1, 4, 16, 64, 256, 1024, 4096)
SHAPES = {"o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
PROBE_ROWS = {"batch 1": 1, "batch 16": 16, "prefill 256": 256}


def first_quantized_weight(model):
    from pagoda.models.fp8 import Fp8Weight
    from pagoda.models.quant import Int8Weight
    from pagoda.models.w8a8 import W8A8Weight

    return next(m for m in model.modules() if isinstance(m, (Int8Weight, Fp8Weight, W8A8Weight)))


def kernels_used(model) -> str:
    """``"batch 1: <path>; batch 16: <path>; prefill 256: <path>"`` for the model's activations."""
    weight = first_quantized_weight(model)
    device, k = next(weight.buffers()).device, weight.shape[1]
    parts = [f"{name}: {weight.kernel_for(torch.empty(rows, k, dtype=model.dtype, device=device))}"
             for name, rows in PROBE_ROWS.items()]
    return "; ".join(parts)


def _time_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def linear_timings(dtype: torch.dtype = torch.bfloat16, iters: int = 20) -> list[dict]:
    """Rows of ``{shape, rows, bf16_ms, int8_ms, fp8_ms, int8_kernel, fp8_kernel}`` on the current GPU."""
    from pagoda.models import fp8, quant

    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5
        w8 = quant.Int8Weight(w)
        wf8 = fp8.Fp8Weight(w)
        fp8.select_fp8_kernel([wf8], dtype)
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
            results.append({
                "shape": f"{name} {n}x{k}", "rows": rows,
                "bf16_ms": _time_ms(lambda: torch.nn.functional.linear(x, w), iters),
                "int8_ms": _time_ms(lambda: quant.linear(x, w8), iters),
                "fp8_ms": _time_ms(lambda: quant.linear(x, wf8), iters),
                "int8_kernel": w8.kernel_for(x), "fp8_kernel": wf8.kernel_for(x),
            })  # fmt: skip
        del w, w8, wf8
    return results


def print_linear_timings(results: list[dict], dtype_name: str) -> None:
    print(f"\n| linear (CUDA events, median) | rows | {dtype_name} ms | int8 ms | {dtype_name}/int8 | "
          f"fp8 ms | {dtype_name}/fp8 | int8 path | fp8 path |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['rows']} | {r['bf16_ms']:.4f} | {r['int8_ms']:.4f} | "
              f"{r['bf16_ms'] / r['int8_ms']:.2f}x | {r['fp8_ms']:.4f} | {r['bf16_ms'] / r['fp8_ms']:.2f}x | "
              f"{r['int8_kernel']} | {r['fp8_kernel']} |")
