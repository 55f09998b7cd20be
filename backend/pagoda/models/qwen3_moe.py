"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm) with sparse MoE blocks.

As transformers' ``Qwen3MoeDecoderLayer``: layer ``i`` is sparse when it is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (``ModelConfig.is_moe_layer``);
other layers keep a dense MLP of ``intermediate_size``. A sparse block routes each token
to ``num_experts_per_tok`` of ``num_experts`` experts of ``moe_intermediate_size``, the
top-k softmax weights renormalised only with ``norm_topk_prob`` (transformers' default is
false; the released models set it true). Checkpoint names: ``model.layers.<i>.mlp.gate.weight``
and ``...mlp.experts.<e>.gate_proj|up_proj|down_proj.weight``, stacked into ``SparseMoE``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagoda.models.config import ModelConfig
from pagoda.models.llama import MLP
from pagoda.models.moe import MoENames, SparseMoE
from pagoda.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from pagoda.models.qwen3 import parse_config as parse_qwen3_config

NAMES = MoENames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    dense = parse_qwen3_config(raw, architecture)
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 0))
    return dataclasses.replace(dense, num_experts=num_experts,
                               num_experts_per_tok=raw.get("num_experts_per_tok", 0),
                               moe_intermediate_size=raw.get("moe_intermediate_size", 0),
                               norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                               decoder_sparse_step=raw.get("decoder_sparse_step", 1),
                               mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return SparseMoE(config, NAMES, renormalize=config.norm_topk_prob, dtype=dtype, device=device)
        return MLP(config, dtype, device)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
