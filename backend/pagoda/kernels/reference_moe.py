"""The torch path of the mixture-of-experts layers (CPU, and the ground truth of ``triton_moe``).

``moe_experts`` runs only the experts that received tokens (the assignments grouped by
``models.moe.group_by_expert``; their offsets read back once per call, which is why CUDA takes
the fused kernels instead) and adds each expert's weighted rows into the output in expert
order, as transformers does. ``moe_activation`` is the one definition of the experts'
activations: SwiGLU, Gemma 4's GELU-tanh GLU, gpt-oss's clamped SwiGLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.w8a16 import dequantize_blocks

ACTIVATIONS = ("silu", "gelu_tanh")


def moe_experts(
    x: torch.Tensor,  # [T, hidden]
    order: torch.Tensor,  # [T * k] int64: assignment ids (t * k + j) sorted by expert
    weights: torch.Tensor,  # [T * k]: their routing weights, same order
    offsets: torch.Tensor,  # [E + 1] int64: expert e's assignments are order[offsets[e]:offsets[e + 1]]
    w13: torch.Tensor,  # [E, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [E, hidden, inter]
    top_k: int,
    b13: torch.Tensor | None = None,  # [E, 2 * inter]: gate/up biases (gpt-oss)
    b2: torch.Tensor | None = None,  # [E, hidden]: down biases
    clamped_swiglu: tuple[float, float] | None = None,  # (alpha, limit): gpt-oss's activation
    block_scales: tuple[torch.Tensor, torch.Tensor, int] | None = None,  # e4m3 stacks' (s13, s2, block)
    activation: str = "silu",  # or "gelu_tanh" (Gemma 4's experts)
) -> torch.Tensor:  # [T, hidden]
    """Each token's routing-weighted sum of its experts' ``down(act(gate(x), up(x)))``.

    ``act`` is ``silu(g) * u`` (``gelu_tanh(g) * u`` with ``activation="gelu_tanh"``), or with
    ``clamped_swiglu`` gpt-oss's (``moe_activation``).
    Computes only the experts that received tokens (the offsets are read back once), and
    adds each expert's rows into the output in expert order, as transformers does. FP8
    experts (``block_scales``): each expert's weights dequantized to ``x.dtype`` when used.
    """
    out = torch.zeros_like(x)
    bounds = offsets.tolist()
    inter = w2.shape[2]
    for expert in range(len(bounds) - 1):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        rows = order[start:end] // top_k
        w_up, w_down = w13[expert], w2[expert]
        if block_scales is not None:
            s13, s2, block = block_scales
            w_up = dequantize_blocks(w_up, s13[expert], block, x.dtype)
            w_down = dequantize_blocks(w_down, s2[expert], block, x.dtype)
        gate, up = F.linear(x[rows], w_up, None if b13 is None else b13[expert]).split(inter, dim=-1)
        h = moe_activation(gate, up, clamped_swiglu, activation)
        y = F.linear(h, w_down, None if b2 is None else b2[expert]) * weights[start:end, None]
        # index_put_ rather than index_add_: the same sums (an expert's rows are distinct
        # tokens); on a 2-core CPU busy with other jobs index_add_ (an OpenMP parallel
        # region) took ~30 ms per call where index_put_ took microseconds (torch 2.13);
        # unloaded, both take microseconds.
        out.index_put_((rows,), y, accumulate=True)
    return out


def moe_activation(gate: torch.Tensor, up: torch.Tensor, clamped_swiglu: tuple[float, float] | None,
                   activation: str = "silu") -> torch.Tensor:
    """``silu(gate) * up`` (``gelu_tanh(gate) * up`` with ``activation="gelu_tanh"``: Gemma 4's
    experts, torch's ``gelu(approximate="tanh")``); with ``(alpha, limit)`` gpt-oss's clamped
    SwiGLU (transformers' ``GptOssExperts._apply_gate``): ``g = min(gate, limit)``,
    ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, got {activation!r}")
    if clamped_swiglu is None:
        return (F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)) * up
    alpha, limit = clamped_swiglu
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
