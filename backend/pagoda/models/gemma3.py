"""Gemma 3 (text, ``Gemma3ForCausalLM``): the Llama skeleton with Gemma's norms, scale, MLP and two rope tables.

Differences from Llama, as in transformers' ``Gemma3TextModel`` (and vLLM's ``gemma3``):

- every RMSNorm multiplies by ``1 + weight``: the checkpoint's norm weights (the four per
  layer, q/k norms, the final norm) get 1 added at load, so the shared ``rms_norm`` kernel
  applies them unchanged (exact in float32; in bf16/fp16 ``1 + w`` is rounded once to the
  model dtype, where transformers keeps it in float32);
- the embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype; the
  tied LM head uses the unscaled table;
- four norms per layer: ``post_attention_layernorm`` and ``post_feedforward_layernorm``
  norm the attention / MLP outputs before their residual adds, ``pre_feedforward_layernorm``
  is the MLP's input norm (fused with the residual add, as the next layer's input norm is);
- q/k per-head norms before rotary (``Qwen3Attention``), softmax scale
  ``query_pre_attn_scalar ** -0.5``;
- GELU-tanh MLP (``hidden_activation`` must be ``gelu_pytorch_tanh``);
- ``layer_types``: "sliding_attention" layers attend within ``sliding_window`` and rotate
  with the local rope base (``rope_parameters["sliding_attention"]``, transformers 4:
  ``rope_local_base_freq``), "full_attention" layers attend to everything with the global
  one (which may carry ``linear`` scaling); transformers 4 configs without ``layer_types``
  get them from ``sliding_window_pattern`` (every 6th layer global);
- ``final_logit_softcapping`` (None in Gemma 3) caps the logits; ``attn_logit_softcapping``
  and bidirectional attention are refused (the attention kernels have neither);
- the head is tied unless ``tie_word_embeddings`` says false (transformers' default).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import ModelConfig, common_fields, read_rope, rope_by_layer_type
from pagoda.models.llama import ALL, MLP, DecoderLayer, KVCache, LlamaForCausalLM, WeightTargets, make_cos_sin_cache
from pagoda.models.llama import projection
from pagoda.models.qwen3 import Qwen3Attention

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

ACTIVATION = "gelu_pytorch_tanh"


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Gemma 3 text config (transformers 4 or 5 layout).

    Raises:
        ValueError: another activation, attention soft-capping, bidirectional attention, or
            rope scaling on the sliding layers.
    """
    act = raw.get("hidden_activation") or raw.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:
        raise ValueError(f"Gemma 3 hidden_activation {act!r} is not supported; only {ACTIVATION!r}")
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (the attention kernels do not cap scores)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
    fields = common_fields({k: v for k, v in raw.items() if k != "hidden_act"}, architecture)
    fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))  # transformers' Gemma 3 default
    if rope_by_layer_type(raw):
        local_theta, local_scaling = read_rope(raw, "sliding_attention")
    else:
        local_theta, local_scaling = float(raw.get("rope_local_base_freq", 10000.0)), None
    if local_scaling is not None:
        raise ValueError(f"rope scaling on sliding_attention layers is not supported: {local_scaling}")
    if fields["layer_types"] is None:
        pattern = raw.get("sliding_window_pattern", 6)
        fields["layer_types"] = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(fields["num_hidden_layers"]))
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**fields, attention_bias=bias, o_proj_bias=bias, local_rope_theta=local_theta,
                       query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                       final_logit_softcapping=raw.get("final_logit_softcapping"))


class Gemma3Attention(Qwen3Attention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__(config, dtype, device, window)
        self.scale = config.query_pre_attn_scalar**-0.5


class GeluTanhMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor, lora: Optional["LoRABatch"] = None) -> torch.Tensor:
        gate, up = projection(self, "gate_up_weight", x, None, lora).split(self.intermediate_size, dim=-1)
        return projection(self, "down_weight", F.gelu(gate, approximate="tanh") * up, None, lora)


class Gemma3DecoderLayer(DecoderLayer):
    attention_class = Gemma3Attention

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, layer_idx, dtype, device)
        self.is_local = config.layer_types[layer_idx] == "sliding_attention"
        kw = dict(dtype=dtype, device=device)
        self.pre_feedforward_norm = nn.Parameter(torch.empty(config.hidden_size, **kw), requires_grad=False)
        self.post_feedforward_norm = nn.Parameter(torch.empty(config.hidden_size, **kw), requires_grad=False)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
        return GeluTanhMLP(config, dtype, device)

    def weight_targets(self) -> WeightTargets:
        return {**super().weight_targets(),
                "pre_feedforward_layernorm.weight": (self.pre_feedforward_norm, ALL),
                "post_feedforward_layernorm.weight": (self.post_feedforward_norm, ALL)}

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                lora: Optional["LoRABatch"] = None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_normed(x, residual)
        h = self.attn(h, positions, cos_sin_cache, kv_cache, meta, lora)
        h, _ = kernels.rms_norm(h, self.post_attention_norm, self.eps)
        h, residual = kernels.rms_norm(h, self.pre_feedforward_norm, self.eps, residual)
        h, _ = kernels.rms_norm(self.mlp(h, lora), self.post_feedforward_norm, self.eps)
        return h, residual  # the next input norm (or the final norm) adds them


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(config, dtype, device)
        local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        self.register_buffer("local_cos_sin_cache", make_cos_sin_cache(local, self.device), persistent=False)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5).to(device=self.device, dtype=dtype),
                             persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: Optional["LoRABatch"] = None) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), f"need {len(self.layers)} KV caches, got {len(kv_caches)}"
        return self.run_layers(F.embedding(input_ids, self.embed_tokens) * self.embed_scale, positions, kv_caches,
                               meta, lora)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata,
                   lora: Optional["LoRABatch"] = None) -> torch.Tensor:
        """The decoder over input embeddings ``h`` ``[num_tokens, hidden]``, final norm included."""
        residual = None
        for idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            table = self.local_cos_sin_cache if layer.is_local else self.cos_sin_cache
            h, residual = layer(h, residual, positions, table, kv_cache, meta.for_layer(idx), lora)
        h, _ = kernels.rms_norm(h, self.norm, self.config.rms_norm_eps, residual)
        return h

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Llama's, then 1 added to every norm weight loaded (Gemma norms scale by ``1 + w``)."""
        loaded = super().load_weights(weights)
        table = self._weight_table()
        for name in loaded:
            if name.endswith("norm.weight"):
                target, rows = table[name]
                target[rows] += 1
        return loaded
