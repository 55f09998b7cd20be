"""Batched multi-LoRA (BGMV-style) shrink and expand in OpenAI Triton.

A step mixes tokens of many adapters (and of none). Per token ``t`` with adapter slot
``s = token_slots[t]`` (-1: base model, untouched):

    shrink:  h[t, :]  = A_stack[s] @ x[t, :]          A_stack [num_slots, R, in]
    expand:  y[t, :] += B_stack[s] @ h[t, :]          B_stack [num_slots, out, R]

One program per (token, tile of R) for the shrink and per (token, tile of out) for the
expand: each program reads its token's slot and streams that adapter's rows, so tokens of
different adapters share one launch and no host loop runs over requests or adapters. The
reductions are fp32 (``tl.sum`` over tiles; no ``tl.dot``, whose K >= 16 rule the small
ranks would break), the result is added to ``y`` in its own dtype. Decode-sized steps are
what this shape is for; a prefill chunk re-reads the adapter per token (the torch path,
one GEMM per active adapter, is the better shape there — see ``kernels/__init__.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in]
    a_ptr,  # [num_slots, R, in]
    slots_ptr,  # [num_tokens] int64
    h_ptr,  # [num_tokens, R] fp32
    in_features,
    rank,
    stride_x,
    stride_as,
    stride_ar,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_x + k, mask=k < in_features, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < rank) & (k[None, :] < in_features), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], 1)
    tl.store(h_ptr + t * rank + r, acc, mask=r < rank)


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [num_tokens, R] fp32
    b_ptr,  # [num_slots, out, R]
    slots_ptr,  # [num_tokens] int64
    y_ptr,  # [num_tokens, out], updated in place
    out_features,
    rank,
    stride_bs,
    stride_bn,
    stride_y,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            h = tl.load(h_ptr + t * rank + r, mask=r < rank, other=0.0)
            b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
                        mask=(n[:, None] < out_features) & (r[None, :] < rank), other=0.0).to(tl.float32)
            acc += tl.sum(b * h[None, :], 1)
        mask = n < out_features
        y = tl.load(y_ptr + t * stride_y + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_y + n, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_apply(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
               token_slots: torch.Tensor) -> torch.Tensor:
    """``y[t] += B[s_t] @ (A[s_t] @ x[t])`` for every token with a slot; returns ``y``.

    Args:
        y: ``[num_tokens, out]`` the base projection's output (contiguous rows), updated in place.
        x: ``[num_tokens, in]``; a_stack ``[num_slots, R, in]``; b_stack ``[num_slots, out, R]``
            (both contiguous in their last dim); token_slots ``[num_tokens]`` int64, -1 = none.
    """
    num_tokens, in_features = x.shape
    rank, out_features = a_stack.shape[1], b_stack.shape[1]
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a_stack.stride(-1) == 1 and b_stack.stride(-1) == 1
    if num_tokens == 0:
        return y
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(rank))
    _lora_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, a_stack, token_slots, h, in_features, rank, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        BLOCK_R=block_r, BLOCK_K=128)
    block_n = 128
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        h, b_stack, token_slots, y, out_features, rank, b_stack.stride(0), b_stack.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r)
    return y
