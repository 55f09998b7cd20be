"""The split-K merge of the paged-attention kernel (``triton_attention``), in OpenAI Triton.

A split launch leaves, per (query row, head, split), the unnormalised partial accumulator and
its running (max in log2 units, sum) in fp32 workspaces. ``_combine_splits_kernel`` merges them
per (row, head): each split's partial is weighed by ``2^(max - overall max)``; a split that saw no
visible key (``max = -inf, sum = 0``) weighs nothing. With sinks (gpt-oss) each head's sink
logit joins the denominator once here. Rows are tokens, or sequences for a decode launch
(``part_by_seq``: a sequence whose query length is not 1 is skipped: the prefill launch wrote it).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_PAD] fp32
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] fp32 (max in log2 units, sum)
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1] int32 (read when part_by_seq)
    num_heads,
    num_splits,
    part_by_seq,  # 1: program 0 indexes sequences (decode launch); skip those with q_len != 1
    sinks_ptr,  # [num_heads] fp32 (HAS_SINKS)
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tok = row
    if part_by_seq != 0:
        tok = tl.load(query_start_loc_ptr + row).to(tl.int64)
        if tl.load(query_start_loc_ptr + row + 1) - tok != 1:
            return
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = (row * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)  # [SPLITS_PAD]; empty slices weigh 0
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    denominator = tl.sum(l * weight, 0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - m_safe)
    out = tl.sum(acc * weight[:, None], 0) / denominator
    o_offs = tok * stride_o_tok + head * stride_o_head + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
