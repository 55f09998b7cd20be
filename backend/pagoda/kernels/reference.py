"""Torch reference implementations of every kernel: the CPU path and the ground truth.

``paged_attention_ref`` is the plain per-sequence definition (used by tests, in float64).
``paged_attention_torch`` computes the same thing faster on CPU: all single-token
(decode) sequences through the C++ kernel (``cpu_native``) or, without it, in batched SDPA
calls over buckets of similar length; each prefill chunk in its own SDPA call.
All functions accumulate in float32 (or the input's dtype when that is float64) and
return the input dtype.

FP8 KV cache (``float8_e4m3fn`` cache tensors): ``write_kv`` stores
``clamp(x / scale, +-448)`` rounded to e4m3, the attention functions upcast the gathered
context and multiply by the scale, emulating the Triton kernels on CPU.

Key limits (``AttentionMetadata.key_limits``, Gemma 3's images): a query sees keys up to its
limit instead of its own position (within the sliding window, when there is one); the prefill
chunks take them in their masks, one-token queries never have one past their position.

Attention sinks (gpt-oss; ``sinks [num_heads]``, None for every other model): a learned
per-head logit joins each query row's softmax denominator and contributes no value,
``out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink))`` (transformers' ``eager_attention_forward``
with ``s_aux``). SDPA has no such input, so the torch path computes those rows explicitly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_native
from pagoda.kernels.metadata import AttentionMetadata


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``clamp(x / scale, +-448)`` rounded to float8_e4m3fn (computed in fp32 or wider)."""
    wide = x.double() if x.dtype == torch.float64 else x.float()
    return (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K/V at its slot (block * block_size + offset); an fp8 cache
    stores ``quantize_fp8(x, scale)``."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        if cache.dtype == FP8:  # index_copy_ has no fp8 kernel: copy the bytes
            flat.view(torch.uint8).index_copy_(0, slot_mapping, quantize_fp8(x, scale).view(torch.uint8))
        else:
            flat.index_copy_(0, slot_mapping, x.to(cache.dtype))


def _dequantize(context: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Gathered cache rows in ``dtype``; fp8 rows times their scale."""
    out = context.to(dtype)
    return out * scale if context.dtype == FP8 and scale != 1.0 else out


def _gather_context(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] context of one sequence from the paged cache."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Definition of paged causal GQA attention, one sequence at a time (slow, exact).

    ``window > 0``: sliding-window attention, a query at position p sees keys at positions
    ``p - window < k <= p`` (transformers' rule). ``sinks``: see the module docstring.
    """
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    start = 0
    for s, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        qs = q[start : start + q_len].to(acc_dtype)  # [q_len, H, D]
        ks = _dequantize(_gather_context(k_cache, meta.block_tables[s], s_len), acc_dtype, k_scale)  # [S, KVH, D]
        vs = _dequantize(_gather_context(v_cache, meta.block_tables[s], s_len), acc_dtype, v_scale)
        group = num_heads // ks.shape[1]
        ks = ks.repeat_interleave(group, dim=1)
        vs = vs.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # [H, q_len, S]
        q_pos = torch.arange(s_len - q_len, s_len).unsqueeze(1)
        k_pos = torch.arange(s_len).unsqueeze(0)
        limit = q_pos if meta.key_limits_host is None else \
            torch.tensor(meta.key_limits_host[start:start + q_len]).unsqueeze(1)
        hidden = (k_pos > limit) | ((k_pos <= q_pos - window) if window > 0 else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # one more logit per head in the denominator, dropped after
            sink = sinks.to(acc_dtype).view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :s_len]
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype)
        start += q_len
    return out


def paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same result as ``paged_attention_ref`` (``window``, ``sinks`` too), batched for speed on CPU.

    With pagoda's C++ kernels (``kernels.cpu_native``) the one-token queries and, on an
    AVX-512 build, the plain causal prompt chunks read the paged cache in place; the rest
    (an image's chunk, an fp8 cache, no C++ kernels) gathers its context and runs SDPA. The
    gather indices and masks depend only on the step (``cpu_plan``, made once and kept on
    ``meta``), so each layer only gathers its cache rows and attends."""
    ops = cpu_native.native_decode(q, k_cache, v_cache)
    prefill_ops = cpu_native.native_prefill(ops, q.shape[-1])
    q = q.contiguous() if ops is not None else q
    out = torch.empty_like(q)
    plan = cpu_plan(meta, k_cache.shape[1], window, q.device, ops is not None, prefill_ops is not None)
    native_sinks = None if sinks is None or ops is None else sinks.float().contiguous()
    if ops is not None and plan.decode_rows is not None:  # every one-token query, read in place (kernels.cpu_native)
        ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, plan.decode_rows,
                             plan.decode_seqs, scale, window, native_sinks, out)
    for decode in plan.decodes:
        _decode_batch(q, k_cache, v_cache, decode, scale, out, k_scale, v_scale, sinks)
    for rows, table, s_len in plan.native_prefills:  # causal chunks, read in place (kernels.cpu_native)
        prefill_ops.prefill_attention(q[rows], k_cache, v_cache, table, s_len, scale, window, native_sinks, out[rows])
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, KVH, D]
    for rows, slots, mask in plan.prefills:
        kh = flat_k.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
        vh = flat_v.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        qh = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        kh, vh = _dequantize(kh, q.dtype, k_scale), _dequantize(vh, q.dtype, v_scale)
        if sinks is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=kh.shape[1] != qh.shape[1])
        else:
            if mask is None:
                mask = torch.ones(qh.shape[2], kh.shape[2], dtype=torch.bool, device=q.device).tril()
            group = qh.shape[1] // kh.shape[1]
            o = _attend_with_sinks(qh, kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1), mask, scale,
                                   sinks.view(1, -1, 1, 1))
        out[rows] = o[0].transpose(0, 1)
    return out


@dataclass
class DecodePlan:
    """One bucket of the step's one-token queries: their rows, their contexts' cache slots
    padded to the longest, and which of those are real (and inside the window)."""

    rows: torch.Tensor  # [B] query rows
    slots: torch.Tensor  # [B * max_len] cache slots (padding repeats a valid slot)
    mask: torch.Tensor  # [B, max_len] visible keys
    max_len: int
    window: int


@dataclass
class CpuPlan:
    decodes: list[DecodePlan]  # the one-token queries, in buckets of similar context length
    # (query rows, context slots, [q_len, S] mask; None: plain causal, a chunk with no context before it)
    prefills: list[tuple[slice, torch.Tensor, Optional[torch.Tensor]]]
    decode_rows: Optional[torch.Tensor] = None  # native decode (then no buckets): the one-token queries' rows
    decode_seqs: Optional[torch.Tensor] = None  # and their sequences
    # native prefill: the chunks whose queries see up to their own position (query rows, block table row, s_len)
    native_prefills: list[tuple[slice, torch.Tensor, int]] = field(default_factory=list)


# Decode buckets: a batched decode pads every context to the longest, so contexts of very
# different lengths are split into buckets. The split minimises, over the contexts sorted by
# length, the sum of each bucket's padded size (sequences x its longest context) plus
# BUCKET_COST per bucket: the fixed price of its two gathers and one SDPA call, in context
# rows (on the 2-core EPYC VM a call costs ~30 us and a gathered row ~0.015 us). A bucket
# holds at most BUCKET_MAX sequences, which keeps the split O(BUCKET_MAX x n) per step.
BUCKET_COST = 1024
BUCKET_MAX = 64


def decode_buckets(seq_lens: list[int], decode: list[int]) -> list[list[int]]:
    """``decode`` (sequence indices) in buckets of similar ``seq_lens``, shortest first."""
    order = sorted(decode, key=lambda s: seq_lens[s])
    lens = [seq_lens[s] for s in order]
    best, cut = [0] + [0] * len(order), [0] * (len(order) + 1)  # best[i]: cost of the first i
    for i in range(1, len(order) + 1):
        best[i], cut[i] = min((best[j] + (i - j) * lens[i - 1] + BUCKET_COST, j)
                              for j in range(max(0, i - BUCKET_MAX), i))
    buckets, i = [], len(order)
    while i > 0:
        buckets.append(order[cut[i]:i])
        i = cut[i]
    return buckets[::-1]


def cpu_plan(meta: AttentionMetadata, block_size: int, window: int, device: torch.device,
             native: bool = False, native_prefill: bool = False) -> CpuPlan:
    """The step's gather indices and masks for ``window`` (made once per step, kept on ``meta``);
    ``native``: the one-token queries go to the C++ kernel (rows and sequences, no buckets);
    ``native_prefill``: so do the prompt chunks that are plain causal (no image's key limits)."""
    key = (block_size, window, device, native, native_prefill)
    plan = meta.cpu_plans.get(key)
    if plan is None:
        plan = meta.cpu_plans[key] = _make_plan(meta, block_size, window, device, native, native_prefill)
    return plan


def _make_plan(meta: AttentionMetadata, block_size: int, window: int, device: torch.device,
               native: bool, native_prefill: bool = False) -> CpuPlan:
    query_lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
    starts = meta.query_start_loc.tolist()
    decode = [s for s, n in enumerate(query_lens) if n == 1]
    limits = meta.key_limits_host
    assert limits is None or all(limits[starts[s]] == seq_lens[s] - 1 for s in decode), \
        "a one-token query's key limit is its own position (a chunk never ends inside an image)"
    prefills, native_prefills = [], []
    for s, q_len in enumerate(query_lens):
        if q_len == 1:
            continue
        s_len = seq_lens[s]
        # Causal with an offset: query i sits at position s_len - q_len + i. A chunk with no
        # context before it (and no window) is plain causal: None, and SDPA's is_causal skips the
        # masked half (a 2k-token first chunk in half the time; the same result bit for bit).
        limits = _chunk_key_limits(meta, starts[s], q_len, s_len)
        if native_prefill and limits is None:
            native_prefills.append((slice(starts[s], starts[s] + q_len), meta.block_tables[s].contiguous(), s_len))
            continue
        slots = _context_slots(meta.block_tables[s:s + 1], s_len, block_size, device).view(-1)
        if limits is not None:  # keys up to each query's limit (an image's tokens see the whole image)
            mask = torch.arange(s_len).unsqueeze(0) <= torch.tensor(limits).unsqueeze(1)
            mask = mask.to(device)
        else:
            mask = None if s_len == q_len and window == 0 else \
                torch.ones(q_len, s_len, dtype=torch.bool, device=device).tril(diagonal=s_len - q_len)
        if window > 0:  # and not more than window - 1 positions back
            mask &= ~torch.ones_like(mask).tril(diagonal=s_len - q_len - window)
        prefills.append((slice(starts[s], starts[s] + q_len), slots, mask))
    if native:
        rows = torch.tensor([starts[s] for s in decode], dtype=torch.long, device=device) if decode else None
        return CpuPlan([], prefills, rows, torch.tensor(decode, dtype=torch.long, device=device), native_prefills)
    decodes = [_decode_plan(meta, bucket, starts, block_size, window, device)
               for bucket in decode_buckets(seq_lens, decode)]
    return CpuPlan(decodes, prefills, native_prefills=native_prefills)


def _chunk_key_limits(meta: AttentionMetadata, row: int, q_len: int, s_len: int) -> Optional[list[int]]:
    """The key limits of one chunk's queries (rows ``row..row + q_len``), or None when every query
    sees keys up to its own position only (plain causal)."""
    if meta.key_limits_host is None:
        return None
    limits = meta.key_limits_host[row:row + q_len]
    first = s_len - q_len
    return None if all(limit == first + i for i, limit in enumerate(limits)) else limits


def _context_slots(tables: torch.Tensor, max_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[B, max_len] cache slots of positions 0..max_len-1 of each row's block table."""
    nblk = (max_len + block_size - 1) // block_size
    blocks = tables[:, :nblk].long()  # [B, nblk]
    return (blocks.unsqueeze(2) * block_size + torch.arange(block_size, device=device)).flatten(1)[:, :max_len]


def _decode_plan(meta: AttentionMetadata, decode: list[int], starts: list[int], block_size: int, window: int,
                 device: torch.device) -> DecodePlan:
    idx = torch.tensor(decode, dtype=torch.long, device=device)
    lens = torch.tensor([meta.seq_lens_host[s] for s in decode], dtype=torch.long, device=device)
    max_len = max(meta.seq_lens_host[s] for s in decode)
    pos = torch.arange(max_len, device=device)
    slots = _context_slots(meta.block_tables[idx], max_len, block_size, device)
    mask = pos.unsqueeze(0) < lens.unsqueeze(1)
    if window > 0:  # the query sits at lens - 1
        mask &= pos.unsqueeze(0) >= lens.unsqueeze(1) - window
    rows = torch.tensor([starts[s] for s in decode], dtype=torch.long, device=device)
    return DecodePlan(rows, slots.reshape(-1), mask, max_len, window)


def _attend_with_sinks(q, k, v, mask, scale, sinks) -> torch.Tensor:
    """``softmax([q k^T * scale, sink])[:-1] @ v`` over ``[..., rows, D]`` operands (``mask``: visible keys),
    accumulated in float32 (float64 for float64 inputs)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(acc).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.to(acc)).to(q.dtype)


def _decode_batch(q, k_cache, v_cache, plan: DecodePlan, scale, out, k_scale=1.0, v_scale=1.0, sinks=None) -> None:
    """All one-token queries at once: gather padded contexts, mask the padding.

    The query heads that share a KV head are laid out as that KV head's query rows
    (``[B, KVH, group, D]``), so grouped-query attention needs no K/V repetition.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch, max_len = plan.rows.shape[0], plan.max_len
    ks = k_cache.view(-1, num_kv_heads * head_dim).index_select(0, plan.slots).view(batch, max_len, num_kv_heads,
                                                                                    head_dim)
    vs = v_cache.view(-1, num_kv_heads * head_dim).index_select(0, plan.slots).view(batch, max_len, num_kv_heads,
                                                                                    head_dim)
    qh = q.index_select(0, plan.rows).view(batch, num_kv_heads, group, head_dim)  # [B, KVH, G, D]
    ks, vs = _dequantize(ks, q.dtype, k_scale), _dequantize(vs, q.dtype, v_scale)  # (fp8 has no masked_fill)
    if plan.window > 0 or sinks is not None:
        # SDPA (and P @ V) may still combine masked rows (padding past a shorter context)
        # into the result: keep them finite.
        ks = ks.masked_fill(~plan.mask[:, :, None, None], 0)
        vs = vs.masked_fill(~plan.mask[:, :, None, None], 0)
    mask = plan.mask.view(batch, 1, 1, max_len)
    kh, vh = ks.transpose(1, 2), vs.transpose(1, 2)
    if sinks is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)  # [B, KVH, G, D]
    else:
        o = _attend_with_sinks(qh, kh, vh, mask, scale, sinks.view(1, num_kv_heads, group, 1))
    out[plan.rows] = o.reshape(batch, num_heads, head_dim)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm, optionally fused with the residual add.

    Returns:
        ``(normed, new_residual)`` where ``new_residual = x + residual`` (None when no
        residual was given); the norm is taken of ``new_residual`` in that case.
    """
    if residual is not None:
        x = x + residual
        residual = x
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(acc)).to(x.dtype), residual


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in the first half, sin in the second
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, NeoX / Hugging Face Llama style (rotate the two halves):
    ``(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)``, computed as ``x * [c, c] + roll(x) * [-s, s]``
    (the same products and sums, so the same bits) with the step's tables made once
    (``_rotary_tables``): four ops per tensor instead of nine."""
    half = cos_sin_cache.shape[1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = _rotary_tables(positions, cos_sin_cache, acc)
        xa = x.to(acc)
        return (xa * cos + xa.roll(half, -1) * sin).to(x.dtype)

    return rotate(q), rotate(k)


_ROTARY_TABLES: dict = {}  # (cache id, dtype) -> (weak ref to the cache, positions copy, cos, sin)


def _rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[c, c]`` and ``[-s, s]`` (``[num_tokens, 1, head_dim]`` in ``acc``) for ``positions``,
    made once per step on a CPU (elsewhere every call makes them: the check below would read
    the device): every layer rotates at the same positions. Reused only while the
    positions are equal in value (compared, not trusted by identity: a buffer may be refilled
    in place under inference mode, which keeps no version counter)."""
    key = (id(cos_sin_cache), acc)
    hit = _ROTARY_TABLES.get(key) if positions.device.type == "cpu" else None  # comparing elsewhere would sync
    if (hit is not None and hit[0]() is cos_sin_cache and hit[1].shape == positions.shape
            and torch.equal(hit[1], positions)):
        return hit[2], hit[3]
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions].to(acc)
    cos, sin = cs[:, :half], cs[:, half:]
    tables = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)
    if positions.device.type == "cpu":
        if len(_ROTARY_TABLES) >= 8:
            _ROTARY_TABLES.clear()
        _ROTARY_TABLES[key] = (weakref.ref(cos_sin_cache), positions.clone(), *tables)
    return tables


def lora_apply(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
               groups: list) -> torch.Tensor:
    """Multi-LoRA delta, one GEMM pair per active adapter: ``y[idx] += (x[idx] @ A[s].T) @ B[s].T``.

    ``groups`` lists ``(slot, token indices)`` for the adapters of this step (built on the
    host with the step's layout, so nothing here syncs); tokens in no group are untouched.
    """
    for slot, idx in groups:
        xs = x.index_select(0, idx)
        delta = (xs @ a_stack[slot].T) @ b_stack[slot].T  # [len(idx), out]
        y.index_add_(0, idx, delta.to(y.dtype))
    return y
