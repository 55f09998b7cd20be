"""Weight-only 4-bit linear layers (W4A16): the kernel layout, the torch reference, the tiles.

One layout for every 4-bit format (``pagoda.models.quant_checkpoint`` reads AWQ, GPTQ and
compressed-tensors into it once, at load):

- ``qweight`` uint8 ``[N, ceil(K/2)]``: ``q[n, k]`` (unsigned, 0..15) in the low nibble of
  byte ``k // 2`` for even ``k``, the high nibble for odd ``k`` — K-contiguous rows, as the
  W8A16 kernel's ``[N, K]`` int8, at half the bytes;
- ``scales`` float32 ``[N, G]`` and ``zeros`` float32 ``[N, G]`` (``None``: 8, symmetric), one
  per group of ``group_size`` consecutive k (``G = ceil(K / group_size)``; channel-wise is
  ``group_size = K``);
- act-order checkpoints (GPTQ ``desc_act``, compressed-tensors ``actorder``) are permuted
  along K at load so their groups become consecutive; the activation is gathered by the
  same permutation (``perm``) before the product.

``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]``, ``g = k // group_size``.

The reference (``w4a16_linear_ref``) dequantizes to the activation dtype and calls
``F.linear``: the CPU path, and on CUDA the path from ``DEQUANT_ROWS`` rows (compute-bound
prefill, where cuBLAS wins). ``triton_w4a16`` is the GPU kernel: per K block (never
straddling a group) it unpacks the nibbles in registers, takes ``q - zero`` (small integers,
exact in fp16, bf16 and fp32), runs ``tl.dot`` with fp32 accumulation and applies the group's
scale to that block's fp32 partial sum; split-K for decode sizes as the W8A16 kernel does.
Tiles (``choose_config``) are the W8A16 kernel's, with ``BLOCK_K`` capped to divide the group.
Not measured on a GPU (docs/quantization.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagoda.kernels.w8a16 import DEQUANT_ROWS, W8A16Config
from pagoda.kernels.w8a16 import choose_config as _choose_w8a16_config

__all__ = ["DEQUANT_ROWS", "pack_int4", "unpack_int4", "dequantize_w4", "w4a16_linear_ref", "choose_config"]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values ``[N, K]`` (any integer dtype, 0..15) -> uint8 ``[N, ceil(K/2)]``."""
    n, k = q.shape
    if k % 2:
        q = F.pad(q, (0, 1))
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 ``[N, ceil(K/2)]`` -> int16 ``[N, K]`` values 0..15."""
    low, high = (qweight & 0xF).to(torch.int16), (qweight >> 4).to(torch.int16)
    return torch.stack((low, high), dim=-1).reshape(qweight.shape[0], -1)[:, :k]


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], k: int,
                  group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero) * scale`` as ``[N, K]`` ``dtype`` (products in float32, one rounding)."""
    q = unpack_int4(qweight, k).float()
    g = torch.arange(k, device=qweight.device) // group_size
    zero = 8.0 if zeros is None else zeros.float()[:, g]
    return ((q - zero) * scales.float()[:, g]).to(dtype)


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     group_size: int, perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x[..., perm], W)`` with ``W`` dequantized to ``x.dtype``."""
    k = x.shape[-1]
    if perm is not None:
        x = x.index_select(-1, perm)
    return F.linear(x, dequantize_w4(qweight, scales, zeros, k, group_size, x.dtype))


def choose_config(m: int, n: int, k: int, group_size: int, num_sms: int, itemsize: int = 2) -> W8A16Config:
    """The W8A16 kernel's tiles for this shape, with ``BLOCK_K`` dividing ``group_size``
    (a K block reads one group's scale) unless one group spans all of K."""
    cfg = _choose_w8a16_config(m, n, k, num_sms, itemsize)
    block_k = cfg.block_k
    if group_size < k:
        while group_size % block_k:
            block_k //= 2
    if block_k < 16:
        raise ValueError(f"w4a16: group_size {group_size} must be a multiple of 16")
    if block_k == cfg.block_k:
        return cfg
    k_blocks = -(-k // block_k)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= min(k_blocks, 16):
        split *= 2
    return W8A16Config(cfg.block_m, cfg.block_n, block_k, split, cfg.num_warps, cfg.num_stages)
