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
row and skip the causal/length masks; only the diagonal and tail tiles are masked. Online softmax in fp32 (base 2,
scale folded into ``log2(e)``), fp32 accumulators; the head dimension is padded to a power of two with masks (80 ->
128).

Split-K ("flash decoding"). When the step has too few tiles to fill the GPU (decode at
small batch, long context), the key range is cut into ``num_splits`` equal slices: each
program writes its unnormalised partial (acc, max, sum) to a fp32 workspace, and
``_combine_splits_kernel`` (``triton_split_combine``) merges them per (token, head). A slice that holds no visible
key for a row leaves ``max = -inf, sum = 0`` and weighs nothing in the merge.

Two launches per mixed step. A step with both decode tokens and prefill chunks launches
the kernel twice: the chunks with the prefill shape (up to 128 rows), then the decode
sequences with the decode shape (16 rows, their own split count), so a decode token no
longer computes ``BLOCK_Q - 1`` padded query tokens of a prefill tile. Both launches
cover every sequence; a program whose sequence's query length is outside the launch's
``[q_len_lo, q_len_hi]`` returns at once (no index arrays, no host work per sequence).
Split-K workspaces of decode launches have one row per sequence, so a small decode
launch beside a long chunk needs no token-sized workspace.

Sliding window (``window > 0``, run time): a query at p sees keys in ``(p - window, p]``.
A tile's keys start at ``first_q_pos - window + 1``; the unmasked whole tiles start at
``last_q_pos - window + 1`` (inside every row's window); keys below that (the window's
lower edge) go through the masks; split-K slices wholly below the window stay empty.
Key limits (Gemma 3's images; ``HAS_KEY_LIMITS`` compile-time, other steps launch without): a
query sees keys up to its limit (``AttentionMetadata.key_limits``, at least its position, within
its window) instead of its own position; a tile's keys then end one past its largest limit. Keys
below the first query position stay unmasked (every limit is at least that position).
Sinks (gpt-oss; ``HAS_SINKS`` compile-time, other models launch without): each head's fp32
sink logit joins the softmax denominator once, after the key loop or in the split merge.

FP8 KV cache. With a ``float8_e4m3fn`` cache, K and V tiles are loaded as e4m3 and
converted to the query dtype in registers before ``tl.dot``; the K scale is folded into
the softmax scale and the V scale multiplies the accumulator once at the end, so the
inner loop does no extra multiplies and moves half the bytes of a 16-bit cache.

Launch shapes come from ``attention_config.choose_config`` (built-in rules, or a tuned
``configs/<device>.json``). Offsets into the cache and the query/output rows are int64.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention_config import (  # noqa: F401  (re-exported for callers and tests)
    DECODE_MIN_SPLIT_LEN,
    MAX_SPLITS,
    MIN_SPLIT_LEN,
    AttentionConfig,
    cdiv,
    choose_config,
    group_pad,
    load_table,
    next_pow2,
)
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.triton_split_combine import _combine_splits_kernel

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

LOG2E = 1.4426950408889634

# The interpreter computes bf16 tl.dot wrongly; under it (and only there) dot operands are
# upcast to fp32. Compiled GPU code never takes that branch.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _attend_key_range(
    acc, m_i, l_i, q, q_pos, q_lim, k_base, v_base, table_row, lo, hi, kv_hi, window, qk_scale, dims, dim_ok,
    stride_bt_col, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of (acc, m_i, l_i) over keys [lo, hi), gathered via the table.

    MASKED=False is only for keys every row may see (all below the first query position,
    below kv_hi and inside every row's window); MASKED=True applies the causal (a row sees keys
    up to its key limit ``q_lim``, its own position unless key limits are given), length and
    (``window > 0``, from the row's position ``q_pos``) sliding-window masks.
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
        k = tl.load(k_base + k_offs, mask=kv_mask, other=0.0).to(q.dtype)  # fp8 cache: dequantise here
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (k_pos[None, :] <= q_lim[:, None]) & k_ok[None, :]
            if window > 0:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps max -inf; exp2(-inf - 0) = 0 avoids NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        v_offs = block_ids[:, None] * stride_v_block + slots[:, None] * stride_v_slot + dims[None, :]
        v = tl.load(v_base + v_offs, mask=kv_mask, other=0.0).to(q.dtype)
        p_dot = p.to(OUT_DTYPE)  # the model dtype: P is rounded as it would be without DOT_UPCAST
        if DOT_UPCAST:
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
    scale,  # softmax scale times the K cache's dequantisation scale
    v_scale,  # the V cache's dequantisation scale (1.0 unless fp8)
    num_heads,
    num_splits,
    split_len,
    q_len_lo,  # this launch serves the sequences with q_len_lo <= query length <= q_len_hi
    q_len_hi,
    part_by_seq,  # 1: split-K workspace rows are sequences (decode launches), 0: tokens
    window,  # > 0: sliding window, a query at p sees keys in (p - window, p]; 0: none
    sinks_ptr,  # [num_heads] fp32 sink logits (read only when HAS_SINKS)
    key_limits_ptr,  # [num_tokens] int64: each query's last visible key position (read only when HAS_KEY_LIMITS)
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
    HAS_SINKS: tl.constexpr,
    HAS_KEY_LIMITS: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (q_block * BLOCK_Q >= q_len) | (q_len < q_len_lo) | (q_len > q_len_hi):
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

    # Keys this tile needs end at its last valid query's position (causality) and, with a
    # window, start at the first query's window.
    kv_hi = ctx_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    first_q_pos = ctx_len + q_block * BLOCK_Q
    last_q_pos = kv_hi - 1
    q_lim = q_pos
    if HAS_KEY_LIMITS:  # a query inside an image sees keys up to the image's end (never past seq_len)
        q_lim = tl.load(key_limits_ptr + tok_idx, mask=row_ok, other=0).to(tl.int32)
        q_lim = tl.where(row_ok, tl.maximum(q_lim, q_pos), q_pos)
        kv_hi = tl.minimum(tl.maximum(kv_hi, tl.max(tl.where(row_ok, q_lim, 0), 0) + 1), seq_len)
    kv_lo = tl.where(window > 0, tl.maximum(first_q_pos - window + 1, 0), 0)
    if IS_SPLIT:
        kv_lo = tl.maximum(kv_lo, split * split_len)
        kv_hi = tl.minimum(kv_hi, split * split_len + split_len)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_v_head

    # Whole key tiles before the tile's first query position (and, with a window, inside
    # the last query's window) are visible to every row: no masks there. The window's
    # lower edge (keys some rows no longer see) and the diagonal/tail go through the masks.
    full_lo = tl.where(window > 0, tl.minimum(tl.maximum(kv_lo, last_q_pos - window + 1), kv_hi), kv_lo)
    acc, m_i, l_i = _attend_key_range(  # the window's lower edge (empty without a window), keys < full_lo
        acc, m_i, l_i, q, q_pos, q_lim, k_base, v_base, table_row, kv_lo, full_lo, full_lo, window, qk_scale, dims,
        dim_ok, stride_bt_col, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
        BLOCK_N, BLOCK_SIZE, True, PRECISION, DOT_UPCAST, out_ptr.dtype.element_ty,
    )  # fmt: skip
    num_full = tl.maximum(tl.minimum(kv_hi, first_q_pos) - full_lo, 0) // BLOCK_N
    full_end = full_lo + num_full * BLOCK_N
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, q_lim, k_base, v_base, table_row, full_lo, full_end, kv_hi, window, qk_scale, dims,
        dim_ok, stride_bt_col, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
        BLOCK_N, BLOCK_SIZE, False, PRECISION, DOT_UPCAST, out_ptr.dtype.element_ty,
    )  # fmt: skip
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, q_pos, q_lim, k_base, v_base, table_row, full_end, kv_hi, kv_hi, window, qk_scale, dims,
        dim_ok, stride_bt_col, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
        BLOCK_N, BLOCK_SIZE, True, PRECISION, DOT_UPCAST, out_ptr.dtype.element_ty,
    )  # fmt: skip

    acc = acc * v_scale
    if IS_SPLIT:
        part_row = tl.where(part_by_seq != 0, seq.to(tl.int64), tok_idx)
        part = (part_row * num_heads + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            m_sink = tl.maximum(m_i, sink)
            acc = acc * tl.exp2(m_i - m_sink)[:, None]
            l_i = l_i * tl.exp2(m_i - m_sink) + tl.exp2(sink - m_sink)
        out = acc / l_i[:, None]
        o_offs = tok_idx[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: splitting only slows it down


@functools.lru_cache(maxsize=None)
def _cuda_table(index: int) -> dict:
    return load_table(torch.cuda.get_device_name(index))


def _tuned_table(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return _cuda_table(device.index if device.index is not None else torch.cuda.current_device())


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or fp8 e4m3
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    config: AttentionConfig | None = None,
    *,
    decode_config: AttentionConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged causal GQA attention over one step; see the module docstring.

    A step with both decode tokens and prefill chunks takes two launches: the decode
    sequences with the decode shape, the others with the prefill shape (each launch skips
    the other's sequences at once). ``k_scale`` / ``v_scale`` dequantise an fp8 cache
    (stored value times scale); they must be 1.0 for a cache in q's dtype. ``window > 0``:
    sliding window (a query at p sees keys in ``(p - window, p]``). ``sinks``: ``[num_heads]``
    sink logits (gpt-oss), None for none.

    Args:
        config: launch shape; chosen by ``choose_config`` when None (tests force others).
            Given alone, the whole step is one launch with it.
        decode_config: with ``config``, forces the two-launch split (decode rows with this).

    Raises:
        ValueError: on shapes or dtypes the kernel does not serve.
    """
    _check_inputs(q, k_cache, v_cache, k_scale, v_scale)
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be float32 [num_heads={q.shape[1]}], got {sinks.dtype} {tuple(sinks.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return out
    num_decode = meta.decode_count()
    two_launches = 0 < num_decode < meta.num_seqs and (config is None or decode_config is not None)
    choose = functools.partial(_choose, q, k_cache.shape[2], meta.max_seq_len)
    launch = functools.partial(_launch, q, k_cache, v_cache, out, meta, scale * k_scale, v_scale, window, sinks)
    if not two_launches:
        cfg = config or choose(num_tokens, meta.num_seqs, meta.max_query_len)
        launch(cfg, 1, max(meta.max_query_len, 1), meta.max_query_len)
        return out
    # Prefill first: a split prefill launch's combine runs over every token row (decode
    # rows get garbage), and the decode launch then writes the decode rows.
    prefill_cfg = config or choose(num_tokens - num_decode, meta.num_seqs - num_decode, meta.max_query_len)
    launch(prefill_cfg, 2, meta.max_query_len, meta.max_query_len)
    launch(decode_config or choose(num_decode, num_decode, 1), 1, 1, 1)
    return out


def _check_inputs(q, k_cache, v_cache, k_scale: float, v_scale: float) -> None:
    _, num_heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2] != 0 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype} "
                         "(the cache holds q's dtype or float8_e4m3fn)")
    if k_cache.dtype != torch.float8_e4m3fn and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError("k_scale / v_scale apply to an fp8 cache only")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")


def _choose(q, num_kv_heads, max_seq_len, num_tokens, num_seqs, max_query_len) -> AttentionConfig:
    return choose_config(
        num_tokens, num_seqs, q.shape[1], num_kv_heads, max_query_len, max_seq_len,
        _num_sms(q.device), q.element_size(), head_dim=q.shape[2], dtype_name=DTYPE_NAMES[q.dtype],
        table=_tuned_table(q.device),
    )  # fmt: skip


def _launch(q, k_cache, v_cache, out, meta, qk_scale, v_scale, window, sinks, cfg, q_len_lo, q_len_hi,
            max_query_len) -> None:
    """One launch over the sequences whose query length is in [q_len_lo, q_len_hi]."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_pad = next_pow2(head_dim)
    num_splits = cfg.num_splits
    is_split = num_splits > 1
    by_seq = q_len_hi == 1  # decode launch: one workspace row per sequence
    split_len = cdiv(cdiv(max(meta.max_seq_len, 1), num_splits), cfg.block_n) * cfg.block_n
    if is_split:
        rows = meta.num_seqs if by_seq else num_tokens
        part_acc = torch.empty(rows, num_heads, num_splits, head_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # never touched: IS_SPLIT is a compile-time False
    tables = meta.block_tables
    grid = (meta.num_seqs, cdiv(max_query_len, cfg.block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_ml,
        meta.query_start_loc, meta.seq_lens, tables,
        qk_scale, v_scale, num_heads, num_splits, split_len, q_len_lo, q_len_hi, int(by_seq), window,
        out if sinks is None else sinks, tables if meta.key_limits is None else meta.key_limits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        tables.stride(0), tables.stride(1),
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        IS_SPLIT=is_split, PRECISION=_precision(q.dtype), DOT_UPCAST=_INTERPRETING and q.dtype == torch.bfloat16,
        HAS_SINKS=sinks is not None, HAS_KEY_LIMITS=meta.key_limits is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if is_split:
        _combine_splits_kernel[(meta.num_seqs if by_seq else num_tokens, num_heads)](
            part_acc, part_ml, out, meta.query_start_loc, num_heads, num_splits, int(by_seq),
            out if sinks is None else sinks, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=next_pow2(num_splits), HAS_SINKS=sinks is not None,
        )  # fmt: skip


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (tf32 would cost ~1e-3 relative error);
    # the setting has no effect on fp16/bf16 operands.
    return "ieee" if dtype == torch.float32 else "tf32"
