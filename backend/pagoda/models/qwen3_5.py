"""Qwen3.5 (``Qwen3_5ForCausalLM``, dense) and Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``): text models.

Both are Qwen3-Next's hybrid decoder (``models/qwen3_next.py``: Gated DeltaNet and gated
attention by ``layer_types``, zero-centred norms, partial rotary), with two differences, as in
transformers 5's ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``:

- the DeltaNet's projections are four checkpoint tensors in canonical order
  (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; ``layout="split"``), not
  Qwen3-Next's per-key-head interleaved ``in_proj_qkvz`` / ``in_proj_ba``;
- Qwen3.5 has a dense SwiGLU MLP in every layer (no MoE fields); Qwen3.5-MoE a sparse block
  with a shared expert in every layer, its router always renormalising the top-k weights
  (its config has no ``norm_topk_prob``, ``decoder_sparse_step`` or ``mlp_only_layers``).

Text positions only: the M-RoPE keys of the config are dropped (``qwen3_next`` says why).
With images: ``models/qwen3_5_vl.py`` (``Qwen3_5ForConditionalGeneration``).
"""

from __future__ import annotations

from pagoda.models.config import ModelConfig
from pagoda.models.qwen3_next import HybridDecoderLayer, Qwen3NextForCausalLM
from pagoda.models.qwen3_next import parse_config as parse_hybrid_config


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Qwen3.5 (dense): Qwen3-Next's fields without experts."""
    return parse_hybrid_config({k: v for k, v in raw.items() if k != "num_experts"}, architecture)


def parse_moe_config(raw: dict, architecture: str) -> ModelConfig:
    """Qwen3.5-MoE: every layer sparse, top-k always renormalised (no dense MLP: ``intermediate_size`` 0)."""
    fields = {k: v for k, v in raw.items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
    fields["intermediate_size"] = 0
    if not fields.get("num_experts"):
        raise ValueError(f"{architecture}: num_experts must be > 0")
    return parse_hybrid_config(fields, architecture, always_renormalize=True)


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    linear_layout = "split"


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    layer_class = Qwen3_5DecoderLayer


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    layer_class = Qwen3_5DecoderLayer
