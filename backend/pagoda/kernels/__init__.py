"""The single dispatch point for hot-path kernels.

The model calls only the functions below (attention, KV write, norm, rotary, LoRA, the
latent write and absorbed decode of multi-head latent attention (``reference_mla``), the
MoE experts, ``w8a16_linear`` for 8-bit weights, and Gated DeltaNet's causal conv1d, gated
delta rule and gated RMSNorm, which read and write per-sequence state slots). Each picks an implementation per call:
OpenAI-Triton kernels for CUDA tensors; on a CPU pagoda's C++ kernels where they apply
(``cpu_native``: decode attention, RMSNorm, rotary, silu * up; ``PAGODA_CPU_KERNELS``),
torch references otherwise. ``PAGODA_KERNELS`` overrides the choice (``triton`` forces
the Triton kernels, e.g. under ``TRITON_INTERPRET=1`` on CPU in tests; ``torch`` forces the
references, the C++ ones off too, e.g. to compare on a GPU).

Both variables are read once, not per call (a benchmark run made ~130k reads of them, ~2% of
its Python time): ``reload_settings`` reads them again. The model runner calls it when it is
built, so an engine follows the environment it was made in; a test that changes either
variable calls it after the change.
"""

from __future__ import annotations

import os

import torch

from pagoda.kernels import cpu_native, reference, reference_gdn, reference_mla, reference_moe, w8a16
from pagoda.kernels.metadata import AttentionMetadata, LatentCache, StateCache
# Multi-head latent attention's step plan and prefill (torch ops on every device: gathers and SDPA).
from pagoda.kernels.reference_mla import MlaPlan, mla_plan
from pagoda.kernels.reference_mla import gather_context as mla_context
from pagoda.kernels.reference_mla import prefill_attention as mla_prefill

__all__ = ["AttentionMetadata", "LatentCache", "StateCache", "MlaPlan", "mla_plan", "mla_context", "mla_prefill",
           "write_latent", "mla_decode", "paged_attention", "write_kv", "rms_norm", "apply_rotary",
           "lora_apply", "w8a16_linear", "fp8_block_linear", "moe_experts", "silu_mul", "use_triton", "causal_conv1d",
           "gated_delta_rule", "gated_rms_norm", "reload_settings"]

_settings = {"kernels": os.environ.get("PAGODA_KERNELS", "auto")}


def reload_settings() -> None:
    """Read ``PAGODA_KERNELS`` and ``PAGODA_CPU_KERNELS`` again (they are read once, not per call)."""
    _settings["kernels"] = os.environ.get("PAGODA_KERNELS", "auto")
    cpu_native.reload_choice()


