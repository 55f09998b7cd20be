"""Fused Mixture-of-Experts experts in OpenAI Triton: grouped GEMMs over the experts with tokens.

Input: the step's ``T * k`` (token, expert) assignments already sorted by expert
(``order``: assignment ids ``t * k + j`` in expert order, ``weights`` their routing
weights, ``offsets [E + 1]``: expert e's assignments are ``offsets[e]:offsets[e + 1]``).
Two launches, then a sum:

1. ``_moe_gate_up_kernel``: one program per (row block, tile of the expert's intermediate
   size). Its rows belong to one expert; it gathers their tokens' hidden states and
   computes ``silu(x @ W_gate^T) * (x @ W_up^T)`` with both products on the same tiles of x
   (fp32 accumulation, ``tl.dot``), writing the [T * k, inter] intermediate in sorted order.
   gpt-oss (``CLAMPED``, compile time): the products plus their biases, then
   ``(clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
   Gemma 4 (``GELU``): ``gelu_tanh(g) * up``, the tanh taken as ``2 sigmoid(2 z) - 1``.
2. ``_moe_down_kernel``: per (row block, tile of hidden): ``(h @ W_down^T [+ bias]) * weight``,
   stored at the assignment's own row of a ``[T * k, hidden]`` buffer.
3. ``view(T, k, hidden).sum(1)``: each token's top-k partial results, in a fixed order
   (deterministic; no atomics).

Row blocks: each expert's rows are padded to ``BLOCK_M`` (the row blocks never straddle two
experts). ``block_schedule`` builds the per-block expert and row range with torch ops on
the device (cumsum, searchsorted: no host read), for a grid sized from shapes alone:
``cdiv(T * k, BLOCK_M) + min(T * k, E)`` blocks bound the padded total, and blocks past it
(expert id ``E``) exit at once. Experts with no tokens get no block, so their weights are
never read. fp32 inputs use true fp32 products (``input_precision="ieee"``), 16-bit inputs
tensor-core products with fp32 accumulation; the intermediate is rounded to the input
dtype (as the torch path does).

FP8 experts (DeepSeek-V3's checkpoints, ``block_scales``): e4m3 ``w13`` / ``w2`` with square block
scales (128 x 128). ``BLOCK_K`` (64) divides the block, so a K tile lies in one block column: the
tile is converted to the activation dtype in registers (exact) and its product scaled per output
column (the block row of each column, gate and up rows alike) before it is added.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per block (tl.dot's minimum); decode-sized groups waste the least
# The interpreter computes bf16 tl.dot wrongly (as triton_attention notes); under it, and
# only there, bf16 operands are upcast to fp32. Compiled GPU code never takes that branch.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _fp8_tile(ptrs, mask, dtype: tl.constexpr):
    """An e4m3 weight tile in ``dtype`` (exact); masked lanes zeroed after conversion (an unread
    fp8 byte may be NaN, and 0 * NaN is NaN)."""
    return tl.where(mask, tl.load(ptrs, mask=mask).to(tl.float32), 0.0).to(dtype)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """A fresh ``a @ b`` in fp32 (upcast under the interpreter's bf16, as the float paths do)."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,  # [T, hidden]
    w13_ptr,  # [E, 2 * inter, hidden]
    order_ptr,  # [T * k] int64: assignment ids in expert order
    block_expert_ptr,  # [num_blocks] int64 (E: no work)
    block_start_ptr,  # [num_blocks] int64: first sorted row
    block_end_ptr,  # [num_blocks] int64: end of the expert's sorted rows
    h_ptr,  # [T * k, inter] out, sorted order
    b13_ptr,  # [E, 2 * inter] biases (read when CLAMPED: gpt-oss)
    alpha,
    limit,
    hidden,
    inter,
    num_experts,
    top_k,
    stride_we,
    stride_wn,
    s13_ptr,  # [E, 2 * inter / SCALE_BLOCK, cdiv(hidden, SCALE_BLOCK)] float32 (fp8 weights only)
    stride_se,
    stride_sn,
    CLAMPED: tl.constexpr,
    GELU: tl.constexpr,  # gelu_tanh(gate) * up (Gemma 4) instead of silu(gate) * up
    PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr = 0,  # > 0: e4m3 weights with square block scales
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < num_experts:
        rows = tl.load(block_start_ptr + block) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(block_end_ptr + block)
        tokens = tl.load(order_ptr + rows, mask=row_ok, other=0) // top_k
        s_base = s13_ptr + expert * stride_se
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w_base = w13_ptr + expert * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            x = tl.load(x_ptr + tokens[:, None] * hidden + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            if SCALE_BLOCK > 0:  # BLOCK_K divides the block: the tile's k-block scale per column
                w_gate = _fp8_tile(w_base + n[None, :] * stride_wn + k[:, None], w_mask, x.dtype)
                w_up = _fp8_tile(w_base + (n[None, :] + inter) * stride_wn + k[:, None], w_mask, x.dtype)
                s_gate = tl.load(s_base + (n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_ok, other=0.0)
                s_up = tl.load(s_base + ((n + inter) // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_ok,
                               other=0.0)
                acc_gate += _dot(x, w_gate, PRECISION, DOT_UPCAST) * s_gate[None, :]
                acc_up += _dot(x, w_up, PRECISION, DOT_UPCAST) * s_up[None, :]
            else:
                w_gate = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
                w_up = tl.load(w_base + (n[None, :] + inter) * stride_wn + k[:, None], mask=w_mask, other=0.0)
                if DOT_UPCAST:
                    x = x.to(tl.float32)
                    acc_gate = tl.dot(x, w_gate.to(tl.float32), acc_gate, input_precision="ieee")
                    acc_up = tl.dot(x, w_up.to(tl.float32), acc_up, input_precision="ieee")
                else:
                    acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=PRECISION)
                    acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
        if CLAMPED:
            b_base = b13_ptr + expert * 2 * inter
            gate = tl.minimum(acc_gate + tl.load(b_base + n, mask=n_ok, other=0.0).to(tl.float32)[None, :], limit)
            up = acc_up + tl.load(b_base + inter + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            up = tl.minimum(tl.maximum(up, -limit), limit)
            h = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        elif GELU:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
            z = 0.7978845608028654 * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
            h = acc_gate / (1.0 + tl.exp(-2.0 * z)) * acc_up
        else:
            h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        tl.store(h_ptr + rows[:, None] * inter + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr,  # [T * k, inter] sorted order
    w2_ptr,  # [E, hidden, inter]
    order_ptr,  # [T * k] int64
    weights_ptr,  # [T * k] routing weights, sorted order
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    y_ptr,  # [T * k, hidden] out, by assignment id
    b2_ptr,  # [E, hidden] biases (read when HAS_BIAS)
    hidden,
    inter,
    num_experts,
    stride_we,
    stride_wn,
    s2_ptr,  # [E, cdiv(hidden, SCALE_BLOCK), cdiv(inter, SCALE_BLOCK)] float32 (fp8 weights only)
    stride_se,
    stride_sn,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr = 0,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < num_experts:
        rows = tl.load(block_start_ptr + block) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(block_end_ptr + block)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_base = w2_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            h = tl.load(h_ptr + rows[:, None] * inter + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if SCALE_BLOCK > 0:
                w = _fp8_tile(w_base + n[None, :] * stride_wn + k[:, None], k_ok[:, None] & n_ok[None, :], h.dtype)
                s = tl.load(s2_ptr + expert * stride_se + (n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK,
                            mask=n_ok, other=0.0)
                acc += _dot(h, w, PRECISION, DOT_UPCAST) * s[None, :]
            else:
                w = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                            other=0.0)
                if DOT_UPCAST:
                    acc = tl.dot(h.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(h, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b2_ptr + expert * hidden + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        assignment = tl.load(order_ptr + rows, mask=row_ok, other=0)
        tl.store(y_ptr + assignment[:, None] * hidden + n[None, :], (acc * weight[:, None]).to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


def block_schedule(offsets: torch.Tensor, num_assignments: int,
                   block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row block: (expert, first sorted row, end of that expert's rows), ``[num_blocks]`` each.

    Each expert's rows are padded to ``block_m``; blocks past the padded total get expert
    ``E``. Device ops only; ``num_blocks`` comes from the shapes.
    """
    num_experts = offsets.numel() - 1
    num_blocks = triton.cdiv(num_assignments, block_m) + min(num_assignments, num_experts)
    counts = offsets[1:] - offsets[:-1]
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks_per_expert, 0)
    block = torch.arange(num_blocks, device=offsets.device, dtype=block_ends.dtype)
    expert = torch.searchsorted(block_ends, block, right=True)
    clamped = expert.clamp(max=num_experts - 1)
    first_block = (block_ends - blocks_per_expert)[clamped]
    start = offsets[clamped] + (block - first_block) * block_m
    return expert, start, offsets[clamped + 1]


def moe_experts(x: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, top_k: int, b13: torch.Tensor | None = None,
                b2: torch.Tensor | None = None, clamped_swiglu: tuple[float, float] | None = None,
                block_scales: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                activation: str = "silu") -> torch.Tensor:
    """``[T, hidden]``: each token's routing-weighted sum of its experts' SwiGLU outputs
    (``activation="gelu_tanh"``: GELU-tanh GLU, Gemma 4's experts).

    Args:
        x: ``[T, hidden]`` contiguous; w13 ``[E, 2 * inter, hidden]``, w2 ``[E, hidden, inter]``
            (contiguous in their last dim); order, weights ``[T * k]`` and offsets ``[E + 1]``
            as ``models.moe.group_by_expert`` makes them.
        b13, b2, clamped_swiglu: gpt-oss's expert biases (contiguous) and ``(alpha, limit)``;
            ``b13`` is read only with ``clamped_swiglu`` (no other model has gate/up biases).
        block_scales: e4m3 ``w13`` / ``w2`` with square block scales ``(s13, s2, block)``
            (DeepSeek-V3's FP8 experts; ``inter`` a multiple of ``block``, 64 dividing it).
    """
    if (b13 is not None) != (clamped_swiglu is not None):
        raise ValueError("gate/up biases come with clamped_swiglu (gpt-oss) and only with it")
    if activation not in ("silu", "gelu_tanh") or (activation != "silu" and clamped_swiglu is not None):
        raise ValueError(f"MoE activation {activation!r}: silu, or gelu_tanh without clamped_swiglu")
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    x = x.contiguous()
    num_assignments = order.numel()
    if num_assignments == 0:
        return torch.zeros_like(x)
    expert, start, end = block_schedule(offsets, num_assignments)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # the setting only matters for fp32
    upcast = _INTERPRETING and x.dtype == torch.bfloat16
    h = torch.empty(num_assignments, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    alpha, limit = clamped_swiglu or (1.0, 0.0)
    s13, s2, scale_block = block_scales or (h, h, 0)  # the scale pointers are not read without fp8
    assert not scale_block or (scale_block % block_k == 0 and inter % scale_block == 0), "block scales' layout"
    _moe_gate_up_kernel[(expert.numel(), triton.cdiv(inter, block_n))](
        x, w13, order, expert, start, end, h, h if b13 is None else b13, alpha, limit, hidden, inter, w13.shape[0],
        top_k, w13.stride(0), w13.stride(1), s13, s13.stride(0) if scale_block else 0,
        s13.stride(1) if scale_block else 0, CLAMPED=clamped_swiglu is not None, GELU=activation == "gelu_tanh",
        PRECISION=precision, DOT_UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE_BLOCK=scale_block)
    y = torch.empty(num_assignments, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(expert.numel(), triton.cdiv(hidden, block_n))](
        h, w2, order, weights, expert, start, end, y, y if b2 is None else b2, hidden, inter, w2.shape[0],
        w2.stride(0), w2.stride(1), s2, s2.stride(0) if scale_block else 0, s2.stride(1) if scale_block else 0,
        HAS_BIAS=b2 is not None, PRECISION=precision, DOT_UPCAST=upcast,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BLOCK=scale_block)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
