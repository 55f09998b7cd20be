"""Multi-head latent attention's decode (the absorbed form) and latent write, in OpenAI Triton.

``mla_decode``: for each decode row (one query token of a sequence), every head attends over
the sequence's cached latent rows ``[c | k_pe]`` (``reference_mla`` has the math): score
``q_lat[h] . c_s + q_pe[h] . k_pe_s``, output ``o_lat[h] = sum_s softmax_s * c_s``. Design:

- one program per (row, block of ``BLOCK_H`` heads, split of the context): the heads share
  every latent row, so a row tile ``[BLOCK_N, rank]`` loaded once feeds ``BLOCK_H`` heads' scores
  (``tl.dot`` of ``[BLOCK_H, rank] x [rank, BLOCK_N]``, plus the rope part) and their output
  (``[BLOCK_H, BLOCK_N] x [BLOCK_N, rank]``); online softmax in fp32;
- split-K over the context (flash decoding): split ``j`` covers positions
  ``[j * split_len, (j + 1) * split_len)`` and writes its normalised partial output and its
  log-sum-exp to an fp32 workspace; ``_mla_combine_kernel`` merges the splits per (row, head)
  in split order (deterministic, no atomics). The split count is a run-time argument, chosen
  from the host's ``max_seq_len`` and the number of rows (``choose_splits``): one compiled
  variant per dtype and size, whatever the batch. A split past a sequence's length writes
  weight zero;
- rows map to sequences through ``seq_ids`` (the step's decode rows need not be its first
  sequences); the block table gives each position's page; every load is masked, the rank and
  rope widths padded to powers of two (at least 16: ``tl.dot``'s minimum);
- fp8 (float8_e4m3fn) cache: rows converted in registers, the scale applied to the scores and
  the output (masked fp8 lanes are zeroed after conversion: an unread byte may be NaN).

Under CUDA graphs the launch reads only device tensors (``seq_lens``, ``block_tables``,
``seq_ids``); its grid and split count come from host values that a graph freezes at
``max_model_len`` (``engine.runner.cuda_graphs``).

``write_latent``: one program per token stores its row at ``slot`` (negative: a padding
token, skipped), quantizing to e4m3 as ``triton_kv_write`` does for an fp8 cache.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.triton_kv_write import _to_cache
from pagoda.kernels.triton_w8a16 import _num_sms  # one cache of the device's SM count

BLOCK_H = 16  # heads per program (tl.dot's minimum rows)
BLOCK_N = 32  # context positions per tile
MIN_SPLIT_TOKENS = 256  # a split covers at least this many positions
MAX_SPLITS = 64
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _write_latent_kernel(x_ptr, cache_ptr, slot_ptr, dim, inv_scale, stride_x, stride_block, stride_slot,
                         DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr,
                         ROUND_FIRST: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, DIM_PAD)
        ok = d < dim
        x = tl.load(x_ptr + tok * stride_x + d, mask=ok)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot + d
        tl.store(dst, _to_cache(x, inv_scale, cache_ptr.dtype.element_ty, QUANTIZE, ROUND_FIRST), mask=ok)


@triton.jit
def _load_rows(ptr, mask, KV_FP8: tl.constexpr, dtype: tl.constexpr):
    """A tile of cache rows in ``dtype``; fp8 lanes outside ``mask`` zeroed after conversion."""
    if KV_FP8:
        return tl.where(mask, tl.load(ptr, mask=mask).to(tl.float32), 0.0).to(dtype)
    return tl.load(ptr, mask=mask, other=0.0).to(dtype)


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr,  # [D, H, rank]
    q_pe_ptr,  # [D, H, rope]
    cache_ptr,  # [num_blocks, block_size, 1, rank + rope]
    seq_ids_ptr,  # [D] int32: each row's sequence
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    part_out_ptr,  # [D, H, num_splits, rank] fp32
    part_lse_ptr,  # [D, H, num_splits] fp32
    scale,  # softmax scale times the cache scale
    num_heads,
    rank,
    rope,
    split_len,
    stride_ql_row,
    stride_ql_head,
    stride_qp_row,
    stride_qp_head,
    stride_c_block,
    stride_c_slot,
    stride_bt,
    stride_po_row,
    stride_po_head,
    stride_po_split,
    stride_pl_row,
    stride_pl_head,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    h_ok = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    r_ok, p_ok = r < rank, p < rope
    dtype = tl.float32 if DOT_UPCAST else q_lat_ptr.dtype.element_ty
    q_lat = tl.load(q_lat_ptr + row * stride_ql_row + heads[:, None] * stride_ql_head + r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(dtype)
    q_pe = tl.load(q_pe_ptr + row * stride_qp_row + heads[:, None] * stride_qp_head + p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0).to(dtype)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, RANK_PAD), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        base = cache_ptr + block * stride_c_block + (pos % PAGE).to(tl.int64) * stride_c_slot
        c = _load_rows(base[:, None] + r[None, :], pos_ok[:, None] & r_ok[None, :], KV_FP8, dtype)
        pe = _load_rows(base[:, None] + rank + p[None, :], pos_ok[:, None] & p_ok[None, :], KV_FP8, dtype)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s = tl.dot(q_pe, tl.trans(pe), s, input_precision="ieee")
        else:
            s = tl.dot(q_pe, tl.trans(pe), tl.dot(q_lat, tl.trans(c)))
        s = tl.where(pos_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        probs = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(probs, axis=1)
        if IEEE:
            acc = tl.dot(probs.to(dtype), c, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(probs.to(dtype), c, acc * alpha[:, None])
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    lse = m + tl.log(total)  # -inf for a split with no position
    out_ptrs = part_out_ptr + row * stride_po_row + heads[:, None] * stride_po_head + split * stride_po_split
    tl.store(out_ptrs + r[None, :], out, mask=h_ok[:, None] & r_ok[None, :])
    tl.store(part_lse_ptr + row * stride_pl_row + heads * stride_pl_head + split, lse, mask=h_ok)


@triton.jit
def _mla_combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, rank, num_splits, out_scale, stride_po_row,
                        stride_po_head, stride_po_split, stride_pl_row, stride_pl_head, stride_o_row, stride_o_head,
                        RANK_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, RANK_PAD)
    r_ok = r < rank
    lse_base = part_lse_ptr + row * stride_pl_row + head * stride_pl_head
    out_base = part_out_ptr + row * stride_po_row + head * stride_po_head
    top = tl.load(lse_base)  # split 0 always holds position 0
    for j in range(1, num_splits):
        top = tl.maximum(top, tl.load(lse_base + j))
    acc = tl.zeros((RANK_PAD,), tl.float32)
    weight_sum = 0.0
    for j in range(0, num_splits):
        weight = tl.exp(tl.load(lse_base + j) - top)
        acc += weight * tl.load(out_base + j * stride_po_split + r, mask=r_ok, other=0.0)
        weight_sum += weight
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + r,
             (acc * (out_scale / weight_sum)).to(out_ptr.dtype.element_ty), mask=r_ok)


def choose_splits(num_rows: int, num_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Context splits: enough programs to cover the SMs twice, each split >= ``MIN_SPLIT_TOKENS``."""
    programs = max(1, num_rows * triton.cdiv(num_heads, BLOCK_H))
    return max(1, min(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS), MAX_SPLITS))


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               seq_ids: torch.Tensor, scale: float, kv_scale: float = 1.0,
               num_splits: int | None = None) -> torch.Tensor:
    """``o_lat [D, H, rank]`` in ``q_lat``'s dtype (module docstring); ``num_splits`` overrides the choice."""
    num_rows, num_heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    if cache.shape[-1] != rank + rope or cache.stride(-1) != 1 or q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError(f"mla_decode: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)} do not fit the latent "
                         f"cache {tuple(cache.shape)} (last dimensions contiguous)")
    out = torch.empty_like(q_lat)
    if num_rows == 0:
        return out
    splits = num_splits or choose_splits(num_rows, num_heads, meta.max_seq_len, _num_sms(q_lat.device))
    split_len = triton.cdiv(triton.cdiv(meta.max_seq_len, splits), BLOCK_N) * BLOCK_N
    part_out = torch.empty((num_rows, num_heads, splits, rank), dtype=torch.float32, device=q_lat.device)
    part_lse = torch.empty((num_rows, num_heads, splits), dtype=torch.float32, device=q_lat.device)
    rank_pad, rope_pad = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope))
    _mla_decode_kernel[(num_rows, triton.cdiv(num_heads, BLOCK_H), splits)](
        q_lat, q_pe, cache, seq_ids, meta.seq_lens, meta.block_tables, part_out, part_lse, scale * kv_scale,
        num_heads, rank, rope, split_len, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0), part_out.stride(0), part_out.stride(1),
        part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        RANK_PAD=rank_pad, ROPE_PAD=rope_pad, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, PAGE=cache.shape[1],
        KV_FP8=cache.dtype == torch.float8_e4m3fn, IEEE=q_lat.dtype == torch.float32,
        DOT_UPCAST=_INTERPRETING and q_lat.dtype == torch.bfloat16, num_warps=4, num_stages=2,
    )  # fmt: skip
    _mla_combine_kernel[(num_rows, num_heads)](
        part_out, part_lse, out, rank, splits, kv_scale, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), RANK_PAD=rank_pad, num_warps=4,
    )  # fmt: skip
    return out


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0) -> None:
    """Store each token's row ``[T, rank + rope]`` at its slot; negative slots are skipped."""
    num_tokens, dim = latent.shape
    if cache.shape[-1] != dim or cache.stride(-1) != 1:
        raise ValueError(f"write_latent: rows {tuple(latent.shape)} do not fit the cache {tuple(cache.shape)}")
    if num_tokens == 0:
        return
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    quantize = cache.dtype == torch.float8_e4m3fn
    _write_latent_kernel[(num_tokens,)](
        latent, cache, slot_mapping, dim, 1.0 / scale, latent.stride(0), cache.stride(0), cache.stride(1),
        DIM_PAD=triton.next_power_of_2(dim), BLOCK_SIZE=cache.shape[1], QUANTIZE=quantize,
        ROUND_FIRST=quantize and _INTERPRETING,
    )  # fmt: skip
