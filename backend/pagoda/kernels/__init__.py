"""The single dispatch point for hot-path kernels.

The model calls only the functions below (attention, KV write, norm, rotary, LoRA, the
MoE experts, and ``w8a16_linear`` for 8-bit weights). Each picks an implementation per call:
OpenAI-Triton kernels for CUDA tensors, torch references otherwise. ``PAGODA_KERNELS``
overrides the choice (``triton`` forces the kernels, e.g. under ``TRITON_INTERPRET=1`` on
CPU in tests; ``torch`` forces the references, e.g. to compare on a GPU).
"""

from __future__ import annotations

import os

import torch

from pagoda.kernels import reference, w8a16
from pagoda.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv", "rms_norm", "apply_rotary", "lora_apply",
           "w8a16_linear", "moe_experts", "use_triton"]


def use_triton(x: torch.Tensor) -> bool:
    """Whether the OpenAI-Triton kernels serve a call on tensor ``x``."""
    choice = os.environ.get("PAGODA_KERNELS", "auto")
    if choice == "torch":
        return False
    if choice == "triton":
        return _triton_available()
    return x.is_cuda and _triton_available()


def _triton_available() -> bool:
    try:
        from pagoda.kernels import triton_ops  # noqa: F401
    except ImportError:
        return False
    return True


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, window: int = 0, sinks=None):
    """Paged causal GQA attention; an fp8 (float8_e4m3fn) cache is dequantised with the scales.
    ``window > 0``: sliding window, a query at p sees keys in ``(p - window, p]``. ``sinks``
    (``[num_heads]`` float32, gpt-oss): one learned logit per head in each softmax denominator."""
    if use_triton(q):
        from pagoda.kernels import triton_ops

        return triton_ops.paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks)
    return reference.paged_attention_torch(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks)


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new K/V at their slots; an fp8 cache stores ``clamp(x / scale, +-448)`` in e4m3."""
    if use_triton(k):
        from pagoda.kernels import triton_ops

        return triton_ops.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return reference.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rms_norm(x, weight, eps: float, residual=None):
    if use_triton(x):
        from pagoda.kernels import triton_ops

        return triton_ops.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def apply_rotary(q, k, positions, cos_sin_cache):
    if use_triton(q):
        from pagoda.kernels import triton_ops

        return triton_ops.apply_rotary(q, k, positions, cos_sin_cache)
    return reference.apply_rotary(q, k, positions, cos_sin_cache)


def lora_apply(y, x, a_stack, b_stack, batch):
    """Add each token's LoRA delta to ``y`` in place (``batch``: a ``models.lora.LoRABatch``)."""
    if use_triton(x):
        from pagoda.kernels import triton_ops

        return triton_ops.lora_apply(y, x, a_stack, b_stack, batch.token_slots)
    return reference.lora_apply(y, x, a_stack, b_stack, batch.groups)


def moe_experts(x, order, weights, offsets, w13, w2, top_k: int, b13=None, b2=None, clamped_swiglu=None):
    """Each token's routing-weighted sum of its experts (assignments grouped as ``models.moe``
    makes them): the fused kernels of ``triton_moe`` on CUDA, the experts-with-tokens loop
    elsewhere. Neither computes an expert that received no token. gpt-oss: expert biases
    ``b13 [E, 2 * inter]`` / ``b2 [E, hidden]`` and ``clamped_swiglu=(alpha, limit)``."""
    if use_triton(x):
        from pagoda.kernels import triton_ops

        return triton_ops.moe_experts(x, order, weights, offsets, w13, w2, top_k, b13, b2, clamped_swiglu)
    return reference.moe_experts(x, order, weights, offsets, w13, w2, top_k, b13, b2, clamped_swiglu)


def w8a16_linear(x, qweight, scale):
    """``x @ (qweight * scale[:, None]).T`` for an int8 or fp8 ``[N, K]`` weight (pagoda.kernels.w8a16).

    CUDA: the Triton W8A16 kernel below ``w8a16.DEQUANT_ROWS`` rows, dequantize + cuBLAS
    from there; elsewhere the torch reference (dequantize + ``F.linear``).
    """
    if use_triton(x) and x.numel() < w8a16.DEQUANT_ROWS * x.shape[-1]:
        from pagoda.kernels import triton_w8a16

        return triton_w8a16.w8a16_linear(x, qweight, scale)
    return w8a16.w8a16_linear_ref(x, qweight, scale)