def use_triton(x: torch.Tensor) -> bool:
    """Whether the OpenAI-Triton kernels serve a call on tensor ``x``."""
    choice = _settings["kernels"]
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
    (``[num_heads]`` float32, gpt-oss): one learned logit per head in each softmax denominator.
    ``meta.key_limits`` (Gemma 3's images attending to each other both ways): a query sees keys
    up to its limit instead of its own position (``kernels.metadata``)."""
    if use_triton(q):
        from pagoda.kernels import triton_ops

        return triton_ops.paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks)
    return reference.paged_attention_torch(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks)


def write_latent(latent, cache, slot_mapping, scale: float = 1.0) -> None:
    """Store multi-head latent attention's rows ``[T, rank + rope]`` at their slots (fp8: ``x / scale``)."""
    if use_triton(latent):
        from pagoda.kernels import triton_mla

        return triton_mla.write_latent(latent, cache, slot_mapping, scale)
    return reference_mla.write_latent(latent, cache, slot_mapping, scale)


def mla_decode(q_lat, q_pe, cache, meta: AttentionMetadata, plan: MlaPlan, scale: float,
               kv_scale: float = 1.0):
    """Absorbed-form decode over the latent cache for ``plan``'s decode rows (``reference_mla``):
    ``o_lat [D, H, rank]``; the Triton split-K kernel on CUDA, batched torch elsewhere."""
    if use_triton(q_lat):
        from pagoda.kernels import triton_mla

        return triton_mla.mla_decode(q_lat, q_pe, cache, meta, plan.decode_seqs, scale, kv_scale)
    return reference_mla.mla_decode_torch(q_lat, q_pe, cache, meta, plan, scale, kv_scale)


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
    ops = cpu_native.native_ops(x)
    if ops is not None and x.dim() == 2 and weight.dtype == x.dtype and x.stride(-1) == 1 and (
            residual is None or residual.stride(-1) == 1):
        out, new_residual = ops.rms_norm(x, residual, weight, eps)
        return out, (new_residual if residual is not None else None)
    return reference.rms_norm(x, weight, eps, residual)


def apply_rotary(q, k, positions, cos_sin_cache):
    if use_triton(q):
        from pagoda.kernels import triton_ops

        return triton_ops.apply_rotary(q, k, positions, cos_sin_cache)
    ops = cpu_native.native_ops(q)
    if (ops is not None and k.dtype == q.dtype and cos_sin_cache.dtype == torch.float32 and q.stride(-1) == 1
            and k.stride(-1) == 1 and positions.dtype == torch.int64 and cos_sin_cache.shape[-1] == q.shape[-1]):
        return ops.rotary(q, k, positions.contiguous(), cos_sin_cache.contiguous())
    return reference.apply_rotary(q, k, positions, cos_sin_cache)


def silu_mul(gate_up):
    """SwiGLU's ``silu(gate) * up`` over ``[tokens, 2 * inter]`` (gate columns first), rounded
    as ``F.silu(gate) * up`` rounds: one C++ call on a CPU (``cpu_native``), torch elsewhere."""
    ops = cpu_native.native_ops(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def lora_apply(y, x, a_stack, b_stack, batch):
    """Add each token's LoRA delta to ``y`` in place (``batch``: a ``models.lora.LoRABatch``)."""
    if use_triton(x):
        from pagoda.kernels import triton_ops

        return triton_ops.lora_apply(y, x, a_stack, b_stack, batch.token_slots)
    return reference.lora_apply(y, x, a_stack, b_stack, batch.groups)


def moe_experts(x, order, weights, offsets, w13, w2, top_k: int, b13=None, b2=None, clamped_swiglu=None,
                block_scales=None, activation: str = "silu"):
    """Each token's routing-weighted sum of its experts (assignments grouped as ``models.moe``
    makes them): the fused kernels of ``triton_moe`` on CUDA, the experts-with-tokens loop
    (``reference_moe``) elsewhere. Neither computes an expert that received no token. gpt-oss:
    expert biases ``b13 [E, 2 * inter]`` / ``b2 [E, hidden]`` and ``clamped_swiglu=(alpha, limit)``.
    DeepSeek-V3's FP8 experts: e4m3 stacks with ``block_scales=(s13, s2, block)``. Gemma 4's:
    ``activation="gelu_tanh"``."""
    if use_triton(x):
        from pagoda.kernels import triton_ops

        return triton_ops.moe_experts(x, order, weights, offsets, w13, w2, top_k, b13, b2, clamped_swiglu,
                                      block_scales, activation)
    return reference_moe.moe_experts(x, order, weights, offsets, w13, w2, top_k, b13, b2, clamped_swiglu,
                                     block_scales, activation)


def w8a16_linear(x, qweight, scale):
    """``x @ (qweight * scale[:, None]).T`` for an int8 or fp8 ``[N, K]`` weight (pagoda.kernels.w8a16).

    CUDA: the Triton W8A16 kernel below ``w8a16.DEQUANT_ROWS`` rows, dequantize + cuBLAS
    from there; elsewhere the torch reference (dequantize + ``F.linear``).
    """
    if use_triton(x) and x.numel() < w8a16.DEQUANT_ROWS * x.shape[-1]:
        from pagoda.kernels import triton_w8a16

        return triton_w8a16.w8a16_linear(x, qweight, scale)
    return w8a16.w8a16_linear_ref(x, qweight, scale)


def fp8_block_linear(x, qweight, scale, block: int):
    """``x @ W.T`` for a block-scaled e4m3 ``[N, K]`` weight, ``W[n, k] = Q[n, k] * scale[n // block,
    k // block]`` (DeepSeek-V3's FP8 checkpoints): the Triton W8A16 kernel with block scales on CUDA
    below ``w8a16.DEQUANT_ROWS`` rows, dequantize + ``F.linear`` otherwise (the CPU path)."""
    if use_triton(x) and x.numel() < w8a16.DEQUANT_ROWS * x.shape[-1]:
        from pagoda.kernels import triton_w8a16

        return triton_w8a16.w8a16_linear(x, qweight, scale, block=block)
    return w8a16.w8a16_block_linear_ref(x, qweight, scale, block)


def causal_conv1d(x, weight, bias, conv_states, meta: AttentionMetadata):
    """Causal depthwise conv1d + SiLU per sequence of the step, continuing and updating each
    sequence's conv state slot (``reference_gdn.causal_conv1d`` has the contract)."""
    if use_triton(x):
        from pagoda.kernels import triton_ops

        return triton_ops.causal_conv1d(x, weight, bias, conv_states, meta)
    return reference_gdn.causal_conv1d(x, weight, bias, conv_states, meta)


def gated_delta_rule(q, k, v, g, beta, ssm_states, meta: AttentionMetadata, chunk_size: int = 64):
    """The gated delta rule per sequence (recurrent for single tokens, chunked for longer
    ones), from and to each sequence's state slot (``reference_gdn`` has the contract)."""
    if use_triton(v):
        from pagoda.kernels import triton_ops

        return triton_ops.gated_delta_rule(q, k, v, g, beta, ssm_states, meta, chunk_size)
    return reference_gdn.gated_delta_rule(q, k, v, g, beta, ssm_states, meta, chunk_size)


def gated_rms_norm(x, gate, weight, eps: float):
    """``rmsnorm(x) * weight * silu(gate)`` over the last dimension (Gated DeltaNet's output norm)."""
    if use_triton(x):
        from pagoda.kernels import triton_ops

        return triton_ops.gated_rms_norm(x, gate, weight, eps)
    return reference_gdn.gated_rms_norm(x, gate, weight, eps)
