"""Multi-head latent attention (DeepSeek-V3): torch references, the CPU path and the step's plan.

A layer caches one row per token, ``[c | k_pe]`` (``LatentCache``): ``c`` the normed latent
(``kv_lora_rank`` wide), ``k_pe`` the rotated rope key every head shares. With ``W_UK[h]``
``[nope, rank]`` and ``W_UV[h]`` ``[v, rank]`` (head h's rows of ``kv_b_proj``), head h's key at
position s is ``[W_UK[h] c_s | k_pe_s]`` and its value ``W_UV[h] c_s``. The model attends in one of
two forms per sequence of the step (``mla_plan`` sorts them):

- **decode** (one query token), the absorbed form: the model folds ``W_UK`` into the query,
  ``q_lat[h] = W_UK[h]^T q_nope[h]``, so a score is ``q_lat[h] . c_s + q_pe[h] . k_pe_s``: the
  attention reads the cached rows as they are, once for all heads (``mla_decode``), returns
  ``o_lat[h] = sum_s p_hs c_s`` and the model applies ``W_UV[h]`` after it. Bytes read per
  context token and layer: ``rank + rope`` values, whatever the head count.
- **prefill** (a chunk of several tokens), the expanded form: the chunk's context rows are
  gathered (``gather_context``; the chunk's own rows were just written), the model expands
  them through ``kv_b_proj`` into per-head keys and values, and ``prefill_attention`` runs
  causal attention per sequence (SDPA, whose key and value head sizes may differ): fewer
  FLOPs than the absorbed form when many queries share one context (vLLM and SGLang split the
  two forms the same way).

Invariants: rows are written before they are read (a sequence's new tokens attend to
themselves through the cache); an fp8 (float8_e4m3fn) cache stores ``quantize_fp8(x, scale)``
and is read back times ``scale``; accumulation is in float32 (float64 for float64 inputs).
The plan is made from the metadata's host lists once per step (kept in ``meta.cpu_plans``);
a decode-only step (``max_query_len == 1``, every CUDA-graph step) needs no host list at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.reference import (FP8, _context_slots, _dequantize, _gather_context, decode_buckets,
                                      quantize_fp8)


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0) -> None:
    """Store each token's row ``latent [T, rank + rope]`` at its slot of ``cache``
    ``[num_blocks, block_size, 1, rank + rope]``; an fp8 cache stores ``quantize_fp8(x, scale)``."""
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == FP8:  # index_copy_ has no fp8 kernel: copy the bytes
        flat.view(torch.uint8).index_copy_(0, slot_mapping, quantize_fp8(latent, scale).view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping, latent.to(cache.dtype))


@dataclass
class MlaPlan:
    """One step's split into decode rows and prefill chunks (host lists only, made once per step)."""

    decode_rows: Optional[torch.Tensor]  # [D] query rows of one-token sequences; None: every row is one
    decode_seqs: torch.Tensor  # [D] int32: the sequence of each decode row
    decode_seqs_host: list[int]
    prefills: list[tuple[slice, int, int]] = field(default_factory=list)  # (query rows, context start, length)
    context_slots: Optional[torch.Tensor] = None  # [sum of prefill contexts] cache slots, one sequence after another
    masks: list[torch.Tensor] = field(default_factory=list)  # per prefill: [q_len, context] visible keys
    decode_buckets: Optional[list] = None  # the CPU path's buckets (``mla_decode_torch``), made on first use

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seqs_host)


def mla_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> MlaPlan:
    """The step's ``MlaPlan`` (made once per step, kept on ``meta``)."""
    key = ("mla", block_size, device)
    plan = meta.cpu_plans.get(key)
    if plan is None:
        plan = meta.cpu_plans[key] = _make_plan(meta, block_size, device)
    return plan


def _make_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> MlaPlan:
    num_seqs = meta.num_seqs
    if meta.max_query_len == 1:  # decode only: row i is sequence i (no host list read)
        return MlaPlan(None, torch.arange(num_seqs, dtype=torch.int32, device=device), list(range(num_seqs)))
    starts = meta.query_start_loc.tolist()
    decode = [s for s, n in enumerate(meta.query_lens_host) if n == 1]
    plan = MlaPlan(torch.tensor([starts[s] for s in decode], dtype=torch.int64, device=device),
                   torch.tensor(decode, dtype=torch.int32, device=device), decode)
    slots, offset = [], 0
    for s, q_len in enumerate(meta.query_lens_host):
        if q_len == 1:
            continue
        s_len = meta.seq_lens_host[s]
        slots.append(_context_slots(meta.block_tables[s:s + 1], s_len, block_size, device).view(-1))
        plan.prefills.append((slice(starts[s], starts[s] + q_len), offset, s_len))
        plan.masks.append(torch.ones(q_len, s_len, dtype=torch.bool, device=device).tril(diagonal=s_len - q_len))
        offset += s_len
    plan.context_slots = torch.cat(slots) if slots else None
    return plan


