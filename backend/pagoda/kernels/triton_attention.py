"""Paged causal grouped-query attention for a whole engine step, in OpenAI Triton.

One launch serves every sequence of a step, decode tokens and prefill chunks alike (see
``metadata.py`` for the layout). A chunk's earlier context is read from the paged cache
like any other key, so prefix hits and chunked prefill need nothing special.

Tiling. A program owns one *query tile* and one KV head: ``BLOCK_Q`` consecutive query
tokens of one sequence times all ``GROUP`` query heads that share the KV head, padded to
``GROUP_PAD`` (a power of two). Its ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows go through
``tl.dot`` together, so each K/V tile is loaded once for the whole head group, and a
decode token still fills the >= 16 rows that ``tl.dot`` needs (row ``r`` is token
``r // GROUP_PAD``, head ``r % GROUP_PAD``; padded rows are masked). The grid is
``(num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads * num_splits)``; tiles past a
sequence's query length return at once.

Keys. A tile walks key positions ``[kv_lo, kv_hi)`` in steps of ``BLOCK_N``, where
``kv_hi`` is one past the last valid query's position (causality) and each key's block
id is gathered from the block table, so ``BLOCK_N`` and the cache block size are
independent. Whole key tiles below the tile's first query position are visible to every
row and skip the causal/length masks; only the diagonal and tail tiles are masked. Online softmax in fp32 (base 2, scale folded into ``log2(e)``), fp32
accumulators; the head dimension is padded to a power of two with masks (80 -> 128).

Split-K ("flash decoding"). When the step has too few tiles to fill the GPU (decode at
small batch, long context), the key range is cut into ``num_splits`` equal slices: each
program writes its unnormalised partial (acc, max, sum) to a fp32 workspace, and
``_combine_splits_kernel`` merges them per (token, head). A slice that holds no visible
key for a row leaves ``max = -inf, sum = 0`` and weighs nothing in the merge.

Offsets into the cache and the query/output rows are computed in int64.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634

# The interpreter computes bf16 tl.dot wrongly; under it (and only there) dot operands are
# upcast to fp32. Compiled GPU code never takes that branch.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _attend_key_range(
    acc, m_i, l_i, q, q_pos, k_base, v_base, table_row, lo, hi, kv_hi, qk_scale, dims, dim_ok,
    stride_bt_col, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of (acc, m_i, l_i) over keys [lo, hi), gathered via the table.

    MASKED=False is only for keys every row may see (all below the first query position
    and below kv_hi); MASKED=True applies the causal and length masks.
    """
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        bt_offs = (k_pos // BLOCK_SIZE) * stride_bt_col
        if MASKED:
            k_ok = k_pos < kv_hi
            block_ids = tl.load(table_row + bt_offs, mask=k_ok, other=0).to(tl.int64)
            kv_mask = k_ok[:, None] & dim_ok[None, :]
        else:
            block_ids = tl.load(table_row + bt_offs).to(tl.int64)
            kv_mask = dim_ok[None, :]
        slots = (k_pos % BLOCK_SIZE).to(tl.int64)
        k_offs = block_ids[:, None] * stride_k_block + slots[:, None] * stride_k_slot + dims[None, :]
        k = tl.load(k_base + k_offs, mask=kv_mask, other=0.0)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps max -inf; exp2(-inf - 0) = 0 avoids NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        v_offs = block_ids[:, None] * stride_v_block + slots[:, None] * stride_v_slot + dims[None, :]
        v = tl.load(v_base + v_offs, mask=kv_mask, other=0.0)
        p_dot = p.to(v.dtype)
        if DOT_UPCAST:
            v = v.to(tl.float32)
            p_dot = p_dot.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_PAD] fp32 (split only)
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] fp32 (split only)
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    scale,
    num_heads,
    num_splits,
    split_len,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_seq,
    stride_bt_col,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD  # index within this sequence's query rows
    head_in_group = rows % GROUP_PAD
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    head = (kv_head * GROUP + head_in_group).to(tl.int64)
    q_pos = ctx_len + tok
    tok_idx = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM

    q_offs = tok_idx[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)

    # Keys this tile needs end at its last valid query's position (causality).
    kv_hi = ctx_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    kv_lo = 0
    if IS_SPLIT:
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_hi, kv_lo + split_len)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_v_head

    # Whole key tiles before the tile's first query position are visible to every row:
    # no causal or length masks there. The rest (diagonal, tail) goes through the masks.
    first_q_pos = ctx_len + q_block * BLOCK_Q
    num_full = tl.maximum(tl.minimum(kv_hi, first_q_pos) - kv_lo, 0) // BLOCK_N
    full_end = kv_lo + num_full * BLOCK_N
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, k_base, v_base, table_row, kv_lo, full_end, kv_hi, qk_scale, dims, dim_ok,
        stride_bt_col, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
        BLOCK_N, BLOCK_SIZE, False, PRECISION, DOT_UPCAST,
    )  # fmt: skip
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, k_base, v_base, table_row, full_end, kv_hi, kv_hi, qk_scale, dims, dim_ok,
        stride_bt_col, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
        BLOCK_N, BLOCK_SIZE, True, PRECISION, DOT_UPCAST,
    )  # fmt: skip

    if IS_SPLIT:
        part = (tok_idx * num_heads + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        o_offs = tok_idx[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_PAD] fp32
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] fp32 (max in log2 units, sum)
    out_ptr,  # [num_tokens, num_heads, head_dim]
    num_heads,
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = (tok * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)  # [SPLITS_PAD]; empty slices weigh 0
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    o_offs = tok * stride_o_tok + head * stride_o_head + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of one paged-attention call (all compile-time except num_splits)."""

    block_q: int  # query tokens per tile
    block_n: int  # keys per inner-loop step
    num_splits: int  # key-range slices (1: no split, no combine kernel)
    num_warps: int = 4
    num_stages: int = 2


MAX_SPLITS = 64
MIN_SPLIT_LEN = 256  # keys per slice below which splitting costs more than it wins


def group_pad(num_heads: int, num_kv_heads: int) -> int:
    return triton.next_power_of_2(num_heads // num_kv_heads)


def choose_config(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
    element_size: int = 2,
) -> AttentionConfig:
    """Pick tile sizes and the split count for a step.

    Decode-only steps use the smallest tile that fills ``tl.dot``'s 16 rows; steps with
    prefill chunks use up to 64 rows (32 for fp32 inputs, whose tiles take twice the
    registers and shared memory, with 32-key steps). Split only when the tiles (an upper bound:
    ``num_tokens / block_q + num_seqs`` per KV head) cannot fill twice the SM count.
    """
    gpad = group_pad(num_heads, num_kv_heads)
    max_block_m, block_n = (64, 64) if element_size <= 2 else (32, 32)
    block_m = max(gpad, min(max_block_m, max(16, triton.next_power_of_2(max_query_len) * gpad)))
    block_q = block_m // gpad
    tiles = min(num_tokens, num_tokens // block_q + num_seqs) * num_kv_heads
    num_splits = 1
    target = 2 * num_sms
    if tiles < target and max_seq_len >= 2 * MIN_SPLIT_LEN:
        want = triton.next_power_of_2(triton.cdiv(target, max(tiles, 1)))
        cap = max(1, max_seq_len // MIN_SPLIT_LEN)
        while want > 1 and (want > cap or want > MAX_SPLITS):
            want //= 2
        num_splits = want
    return AttentionConfig(block_q=block_q, block_n=block_n, num_splits=num_splits)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: splitting only slows it down


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    config: AttentionConfig | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged causal GQA attention over one step; see the module docstring.

    Args:
        config: launch shape; chosen by ``choose_config`` when None (tests force others).

    Raises:
        ValueError: on shapes or dtypes the kernel does not serve.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    cfg = config or choose_config(
        num_tokens, meta.num_seqs, num_heads, num_kv_heads, meta.max_query_len, meta.max_seq_len,
        _num_sms(q.device), q.element_size(),
    )  # fmt: skip
    group = num_heads // num_kv_heads
    gpad = triton.next_power_of_2(group)
    head_pad = triton.next_power_of_2(head_dim)
    num_splits = cfg.num_splits
    is_split = num_splits > 1
    split_len = triton.cdiv(triton.cdiv(max(meta.max_seq_len, 1), num_splits), cfg.block_n) * cfg.block_n
    if is_split:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # never touched: IS_SPLIT is a compile-time False
    tables = meta.block_tables
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, cfg.block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_ml,
        meta.query_start_loc, meta.seq_lens, tables,
        scale, num_heads, num_splits, split_len,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        tables.stride(0), tables.stride(1),
        GROUP=group, GROUP_PAD=gpad, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        IS_SPLIT=is_split, PRECISION=_precision(q.dtype), DOT_UPCAST=_INTERPRETING and q.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if is_split:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (tf32 would cost ~1e-3 relative error);
    # the setting has no effect on fp16/bf16 operands.
    return "ieee" if dtype == torch.float32 else "tf32"
