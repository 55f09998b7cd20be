"""Rotary embedding frequency scalings that checkpoints name in ``rope_scaling``.

``ModelConfig.inv_freq`` starts from ``theta ** (-2i / dim)`` and applies the named scaling:
``llama3`` (Llama 3.1: low frequencies slowed by ``factor``, high ones kept, a linear blend
between two wavelengths) or ``yarn`` (low frequencies interpolated, high ones extrapolated,
a ramp between the correction dimensions of ``beta_fast`` / ``beta_slow`` rotations, and an
attention scale ``yarn_mscale``). Each follows transformers' rope initialisers, whose
results the model tests compare bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched by ``scale`` (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, base: float, factor: float,
                   scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) the low frequencies, keep the high ones, blend
    linearly between the correction dimensions of ``beta_fast`` / ``beta_slow`` rotations."""
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down low frequencies, keep high, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
