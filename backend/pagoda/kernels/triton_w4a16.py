"""W4A16 GEMM in OpenAI Triton: 4-bit weights unpacked and dequantized in registers.

``out[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * (q[n, k] - zero[n, g])``, the layout
of ``pagoda.kernels.w4a16`` (uint8 ``[N, ceil(K/2)]``, two nibbles per byte, even k low;
float32 ``[N, G]`` scales and zeros; ``x`` fp16 / bf16 / fp32, gathered by ``perm`` first for
act-order weights).

Program ``(tile, ks)`` owns a ``BLOCK_M x BLOCK_N`` output tile and the K blocks ``ks, ks +
split_k, ...``; ``BLOCK_K`` divides the group size (``w4a16.choose_config``), so a K block
lies in one group. Per block: the activation tile; the weight bytes ``k // 2`` for the
block's k (each byte read for its two k: the second read hits the cache), shifted by ``4 *
(k % 2)`` and masked to the nibble; ``q - zero`` converted to the activation dtype (integers
in -15..15: exact in fp16, bf16, fp32); ``tl.dot`` into an fp32 block partial (``ieee`` for
fp32 activations: no TF32), which is scaled by the group's scales and added to the
accumulator. Without a split the tile is stored in the output dtype; otherwise each split
stores its fp32 partial to a ``[split_k, M, N]`` workspace that ``_w4a16_reduce_kernel`` sums
in split order (deterministic, no atomics). Masked loads and stores: odd ``M``, ``N``, ``K``
need no padding; masked weight lanes are zeroed after the subtraction (``q - zero`` of an
unread byte would not be 0).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from pagoda.kernels.w4a16 import choose_config
from pagoda.kernels.w8a16 import W8A16Config


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, ceil(K/2)] uint8
    scale_ptr,  # [N, G] float32
    zero_ptr,  # [N, G] float32 (unused when SYMMETRIC)
    out_ptr,  # [M, N] output dtype, or [split_k, M, N] float32 workspace (IS_SPLIT)
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    ks = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    rm = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    s_cols = rn.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(ks * BLOCK_K, K, split_k * BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & n_ok[None, :]
        packed = tl.load(w_cols + (kk // 2)[:, None], mask=b_ok, other=0).to(tl.int32)
        q = (packed >> ((kk % 2) * 4)[:, None]) & 0xF
        group = k0 // group_size
        scale = tl.load(scale_ptr + s_cols + group, mask=n_ok, other=0.0)
        if SYMMETRIC:
            centred = q.to(tl.float32) - 8.0
        else:
            centred = q.to(tl.float32) - tl.load(zero_ptr + s_cols + group, mask=n_ok, other=0.0)[None, :]
        b = tl.where(b_ok, centred, 0.0)
        if DOT_UPCAST:
            part = tl.dot(a.to(tl.float32), b, input_precision="ieee")
        elif IEEE:
            part = tl.dot(a, b.to(a.dtype), input_precision="ieee")
        else:
            part = tl.dot(a, b.to(a.dtype))
        acc += part * scale[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    offsets = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if not IS_SPLIT:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + ks.to(tl.int64) * stride_os + offsets, acc, mask=mask)


@triton.jit
def _w4a16_reduce_kernel(
    ws_ptr,  # [split_k, M, N] float32
    out_ptr,  # [M, N]
    N,
    stride_ws,
    stride_wm,
    stride_om,
    split_k,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(ws_ptr + s * stride_ws + row * stride_wm + rn, mask=n_ok, other=0.0)
    tl.store(out_ptr + row * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# As in triton_w8a16: the interpreter computes bf16 tl.dot wrongly, so under it (only) bf16
# operands are upcast to fp32.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
_REDUCE_BLOCK_N = 256


def _num_sms(device: torch.device) -> int:
    from pagoda.kernels.triton_w8a16 import _num_sms as num_sms

    return num_sms(device)


def w4a16_linear(
    x: torch.Tensor,  # [..., K] fp16 / bf16 / fp32
    qweight: torch.Tensor,  # [N, ceil(K/2)] uint8
    scales: torch.Tensor,  # [N, G] float32
    zeros: Optional[torch.Tensor],  # [N, G] float32, or None (symmetric: 8)
    group_size: int,
    perm: Optional[torch.Tensor] = None,  # [K] int64: act-order gather of x
    config: Optional[W8A16Config] = None,
) -> torch.Tensor:  # [..., N], x.dtype
    """``x[..., perm] @ W.T`` without materialising the float weight (module docstring)."""
    k = x.shape[-1]
    n = qweight.shape[0]
    groups = -(-k // group_size)
    if qweight.dtype != torch.uint8 or qweight.shape != (n, (k + 1) // 2) or qweight.stride(1) != 1 \
            or scales.shape != (n, groups) or (zeros is not None and zeros.shape != (n, groups)):
        raise ValueError(f"w4a16_linear: x {tuple(x.shape)}, qweight {tuple(qweight.shape)} {qweight.dtype} "
                         f"(want [N, ceil(K/2)] uint8, K contiguous), scales {tuple(scales.shape)}, zeros "
                         f"{None if zeros is None else tuple(zeros.shape)} (want [N, {groups}]), group {group_size}")
    if perm is not None:
        x = x.index_select(-1, perm)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or choose_config(m, n, k, group_size, _num_sms(x.device), x.element_size())
    scales = scales.float().contiguous()
    zeros = scales if zeros is None else zeros.float().contiguous()
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    target = out if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    _w4a16_kernel[grid](
        x2, qweight, scales, zeros, target, m, n, k, group_size,
        x2.stride(0), qweight.stride(0), scales.stride(0), target.stride(-2),
        target.stride(0) if cfg.split_k > 1 else 0, cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IS_SPLIT=cfg.split_k > 1,
        SYMMETRIC=zeros is scales, IEEE=x.dtype == torch.float32,
        DOT_UPCAST=_INTERPRETING and x.dtype == torch.bfloat16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.split_k > 1:
        _w4a16_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK_N))](
            target, out, n, target.stride(0), target.stride(1), out.stride(0), cfg.split_k,
            BLOCK_N=_REDUCE_BLOCK_N, num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
