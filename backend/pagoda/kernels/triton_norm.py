"""Fused RMSNorm with optional residual add, in OpenAI Triton.

One program per token row. With a residual, the row first becomes ``x + residual``
(rounded to the input dtype, as the reference does), which is stored as the new residual
and then normalised; the mean of squares and the scaling are fp32. The hidden size is
padded to a power of two with masks, so a row lives in registers in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    new_residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL only)
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_sq = tl.sum(x * x, 0) / hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * tl.rsqrt(mean_sq + eps) * w
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm, optionally fused with the residual add (same contract as the reference).

    Returns:
        ``(normed, new_residual)``; ``new_residual = x + residual`` or None without one.
        Inputs are not modified.
    """
    shape = x.shape
    hidden = shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        if residual.shape != shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(shape)}")
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2 = new_residual = out  # never touched: HAS_RESIDUAL is a compile-time False
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, new_residual, hidden, eps,
            x2.stride(0), r2.stride(0), out.stride(0), new_residual.stride(0),
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block),
        )  # fmt: skip
    if residual is None:
        return out.view(shape), None
    return out.view(shape), new_residual.view(shape)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 512))
