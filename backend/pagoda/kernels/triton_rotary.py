"""Rotary position embedding (NeoX / Hugging Face Llama style), in OpenAI Triton.

One program per token rotates all its query and key heads: with ``half = head_dim / 2``,
``out[:half] = x1 * cos - x2 * sin`` and ``out[half:] = x2 * cos + x1 * sin``, where
``cos``/``sin`` are the token's row of ``cos_sin_cache`` (cos in the first half, sin in
the second). Any frequency scaling (llama3) is baked into that cache, so the kernel has
no variants for it. Math in fp32; heads and half-dims padded to powers of two with masks.
Outputs are new tensors; the inputs are not modified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, tok, stride_x_tok, stride_x_head, stride_o_tok, stride_o_head, num_heads, cos, sin,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, HEADS_PAD).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    x_row = x_ptr + tok * stride_x_tok + heads[:, None] * stride_x_head + dims[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + tok * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(o_row, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_out_ptr,
    k_out_ptr,
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_positions, head_dim]
    num_heads,
    num_kv_heads,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_cs,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, tok, stride_q_tok, stride_q_head, stride_qo_tok, stride_qo_head, num_heads, cos, sin,
        HALF, HALF_PAD, Q_HEADS_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, tok, stride_k_tok, stride_k_head, stride_ko_tok, stride_ko_head, num_kv_heads, cos, sin,
        HALF, HALF_PAD, K_HEADS_PAD,
    )  # fmt: skip


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in the first half, sin in the second
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` and ``k``; returns new ``(q, k)``.

    Raises:
        ValueError: when the cache width is not the head size.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if cos_sin_cache.shape[1] != head_dim or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"rotary cache {tuple(cos_sin_cache.shape)} does not fit head_dim {head_dim}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin_cache, num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_heads), K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
    )  # fmt: skip
    return q_out, k_out
