"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on q and k before rotary.

Differences from Llama, as in transformers' ``Qwen3Attention``: ``q_norm`` and ``k_norm``
(``[head_dim]`` weights, ``rms_norm_eps``) normalise each head's query and key vector
before the rotary embedding; ``head_dim`` is its own config field, independent of
``hidden_size / num_attention_heads``; ``attention_bias`` (false in every released model)
puts a bias on q/k/v and o_proj as in Llama; the sliding window only counts with
``use_sliding_window`` (as Qwen2: ``config.qwen_sliding_window``). ``Qwen3Attention`` is reused by ``qwen3_moe``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda import kernels
from pagoda.models.config import ModelConfig, common_fields, qwen_sliding_window
from pagoda.models.llama import ALL, Attention, DecoderLayer, LlamaForCausalLM, WeightTargets


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    fields = {**common_fields(raw, architecture), **qwen_sliding_window(raw)}
    return ModelConfig(**fields, attention_bias=bias, o_proj_bias=bias)


class Qwen3Attention(Attention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__(config, dtype, device, window)
        self.eps = config.rms_norm_eps
        self.q_norm = nn.Parameter(torch.empty(self.head_dim, dtype=dtype, device=device), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(self.head_dim, dtype=dtype, device=device), requires_grad=False)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self._head_norm(q, self.q_norm)
        k = self._head_norm(k, self.k_norm)
        return kernels.apply_rotary(q, k, positions, cos_sin_cache)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's vector: [num_tokens, heads, head_dim] -> same shape."""
        normed, _ = kernels.rms_norm(x.reshape(-1, self.head_dim), weight, self.eps)
        return normed.view(x.shape)

    def weight_targets(self) -> WeightTargets:
        return {**super().weight_targets(),
                "self_attn.q_norm.weight": (self.q_norm, ALL), "self_attn.k_norm.weight": (self.k_norm, ALL)}


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
