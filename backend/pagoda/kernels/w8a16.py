"""Weight-only 8-bit linear layers (W8A16): the torch reference and the launch-shape choice.

``out[m, n] = scale[n] * sum_k x[m, k] * Q[n, k]`` with ``Q`` an ``[N, K]`` int8 or
float8 e4m3 weight, ``scale`` float32 per output channel, activations ``x`` in fp16,
bf16 or fp32, and the result in the activation dtype. Block-scaled FP8 (DeepSeek-V3's
checkpoints: ``scale[n // 128, k // 128]``, ``dequantize_blocks``) takes the same kernel with
its scales applied per K tile. The reference dequantizes the
weight to the activation dtype and calls ``F.linear`` (the CPU path, and the emulation of
fp8 on CPU); ``triton_w8a16`` is the GPU kernel (design in its docstring).

``choose_config`` picks the kernel's tiles from the number of rows ``M``:

* decode-sized ``M <= 16``: one 16-row tile, narrow ``BLOCK_N`` and wide ``BLOCK_K``, and
  split-K until the grid covers the SMs about twice: the weight is streamed once (one byte
  per weight), spread over every SM; partial sums go to an fp32 workspace and a second
  small kernel adds them in a fixed order (deterministic), applies the scales and casts;
* larger ``M`` (big decode batches, short prefill chunks): square-ish tiles on tensor
  cores, the int8 tile converted to the activation dtype in registers; split-K only when
  the tiles do not fill the GPU. No float copy of the weight is written;
* ``M >= DEQUANT_ROWS`` (long prefill chunks, compute bound): the dispatcher
  (``pagoda.kernels.w8a16_linear``) dequantizes once per call and calls cuBLAS.

The thresholds are chosen from the arithmetic (bytes vs FLOPs on an H100), **not measured
on a GPU**: ``pagoda bench quant`` on CUDA prints the kernel's time against a bf16 cuBLAS
``F.linear`` per ``M`` so they can be settled there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DECODE_ROWS = 16  # M at or below which the split-K decode tiles are used
# M from which CUDA dequantizes once per call (read 1 byte, write 2 per weight) and calls
# cuBLAS: there the GEMM is compute bound, the extra pass costs <= ~15% against it
# (H100: 3 bytes per weight at 3.35 TB/s vs 2*M FLOPs at ~700 TFLOP/s), and cuBLAS's
# tuned bf16 GEMM beats a generic Triton tile. Not measured on a GPU.
DEQUANT_ROWS = 2048
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class W8A16Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Q * scale[:, None]`` in ``dtype``: products taken in float32, one rounding to ``dtype``.

    One elementwise pass that reads the 8-bit weight and writes the ``dtype`` copy (no
    float32 intermediate in memory). torch does not promote float8 with float32, so an fp8
    weight is first widened (exact: e4m3 values fit fp16, bf16 and fp32): on CPU by
    ``e4m3_to_half_over_256`` (the 2^8 goes into the scale), elsewhere by torch's cast.
    """
    weight = torch.empty(qweight.shape, dtype=dtype, device=qweight.device)
    scale = scale.float()[:, None]
    if qweight.dtype != torch.int8:
        if qweight.device.type == "cpu":
            qweight, scale = e4m3_to_half_over_256(qweight), scale * 256
        else:
            qweight = qweight.to(dtype)
    return torch.mul(qweight, scale, out=weight)


def e4m3_to_half_over_256(qweight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float16 holding value / 256, exactly, by moving bits (3 passes;
    torch's CPU cast is ~5x slower, measured).

    The 7 magnitude bits ``eeeemmm`` shifted left by 7 are the fp16 with exponent field
    ``e`` and mantissa ``m << 7``: ``2^(e-15) (1 + m/8)``, or ``m 2^-17`` when ``e = 0``;
    that is the e4m3 value (``2^(e-7) (1 + m/8)``, subnormal ``m 2^-9``) divided by 2^8,
    exact in fp16 either way. The byte is sign-extended to 16 bits so the sign lands in bit
    15 after the shift; the extension's copy in bit 14 is cleared. NaN codes (never
    produced by the quantizer, which clamps to 448) are not preserved.
    """
    bits = qweight.view(torch.int8).to(torch.int16)
    bits.bitwise_left_shift_(7)
    bits.bitwise_and_(-16385)  # 0xBFFF
    return bits.view(torch.float16)


def w8a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, Q * scale[:, None])`` with the weight dequantized to ``x.dtype``.

    The CPU path, the fp8 emulation on CPU, and on CUDA the path for ``M >= DEQUANT_ROWS``
    (one dequantization per call, then cuBLAS).
    """
    return F.linear(x, dequantize(qweight, scale, x.dtype))


def dequantize_blocks(qweight: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``W[n, k] = Q[n, k] * scale[n // block, k // block]`` in ``dtype`` (products in float32)."""
    n, k = qweight.shape
    expanded = scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (qweight.float() * expanded).to(dtype)


def w8a16_block_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """``F.linear(x, dequantize_blocks(...))``: block-scaled FP8's CPU path (and, on CUDA, its path
    from ``DEQUANT_ROWS`` rows: one dequantization, then cuBLAS)."""
    return F.linear(x, dequantize_blocks(qweight, scale, block, x.dtype))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_config(m: int, n: int, k: int, num_sms: int, itemsize: int = 2,
                  max_block_k: int | None = None) -> W8A16Config:
    """Tiles and split-K for an ``[m, k] x [n, k]^T`` product on a GPU with ``num_sms`` SMs.

    ``itemsize`` is the activation's element size: fp32 halves ``BLOCK_K`` so a stage's
    tiles stay the size of the 16-bit ones in shared memory. ``max_block_k``: block scales'
    size (``BLOCK_K`` must divide it).
    """
    if m <= DECODE_ROWS:
        bm, bn, bk, warps, stages = 16, 64, 256, 4, 3
    elif m <= 32:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 3
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    if itemsize == 4:
        bk = max(32, bk // 2)
    if max_block_k is not None:
        bk = min(bk, max_block_k)
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    k_blocks = _cdiv(k, bk)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= min(k_blocks, MAX_SPLIT_K):
        split *= 2
    return W8A16Config(bm, bn, bk, split, warps, stages)
