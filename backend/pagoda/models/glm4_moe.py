"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``Glm4MoeForCausalLM``) on the Llama skeleton.

As transformers' ``Glm4MoeModel`` (and vLLM's / SGLang's ``glm4_moe``):

- attention: grouped-query attention with a bias on q/k/v (``attention_bias``; never on
  ``o_proj``), with ``use_qk_norm`` a per-head RMSNorm of q and k before the rotary embedding
  (Qwen3's), and rotary on the first ``partial_rotary_factor`` (0.5 by default) of each head,
  halves style (transformers' ``rotate_half`` on the rotated part; the rest passes through);
  ``head_dim`` its own field. The cache is ordinary K/V (``FullAttentionSpec``);
- feed-forward: the first ``first_k_dense_replace`` layers a dense SwiGLU MLP, the others
  DeepSeek-V3's MoE block unchanged (``deepseek_v3.DeepseekMoE``: float32 router, sigmoid scores,
  ``e_score_correction_bias`` to choose, ``n_group`` / ``topk_group`` group limit,
  ``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts`` shared experts as one MLP),
  with the same checkpoint names (``mlp.gate.*``, ``mlp.experts.<e>.*``, ``mlp.shared_experts.*``);
- MTP: the checkpoint's ``num_nextn_predict_layers`` block (``model.layers.{N}.*``, DeepSeek's
  layout) drafts through ``speculative_method="mtp"``; its decoder layer is built as layer ``N``
  (``mtp_layer_index``: GLM attention with a MoE block).

Refused (``ValueError`` naming the field): a rope type other than ``default`` (GLM-4.5's; the
others are not checked against transformers for this family), an activation other than SiLU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagoda import kernels
from pagoda.models.config import ModelConfig, common_fields
from pagoda.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from pagoda.models.llama import ALL, Attention, WeightTargets, rotate_partial
from pagoda.models.moe import GroupedRouter


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """A ``Glm4MoeConfig`` (transformers 4 layout: ``partial_rotary_factor`` and ``rope_theta`` at
    top level; transformers 5: both in ``rope_parameters``).

    Raises:
        ValueError: a rope type other than ``default``, a router that cannot route (named).
    """
    raw, partial = _without_partial_rotary(raw)
    fields = common_fields(raw, architecture)
    if fields["rope_scaling"] is not None:
        raise ValueError(f"{architecture}: rope scaling {fields['rope_scaling']} is not supported (only the default "
                         "rope type, GLM-4.5's)")
    num_experts, top_k = raw.get("n_routed_experts") or 0, raw.get("num_experts_per_tok") or 0
    router = GroupedRouter(raw.get("n_group") or 1, raw.get("topk_group") or 1,
                           float(raw.get("routed_scaling_factor", 1.0)))
    if num_experts:
        router.check(num_experts, top_k)
    moe_inter = raw.get("moe_intermediate_size", 0)
    return ModelConfig(**fields, attention_bias=bool(raw.get("attention_bias", False)), o_proj_bias=False,
                       qk_norm=bool(raw.get("use_qk_norm", False)), partial_rotary_factor=partial,
                       grouped_router=router if num_experts else None, num_experts=num_experts,
                       num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
                       shared_expert_intermediate_size=moe_inter * (raw.get("n_shared_experts") or 0),
                       norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                       mlp_only_layers=tuple(range(raw.get("first_k_dense_replace") or 0)))


def _without_partial_rotary(raw: dict) -> tuple[dict, float]:
    """``raw`` with ``partial_rotary_factor`` taken out of the rope parameters (else the top level,
    else transformers' default for this family, 0.5), and that factor."""
    raw = dict(raw)
    partial = raw.pop("partial_rotary_factor", None)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(raw.get(key), dict):
            params = dict(raw[key])
            partial = params.pop("partial_rotary_factor", partial)
            raw[key] = params
    return raw, float(0.5 if partial is None else partial)


class Glm4MoeAttention(Attention):
    """Llama's attention with an optional per-head q/k RMSNorm and partial rotary."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__(config, dtype, device, window)
        self.rotary_dim, self.eps = config.rotary_dim, config.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.q_norm: Optional[nn.Parameter] = None
        self.k_norm: Optional[nn.Parameter] = None
        if config.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(self.head_dim, **kw), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(self.head_dim, **kw), requires_grad=False)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head norms (when the config has them), then rotary on the first ``rotary_dim``."""
        if self.q_norm is not None:
            q = kernels.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps)[0].view(q.shape)
            k = kernels.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps)[0].view(k.shape)
        return rotate_partial(q, k, positions, cos_sin_cache, self.rotary_dim)

    def weight_targets(self) -> WeightTargets:
        table = super().weight_targets()
        if self.q_norm is not None:
            table |= {"self_attn.q_norm.weight": (self.q_norm, ALL), "self_attn.k_norm.weight": (self.k_norm, ALL)}
        return table


class Glm4MoeDecoderLayer(DeepseekV3DecoderLayer):
    """DeepSeek-V3's layer (dense MLP for the first layers, then ``DeepseekMoE``) with GLM's
    attention (full K/V, partial rotary, optional qk norm) instead of latent attention."""

    attention_class = Glm4MoeAttention


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """The decoder; ``forward`` is Llama's, the MTP block's layer is DeepSeek's (layer ``N``)."""

    layer_class = Glm4MoeDecoderLayer
