"""Fused RMSNorm with optional residual add, in OpenAI Triton.

One program per token row. With a residual, the row first becomes ``x + residual``
(rounded to the input dtype, as the reference does), which is stored as the new residual
and then normalised; the mean of squares and the scaling are fp32. The hidden size is
padded to a power of two with masks, so a row lives in registers in one pass.

The gated variant (Gated DeltaNet's output norm, transformers' ``Qwen3NextRMSNormGated``):
``rmsnorm(x) * weight * silu(gate)`` over rows of one head (``[rows, head_dim]``), ``BLOCK_R``
rows per program; rounded as the reference is (``reference_gdn.gated_rms_norm``): the
normalised row to the input dtype, times the weight in the input dtype, times ``silu(gate)``
in float32, one final rounding.
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


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, weight_ptr, out_ptr, num_rows, dim, eps, stride_x, stride_g, stride_o,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 1) / dim + eps)[:, None]
    w = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    # normed rounded to the input dtype, times the weight rounded once more: the product of two
    # 16-bit values is exact in float32, so this is the 16-bit product (and never bf16 arithmetic,
    # which the interpreter gets wrong).
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    scaled = (normed * w[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = scaled * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: torch.Tensor,  # [rows, dim]
    gate: torch.Tensor,  # [rows, dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> torch.Tensor:  # [rows, dim] in x's dtype
    """``rmsnorm(x) * weight * silu(gate)`` (module docstring); inputs are not modified.

    Raises:
        ValueError: ``gate`` or ``weight`` does not fit ``x``.
    """
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gate {tuple(gate.shape)} / weight {tuple(weight.shape)} do not fit x {tuple(x.shape)}")
    x, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows, dim = x.shape
    if num_rows:
        block_d = triton.next_power_of_2(dim)
        block_r = max(1, min(16, 4096 // block_d))
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x, gate, weight, out, num_rows, dim, eps, x.stride(0), gate.stride(0), out.stride(0),
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out
