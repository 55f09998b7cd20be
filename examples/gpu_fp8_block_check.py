"""DeepSeek-format FP8 weights (e4m3 with 128x128 block scales) served as FP8 on a GPU: the
block-scaled W8A16 Triton kernel against float64 and its time against a bf16 matmul of the
dequantized weight, at DeepSeek-V3 projection shapes, 1-64 rows. Usage, from the repository
root on a CUDA machine: ``PYTHONPATH=backend python3 examples/gpu_fp8_block_check.py``."""

import torch
from triton.testing import do_bench

from pagoda import kernels
from pagoda.kernels import w8a16

torch.manual_seed(0)
BLOCK = 128
print("| N x K | rows | fp8 block (us) | bf16 dense (us) | fp8 / bf16 | weight GB/s (fp8) | rel. error vs float64 |")
print("|---|---:|---:|---:|---:|---:|---:|")
for n, k in ((7168, 2048), (24576, 7168), (7168, 18432)):
    q = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // BLOCK), -(-k // BLOCK), device="cuda") * 0.02 + 0.001
    dense = w8a16.dequantize_blocks(q, scale, BLOCK, torch.bfloat16)
    for rows in (1, 16, 64):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = kernels.fp8_block_linear(x, q, scale, BLOCK)
        ref = x.double() @ w8a16.dequantize_blocks(q, scale, BLOCK, torch.float64).T
        err = float((out.double() - ref).norm() / ref.norm())
        t_fp8 = do_bench(lambda: kernels.fp8_block_linear(x, q, scale, BLOCK), warmup=25, rep=100,
                         return_mode="median")
        t_bf16 = do_bench(lambda: torch.nn.functional.linear(x, dense), warmup=25, rep=100, return_mode="median")
        print(f"| {n} x {k} | {rows} | {t_fp8 * 1e3:.1f} | {t_bf16 * 1e3:.1f} | {t_fp8 / t_bf16:.2f}x | "
              f"{n * k / t_fp8 / 1e6:.0f} | {err:.1e} |")
