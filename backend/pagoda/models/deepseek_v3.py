"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi K2 has the same architecture) on the Llama skeleton.

As transformers' ``DeepseekV3Model``:

- attention: multi-head latent attention (``models/mla.py``): a latent KV cache of
  ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer (``ModelConfig.mla``);
- feed-forward: the first ``first_k_dense_replace`` layers a dense SwiGLU MLP of
  ``intermediate_size`` (``mlp_only_layers``), the others ``DeepseekMoE``: ``n_routed_experts``
  routed experts of ``moe_intermediate_size`` through the fused MoE kernels (``models/moe.py``),
  routed by ``moe.route_grouped`` (sigmoid scores, ``e_score_correction_bias`` to choose,
  ``n_group`` / ``topk_group`` group limit, ``norm_topk_prob``, ``routed_scaling_factor``) from a
  float32 router (transformers keeps ``gate.weight`` and the bias in float32), plus
  ``n_shared_experts`` shared experts as one SwiGLU MLP of ``n_shared_experts *
  moe_intermediate_size`` that every token takes;
- rope: ``rope_interleave`` (default true) and YaRN with DeepSeek's ``mscale`` / ``mscale_all_dim``
  (``models/config.py`` for the frequencies and the cos/sin factor, ``mla.softmax_scale`` for the
  attention-scale correction);
- the MTP block of the checkpoint (``num_nextn_predict_layers``: ``model.layers.{N}.*``) is left to
  the speculative proposer (``engine/spec_decode/mtp.py``), which builds its decoder layer as layer
  ``N`` (``mtp_layer_index``): an MLA layer with a MoE block, as the checkpoint holds it.

GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) is this architecture with its dense layers listed in
``mlp_layer_types`` (``parse_glm_lite_config``).

Refused (``ValueError`` naming the field): DeepSeek-V2's routers (``scoring_func`` other than
sigmoid, ``topk_method`` other than ``noaux_tc``), ``moe_layer_freq`` other than 1,
``attention_bias``, an activation other than SiLU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.models.config import MLAShape, ModelConfig, common_fields
from pagoda.models.llama import ALL, MLP, DecoderLayer, LlamaForCausalLM, WeightTargets
from pagoda.models.mla import MLAttention
from pagoda.models.moe import GroupedRouter, MoENames, SparseMoE, experts_forward, group_by_expert, route_grouped

NAMES = MoENames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """A ``DeepseekV3Config`` (transformers 4 or 5 layout).

    Raises:
        ValueError: a router, layer frequency or bias this family does not implement (named).
    """
    checks = (("scoring_func", raw.get("scoring_func", "sigmoid"), "sigmoid"),
              ("topk_method", raw.get("topk_method", "noaux_tc"), "noaux_tc"),
              ("moe_layer_freq", raw.get("moe_layer_freq", 1), 1),
              ("attention_bias", bool(raw.get("attention_bias", False)), False))
    for name, value, supported in checks:
        if value != supported:
            raise ValueError(f"{architecture}: {name}={value!r} is not supported (only {supported!r}: DeepSeek-V3's)")
    fields = common_fields(raw, architecture)
    mla = MLAShape(q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw["kv_lora_rank"],
                   qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
                   v_head_dim=raw["v_head_dim"], rope_interleave=bool(raw.get("rope_interleave", True)))
    # head_dim is the rotary part (transformers sets it so); no KV heads: one latent per token.
    fields.update(head_dim=mla.qk_rope_head_dim, num_key_value_heads=fields["num_attention_heads"])
    num_experts, top_k = raw.get("n_routed_experts") or 0, raw.get("num_experts_per_tok") or 0
    router = GroupedRouter(raw.get("n_group") or 1, raw.get("topk_group") or 1,
                           float(raw.get("routed_scaling_factor", 1.0)))
    if num_experts:
        router.check(num_experts, top_k)
    moe_inter = raw.get("moe_intermediate_size", 0)
    return ModelConfig(**fields, mla=mla, grouped_router=router if num_experts else None, num_experts=num_experts,
                       num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
                       shared_expert_intermediate_size=moe_inter * (raw.get("n_shared_experts") or 0),
                       norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                       mlp_only_layers=tuple(range(raw.get("first_k_dense_replace") or 0)))


def parse_glm_lite_config(raw: dict, architecture: str) -> ModelConfig:
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's attention and MoE block (as
    transformers 5.24 builds it from both); which layers are dense is ``mlp_layer_types``
    ("dense" / "sparse" per layer; default: the first dense) instead of ``first_k_dense_replace``.

    Raises:
        ValueError: ``mlp_layer_types`` not one of "dense" / "sparse" per layer; as ``parse_config``.
    """
    layers = raw["num_hidden_layers"]
    types = list(raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1))
    if len(types) != layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"{architecture}: mlp_layer_types must give 'dense' or 'sparse' per layer ({layers}), "
                         f"got {types}")
    raw = {k: v for k, v in raw.items() if k != "first_k_dense_replace"}
    return dataclasses.replace(parse_config(raw, architecture),
                               mlp_only_layers=tuple(i for i, t in enumerate(types) if t == "dense"))


class DeepseekMoE(SparseMoE):
    """Routed experts (``SparseMoE``'s stacks and kernels) chosen by the grouped router, plus the
    shared experts. The router's weight and correction bias are float32 whatever the model dtype."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, NAMES, renormalize=config.norm_topk_prob, dtype=dtype, device=device)
        self.router = config.grouped_router
        kw = dict(dtype=torch.float32, device=device)
        self.gate_weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, **kw), requires_grad=False)
        self.correction_bias = nn.Parameter(torch.empty(config.num_experts, **kw), requires_grad=False)
        shared = config.shared_expert_intermediate_size
        self.shared_experts: Optional[MLP] = MLP(dataclasses.replace(config, intermediate_size=shared), dtype,
                                                 device) if shared else None

    def forward(self, x: torch.Tensor, lora: Optional[object] = None) -> torch.Tensor:  # [T, hidden]
        logits = F.linear(x.float(), self.gate_weight)  # [T, E] float32, as transformers' router
        weights, ids = route_grouped(logits, self.correction_bias, self.router, self.top_k, self.renormalize, x.dtype)
        out = experts_forward(x, group_by_expert(ids, weights, self.num_experts), self.w13, self.w2,
                              self.block_scales)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)  # sharded: both partial sums, reduced once below
        return self.tp.all_reduce(out) if self.tp is not None else out

    def weight_targets(self) -> WeightTargets:
        table = {**super().weight_targets(), "mlp.gate.e_score_correction_bias": (self.correction_bias, ALL)}
        if self.shared_experts is not None:
            table |= {"mlp.shared_experts." + name.removeprefix("mlp."): target
                      for name, target in self.shared_experts.weight_targets().items()}
        return table


class DeepseekV3DecoderLayer(DecoderLayer):
    attention_class = MLAttention

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return DeepseekMoE(config, dtype, device)
        return MLP(config, dtype, device)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """The decoder; ``forward`` is Llama's (every layer takes a ``LatentCache``)."""

    layer_class = DeepseekV3DecoderLayer

    def mtp_layer_index(self) -> int:
        """The MTP block's layer is checkpoint layer ``N`` (a MoE layer past the dense ones)."""
        return self.config.num_hidden_layers