def gather_context(cache: torch.Tensor, plan: MlaPlan, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The prefill chunks' context rows ``[sum of contexts, rank + rope]`` in ``dtype`` (fp8 times ``scale``)."""
    rows = cache.view(-1, cache.shape[-1]).index_select(0, plan.context_slots)
    return _dequantize(rows, dtype, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: MlaPlan, scale: float,
                      out: torch.Tensor) -> None:
    """Causal attention of every prefill chunk, into ``out``'s rows (the expanded form).

    Args:
        q: ``[num_tokens, H, qk]`` every row's query (decode rows are not read).
        k, v: ``[sum of contexts, H, qk]`` / ``[..., H, v]``: the chunks' context, expanded.
        out: ``[num_tokens, H, v]``; the prefill rows are written.
    """
    for (rows, start, length), mask in zip(plan.prefills, plan.masks):
        qh = q[rows].transpose(0, 1)  # [H, q_len, qk]
        kh, vh = k[start:start + length].transpose(0, 1), v[start:start + length].transpose(0, 1)
        out[rows] = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                   seqs: list[int], scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """Definition of the absorbed decode, one row at a time (slow, exact; float64 in, float64 math).

    Args:
        q_lat: ``[D, H, rank]`` the absorbed queries; q_pe ``[D, H, rope]`` their rotated rope parts.
        cache: ``[num_blocks, block_size, 1, rank + rope]`` (fp8: times ``kv_scale``).
        seqs: the sequence (of ``meta``) each row decodes.
    Returns:
        ``o_lat [D, H, rank]``: per head, the softmax-weighted sum of the context's latents.
    """
    acc = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    rank = q_lat.shape[-1]
    out = torch.empty_like(q_lat)
    for i, s in enumerate(seqs):
        context = _dequantize(_gather_context(cache, meta.block_tables[s], meta.seq_lens_host[s]), acc,
                              kv_scale)[:, 0]  # [S, rank + rope]
        query = torch.cat([q_lat[i], q_pe[i]], dim=-1).to(acc)  # [H, rank + rope]
        probs = torch.softmax(query @ context.T * scale, dim=-1)  # [H, S]
        out[i] = (probs @ context[:, :rank]).to(out.dtype)
    return out


def mla_decode_torch(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     plan: MlaPlan, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """``mla_decode_ref``'s result, batched for a CPU: rows in buckets of similar context length
    (``reference.decode_buckets``), each one gather and two batched matmuls in float32."""
    acc = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    rank, block_size = q_lat.shape[-1], cache.shape[1]
    if plan.decode_buckets is None:
        plan.decode_buckets = _buckets(meta, plan, block_size, q_lat.device)
    flat = cache.view(-1, cache.shape[-1])
    out = torch.empty_like(q_lat)
    for rows, slots, mask in plan.decode_buckets:
        context = _dequantize(flat.index_select(0, slots.reshape(-1)), acc, kv_scale).view(*slots.shape, -1)
        context = context.masked_fill(~mask[..., None], 0)  # padding rows: zero weight must not meet a NaN
        query = torch.cat([q_lat[rows], q_pe[rows]], dim=-1).to(acc)  # [B, H, rank + rope]
        scores = torch.matmul(query, context.transpose(1, 2)) * scale  # [B, H, L]
        probs = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        out[rows] = torch.matmul(probs, context[..., :rank]).to(out.dtype)
    return out


def _buckets(meta: AttentionMetadata, plan: MlaPlan, block_size: int, device: torch.device) -> list:
    """(rows of ``q_lat``, ``[B, L]`` context slots padded with a valid one, ``[B, L]`` visible) per bucket."""
    lens = [meta.seq_lens_host[s] for s in plan.decode_seqs_host]
    buckets = []
    for bucket in decode_buckets(lens, list(range(len(lens)))):
        seqs = torch.tensor([plan.decode_seqs_host[i] for i in bucket], dtype=torch.long, device=device)
        longest = max(lens[i] for i in bucket)
        slots = _context_slots(meta.block_tables[seqs], longest, block_size, device)
        bucket_lens = torch.tensor([lens[i] for i in bucket], dtype=torch.long, device=device)
        mask = torch.arange(longest, device=device)[None, :] < bucket_lens[:, None]
        buckets.append((torch.tensor(bucket, dtype=torch.long, device=device), slots, mask))
    return buckets
