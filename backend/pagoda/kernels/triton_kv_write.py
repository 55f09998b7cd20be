"""Write each step's new K/V into their paged-cache slots, in OpenAI Triton.

One program per token copies all its KV heads (``[num_kv_heads, head_dim]``, both padded
to powers of two with masks) of K and of V to ``slot = block * block_size + offset``.
A negative slot marks a padding token (e.g. a CUDA-graph batch padded to a fixed size)
and is skipped. Slots and cache offsets are int64.

FP8 cache (``float8_e4m3fn``): each value is divided by the per-tensor scale in fp32,
clamped to e4m3's finite range (+-448, so an outlier saturates instead of becoming NaN)
and rounded to e4m3 (3 mantissa bits: relative error <= 2^-4). The conversion goes
through fp32 for every input dtype (Triton's interpreter converts bf16 -> fp8 wrongly).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


# Triton's interpreter rounds fp32 -> e4m3 wrongly when rounding carries into the exponent
# (1.97 -> 1.0). Under it (and only there) values are first rounded to the e4m3 grid in
# fp32, so the cast is exact; compiled GPU code converts with the hardware's round-to-nearest.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _to_cache(x, inv_scale, cache_dtype: tl.constexpr, QUANTIZE: tl.constexpr, ROUND_FIRST: tl.constexpr):
    if QUANTIZE:
        y = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
        if ROUND_FIRST:  # e4m3: 3 mantissa bits; the subnormal step 2^-9 below 2^-6
            exponent = tl.floor(tl.log2(tl.maximum(tl.abs(y), 2.0**-20)))
            step = tl.exp2(tl.maximum(exponent, -6.0) - 3.0)
            y = tl.floor(y / step + 0.5) * step
        return y.to(cache_dtype)
    return x.to(cache_dtype)


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    num_kv_heads,
    inv_k_scale,  # 1 / the K cache's scale (fp8 cache only)
    inv_v_scale,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,  # the cache is float8_e4m3fn
    ROUND_FIRST: tl.constexpr,  # interpreter only (see _INTERPRETING)
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    kc = block * stride_kc_block + offset * stride_kc_slot + heads[:, None] * stride_kc_head + dims[None, :]
    tl.store(k_cache_ptr + kc, _to_cache(k, inv_k_scale, k_cache_ptr.dtype.element_ty, QUANTIZE, ROUND_FIRST),
             mask=mask)

    v = tl.load(v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    vc = block * stride_vc_block + offset * stride_vc_slot + heads[:, None] * stride_vc_head + dims[None, :]
    tl.store(v_cache_ptr + vc, _to_cache(v, inv_v_scale, v_cache_ptr.dtype.element_ty, QUANTIZE, ROUND_FIRST),
             mask=mask)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K/V at its slot; tokens with a negative slot are skipped.

    An fp8 cache stores ``clamp(x / scale, +-448)`` rounded to e4m3; the scales must be
    1.0 for a cache in another dtype.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit cache {tuple(k_cache.shape)}")
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    quantize = k_cache.dtype == torch.float8_e4m3fn
    if v_cache.dtype != k_cache.dtype or (not quantize and (k_scale != 1.0 or v_scale != 1.0)):
        raise ValueError(f"k_cache {k_cache.dtype} / v_cache {v_cache.dtype} with scales {k_scale}, {v_scale}: "
                         "the caches share a dtype and only an fp8 cache takes scales")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=k_cache.shape[1], QUANTIZE=quantize,
        ROUND_FIRST=quantize and _INTERPRETING,
    )  # fmt: skip
