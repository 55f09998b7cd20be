"""OpenAI-Triton kernels behind the dispatch point, with the references' signatures.

Importing this module raises ImportError when triton is not installed, which is how
``pagoda.kernels`` falls back to the torch references. Each kernel lives in its own
``triton_*.py`` module with its design in the docstring; docs/kernels.md has the overview.
"""

from __future__ import annotations

import triton  # noqa: F401  (ImportError here selects the torch references)

from pagoda.kernels import triton_attention
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.triton_conv1d import causal_conv1d
from pagoda.kernels.triton_gdn import gated_delta_rule
from pagoda.kernels.triton_kv_write import write_kv
from pagoda.kernels.triton_lora import lora_apply
from pagoda.kernels.triton_moe import moe_experts
from pagoda.kernels.triton_norm import gated_rms_norm, rms_norm
from pagoda.kernels.triton_rotary import apply_rotary

__all__ = ["paged_attention", "write_kv", "rms_norm", "apply_rotary", "moe_experts", "causal_conv1d",
           "gated_delta_rule", "gated_rms_norm"]


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, window: int = 0, sinks=None):
    """Paged causal GQA attention for one step (launch shapes chosen per step); ``window``: sliding
    window; ``sinks``: per-head softmax sinks."""
    return triton_attention.paged_attention(q, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale,
                                            window=window, sinks=sinks)
