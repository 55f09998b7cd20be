"""Mixtral: the Llama decoder (Mistral attention) with a sparse MoE block in every layer.

As transformers' ``MixtralSparseMoeBlock``: ``num_local_experts`` experts of
``intermediate_size`` each, ``num_experts_per_tok`` (2) per token, the top-k softmax
weights always renormalised to sum to one. Checkpoint names:
``model.layers.<i>.block_sparse_moe.gate.weight`` (the router) and
``...block_sparse_moe.experts.<e>.w1|w3|w2.weight`` (gate, up, down), stacked into
``SparseMoE`` (``models/moe.py``). A declared ``sliding_window`` applies in every layer, as for
Mistral (``kernels.paged_attention(window=...)``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.models.config import ModelConfig, common_fields
from pagoda.models.llama import DecoderLayer, LlamaForCausalLM
from pagoda.models.moe import MoENames, SparseMoE

NAMES = MoENames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    return ModelConfig(**common_fields(raw, architecture), num_experts=raw["num_local_experts"],
                       num_experts_per_tok=raw["num_experts_per_tok"],
                       moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True)


class MixtralDecoderLayer(DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
        return SparseMoE(config, NAMES, renormalize=True, dtype=dtype, device=device)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MixtralDecoderLayer
