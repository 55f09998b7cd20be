"""gpt-oss (``GptOssForCausalLM``): the Llama skeleton with attention sinks, YaRN and biased MoE experts.

Differences from Llama, as in transformers' ``modeling_gpt_oss`` (and vLLM's ``gpt_oss``):

- ``layer_types`` alternates "sliding_attention" (``sliding_window`` tokens, 128 in the
  released models) and "full_attention" layers (transformers' default when the config
  omits it: even layers slide);
- attention: bias on q/k/v/o (``attention_bias``, default true), and one learned sink
  logit per query head (``self_attn.sinks``) in every softmax denominator
  (``kernels.paged_attention(sinks=...)``; kept in float32 whatever the model dtype);
- rope ``yarn`` (``ModelConfig.inv_freq`` / ``rope_attention_factor``); a config without
  any rope field gets transformers' defaults (base 150000, YaRN factor 32 over 4096);
- every layer is a MoE block: router ``logits = x W^T + b``, top-k of the *logits*, then a
  softmax over those k values (in the logits' dtype), never renormalised further;
  experts ``down(act(x W13^T + b13)) + b2`` with the clamped SwiGLU
  ``(clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``
  (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0), via ``kernels.moe_experts`` (only the
  experts with tokens; the fused Triton kernels on CUDA);
- checkpoint layout: ``mlp.experts.gate_up_proj [E, hidden, 2 * inter]`` with gate and up
  *interleaved* (columns 2i and 2i + 1) and ``down_proj [E, inter, hidden]``, with their
  biases; ``load_weights`` transposes and de-interleaves them into the stacked
  ``w13 [E, 2 * inter, hidden]`` (gate rows, then up rows) and ``w2 [E, hidden, inter]``.
  MXFP4 checkpoints (``*_blocks`` / ``*_scales``) are dequantized by the loader first
  (``models/mxfp4.py``).

LoRA on the experts or the router is refused (``models/lora``); int8/fp8 quantization of
the experts is refused (``quantization_unsupported``).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.models.config import ModelConfig, common_fields
from pagoda.models.llama import ALL, Attention, DecoderLayer, LlamaForCausalLM, WeightTargets
from pagoda.models.moe import group_by_expert

DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}  # transformers' GptOssConfig


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """gpt-oss config (transformers' ``GptOssConfig`` defaults where a field is absent).

    Raises:
        ValueError: ``num_local_experts`` missing, or what ``common_fields`` refuses.
    """
    if "num_local_experts" not in raw:
        raise ValueError("gpt-oss config.json is missing num_local_experts")
    if not any(raw.get(k) for k in ("rope_parameters", "rope_scaling", "rope_theta")):
        raw = {**raw, "rope_parameters": DEFAULT_ROPE}
    fields = common_fields(raw, architecture)
    if fields["layer_types"] is None:
        fields["layer_types"] = tuple("sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(fields["num_hidden_layers"]))
    bias = bool(raw.get("attention_bias", True))
    return ModelConfig(**fields, attention_bias=bias, o_proj_bias=bias, num_experts=raw["num_local_experts"],
                       num_experts_per_tok=raw.get("num_experts_per_tok", raw.get("experts_per_token", 4)),
                       moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True, attention_sinks=True,
                       clamped_swiglu=(float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0))))


class GptOssAttention(Attention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__(config, dtype, device, window)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device), requires_grad=False)

    def weight_targets(self) -> WeightTargets:
        return {**super().weight_targets(), "self_attn.sinks": (self.sinks, ALL)}


class GptOssMoE(nn.Module):
    """Router (with bias) plus stacked experts (with biases); ``forward(x)`` -> ``[T, hidden]``."""

    quantization_unsupported = "MoE expert weights cannot be quantized yet (int8/fp8 experts are not implemented)"

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.clamped_swiglu = config.clamped_swiglu
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router_weight, self.router_bias = param(experts, hidden), param(experts)
        self.w13, self.b13 = param(experts, 2 * inter, hidden), param(experts, 2 * inter)
        self.w2, self.b2 = param(experts, hidden, inter), param(experts, hidden)

    def forward(self, x: torch.Tensor, lora: Optional[object] = None) -> torch.Tensor:
        """``lora`` is accepted for the layer's signature; adapters never target experts (refused at load)."""
        logits = F.linear(x, self.router_weight, self.router_bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        groups = group_by_expert(ids, weights, self.num_experts)
        return kernels.moe_experts(x, groups.order, groups.weights, groups.offsets, self.w13, self.w2, self.top_k,
                                   self.b13, self.b2, self.clamped_swiglu)

    def weight_targets(self) -> WeightTargets:
        return {"mlp.router.weight": (self.router_weight, ALL), "mlp.router.bias": (self.router_bias, ALL),
                "mlp.experts.gate_up_proj": (self.w13, ALL), "mlp.experts.gate_up_proj_bias": (self.b13, ALL),
                "mlp.experts.down_proj": (self.w2, ALL), "mlp.experts.down_proj_bias": (self.b2, ALL)}


class GptOssDecoderLayer(DecoderLayer):
    attention_class = GptOssAttention

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
        return GptOssMoE(config, dtype, device)


class GptOssForCausalLM(LlamaForCausalLM):
    layer_class = GptOssDecoderLayer

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Llama's, with the experts' checkpoint layout turned into the stacked one."""
        return super().load_weights(_stacked_experts(weights))


def _stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``gate_up_proj [E, hidden, 2I]`` (interleaved) -> ``[E, 2I, hidden]`` (gate rows, then up
    rows), its bias likewise; ``down_proj [E, I, hidden]`` -> ``[E, hidden, I]``."""
    for name, tensor in weights:
        if name.endswith("mlp.experts.gate_up_proj"):
            tensor = tensor.transpose(1, 2)
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            tensor = tensor.transpose(1, 2)
        yield name, tensor
