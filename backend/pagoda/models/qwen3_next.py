"""Qwen3-Next (``Qwen3NextForCausalLM``): the hybrid decoder Qwen3.5 shares (``models/qwen3_5.py``).

As transformers 5's ``Qwen3NextModel``, on the Llama skeleton:

- ``layer_types``: each layer's token mixer is a Gated DeltaNet ("linear_attention",
  ``models/gated_deltanet.py``: a recurrent state per sequence, no KV cache) or gated full
  attention ("full_attention"); absent from the config, every ``full_attention_interval``-th
  (4th) layer is full attention, as transformers derives it;
- gated attention (``GatedAttention``): ``q_proj`` emits ``2 * head_dim`` per head (the query,
  then a gate), the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``;
  q/k per-head RMSNorm before rotary; rotary on the first ``partial_rotary_factor`` of each
  head only (default 0.25, transformers' default for these configs);
- every RMSNorm but the DeltaNet's gated one scales by ``1 + weight`` (zero-centred weights):
  1 is added to those weights at load, so the shared ``rms_norm`` kernel applies them
  (exact in float32; in 16 bits ``1 + w`` is rounded once, where transformers keeps float32);
- the feed-forward block (``make_mlp``): layers ``is_moe_layer`` selects (``decoder_sparse_step``,
  ``mlp_only_layers``) carry a sparse MoE with a shared expert (``SharedExpertMoE``: routed
  experts, top-k renormalised with ``norm_topk_prob``, plus ``sigmoid(x @ shared_expert_gate^T)
  * shared_expert(x)``); the others a dense SwiGLU MLP of ``intermediate_size``.

Rope: ``rope_parameters`` with ``partial_rotary_factor`` (read here into the config's field)
and, in Qwen3.5 configs, ``mrope_section`` / ``mrope_interleaved``: for text the three multimodal
position streams are the same position, so M-RoPE is the ordinary rotary embedding and those keys
are dropped here (the image path, ``models/vision_language.py``, reads them itself). Other rope
types than ``default`` are refused (transformers' tiny configs and the released models use it; the
scaled variants are untested here).

Refused (``ValueError`` naming why): LoRA adapters (``models.lora``), a pipeline stage or a
tensor-parallel MoE (``models.pipeline_parallel`` / ``models.tensor_parallel``), a checkpoint's
packed 4-bit/FP8 Qwen3-Next ``in_proj_qkvz`` (served dequantized instead: its rows are reordered
at load). MTP tensors (``mtp.*``) are left to the MTP proposer. Multimodal Qwen3.5 folders
(``Qwen3_5ForConditionalGeneration``, ``model.language_model.*`` names) are ``models/qwen3_5_vl.py``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import LinearAttentionShape, ModelConfig, common_fields
from pagoda.models.gated_deltanet import GatedDeltaNet
from pagoda.models.llama import (ALL, MLP, DecoderLayer, KVCache, LlamaForCausalLM, WeightTargets, projection,
                                 rotate_partial)
from pagoda.models.moe import MoENames, SparseMoE
from pagoda.models.qwen3 import Qwen3Attention

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

LAYER_TYPES = ("linear_attention", "full_attention")
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
NAMES = MoENames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
# Norms that scale by 1 + weight (the DeltaNet's gated norm, "linear_attn.norm.weight", does not).
ZERO_CENTRED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                      "self_attn.k_norm.weight")


def parse_config(raw: dict, architecture: str, always_renormalize: bool = False) -> ModelConfig:
    """A Qwen3-Next / Qwen3.5 text config (transformers 4 or 5 layout).

    Args:
        always_renormalize: Qwen3.5-MoE's router renormalises its top-k whatever ``norm_topk_prob`` says.
    Raises:
        ValueError: an unknown layer type, a rope type other than ``default``, or a bad shape.
    """
    raw, partial = _without_text_rope_extras(raw)
    fields = common_fields(raw, architecture)
    if fields["rope_scaling"] is not None:
        raise ValueError(f"rope scaling {fields['rope_scaling']} is not supported for {architecture} "
                         "(only the default rope type)")
    fields["head_dim"] = raw.get("head_dim") or 256  # transformers' default for these configs
    layers = fields["num_hidden_layers"]
    types = fields["layer_types"]
    if types is None:
        interval = raw.get("full_attention_interval", 4)
        types = tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers))
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != layers:
        raise ValueError(f"layer_types must give one of {LAYER_TYPES} per layer ({layers}); got {list(types)}")
    fields["layer_types"] = types
    shape = LinearAttentionShape(num_key_heads=raw.get("linear_num_key_heads", 16),
                                 num_value_heads=raw.get("linear_num_value_heads", 32),
                                 key_head_dim=raw.get("linear_key_head_dim", 128),
                                 value_head_dim=raw.get("linear_value_head_dim", 128),
                                 conv_kernel_size=raw.get("linear_conv_kernel_dim", 4))
    bias = bool(raw.get("attention_bias", False))
    num_experts = raw.get("num_experts", 0) or 0
    return ModelConfig(**fields, attention_bias=bias, o_proj_bias=bias, linear_attention=shape,
                       attention_output_gate=True, partial_rotary_factor=partial,
                       num_experts=num_experts, num_experts_per_tok=raw.get("num_experts_per_tok", 0),
                       moe_intermediate_size=raw.get("moe_intermediate_size", 0),
                       shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
                       norm_topk_prob=always_renormalize or bool(raw.get("norm_topk_prob", True)),
                       decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
                       mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))


def _without_text_rope_extras(raw: dict) -> tuple[dict, float]:
    """``raw`` without the rope keys pagoda reads elsewhere or ignores for text (module
    docstring), and the partial rotary factor (rope parameters, else top level, else 0.25)."""
    raw = dict(raw)
    partial = raw.pop("partial_rotary_factor", None)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(raw.get(key), dict):
            params = dict(raw[key])
            partial = params.pop("partial_rotary_factor", partial)
            for extra in _MROPE_KEYS:
                params.pop(extra, None)
            raw[key] = params
    return raw, float(0.25 if partial is None else partial)


class GatedAttention(Qwen3Attention):
    """Full attention with an output gate and partial rotary (module docstring).

    ``qkv_weight`` rows: ``q_proj``'s (per head: query rows, then gate rows), then k, then v."""

    query_rows_per_head = 2

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__(config, dtype, device, window)
        self.rotary_dim = config.rotary_dim
        kw = dict(dtype=dtype, device=device)
        rows = 2 * self.q_size + 2 * self.kv_size
        self.qkv_weight = nn.Parameter(torch.empty(rows, config.hidden_size, **kw), requires_grad=False)
        if self.qkv_bias is not None:
            self.qkv_bias = nn.Parameter(torch.empty(rows, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, lora: Optional["LoRABatch"] = None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = projection(self, "qkv_weight", x, self.qkv_bias, lora)
        query_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate[..., :self.head_dim], query_gate[..., self.head_dim:]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotate(q, k, positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = (self.k_scale, self.v_scale) if k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale, window=self.window)
        out = out.reshape(num_tokens, self.q_size) * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        out = projection(self, "o_weight", out, self.o_bias, lora)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k head norms, then rotary on the first ``rotary_dim`` dimensions of each head."""
        q, k = self._head_norm(q, self.q_norm), self._head_norm(k, self.k_norm)
        return rotate_partial(q, k, positions, cos_sin_cache, self.rotary_dim)

    def weight_targets(self) -> WeightTargets:
        q_rows, kv = 2 * self.q_size, self.kv_size
        table = {**super().weight_targets(),
                 "self_attn.q_proj.weight": (self.qkv_weight, slice(0, q_rows)),
                 "self_attn.k_proj.weight": (self.qkv_weight, slice(q_rows, q_rows + kv)),
                 "self_attn.v_proj.weight": (self.qkv_weight, slice(q_rows + kv, q_rows + 2 * kv))}
        if self.qkv_bias is not None:
            table |= {"self_attn.q_proj.bias": (self.qkv_bias, slice(0, q_rows)),
                      "self_attn.k_proj.bias": (self.qkv_bias, slice(q_rows, q_rows + kv)),
                      "self_attn.v_proj.bias": (self.qkv_bias, slice(q_rows + kv, q_rows + 2 * kv))}
        return table


class SharedExpertMoE(nn.Module):
    """Routed experts (``SparseMoE``: int8/fp8 refused there) plus a shared expert scaled by a sigmoid gate."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.experts = SparseMoE(config, NAMES, renormalize=config.norm_topk_prob, dtype=dtype, device=device)
        shared = dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert = MLP(shared, dtype, device)
        self.shared_gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype, device=device),
                                               requires_grad=False)

    fused_checkpoint = False  # the checkpoint stacks the experts (``experts.gate_up_proj``), as transformers 5 does
    tp = None  # the tensor-parallel group once sharded: one all-reduce of routed + gated shared partial sums

    def forward(self, x: torch.Tensor, lora: Optional[object] = None) -> torch.Tensor:  # [T, hidden]
        routed = self.experts(x)
        out = routed + torch.sigmoid(F.linear(x, self.shared_gate_weight)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def weight_targets(self) -> WeightTargets:
        """Per-expert names (``experts.<e>.gate_proj.weight``, what ``save_pretrained`` writes), or
        with ``fused_checkpoint`` the stacks the released Qwen3.5-MoE holds: ``experts.gate_up_proj``
        ``[E, 2 * inter, hidden]`` (gate rows first) and ``experts.down_proj`` ``[E, hidden, inter]``,
        ``w13`` and ``w2`` as they are."""
        shared = {"mlp.shared_expert." + name.removeprefix("mlp."): target
                  for name, target in self.shared_expert.weight_targets().items()}
        if self.fused_checkpoint:
            routed = {"mlp.gate.weight": (self.experts.gate_weight, ALL),
                      "mlp.experts.gate_up_proj": (self.experts.w13, ALL),
                      "mlp.experts.down_proj": (self.experts.w2, ALL)}
        else:
            routed = self.experts.weight_targets()
        return {**routed, **shared, "mlp.shared_expert_gate.weight": (self.shared_gate_weight, ALL)}


class HybridDecoderLayer(DecoderLayer):
    """A Gated DeltaNet (``linear_attn``) or gated attention (``attn``) layer, then its MLP."""

    attention_class = GatedAttention
    linear_layout = "qkvz"  # how the checkpoint lays out the DeltaNet's projections (gated_deltanet)

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        nn.Module.__init__(self)
        self.eps = config.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.input_norm = nn.Parameter(torch.empty(config.hidden_size, **kw), requires_grad=False)
        self.post_attention_norm = nn.Parameter(torch.empty(config.hidden_size, **kw), requires_grad=False)
        self.is_linear = config.is_linear_attention_layer(layer_idx)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, self.linear_layout, dtype, device)
        else:
            self.attn = self.attention_class(config, dtype, device)
        self.mlp = self.make_mlp(config, layer_idx, dtype, device)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return SharedExpertMoE(config, dtype, device)
        return MLP(config, dtype, device)

    def weight_targets(self) -> WeightTargets:
        mixer = self.linear_attn if self.is_linear else self.attn
        return {"input_layernorm.weight": (self.input_norm, ALL),
                "post_attention_layernorm.weight": (self.post_attention_norm, ALL),
                **mixer.weight_targets(), **self.mlp.weight_targets()}

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache, meta: AttentionMetadata,
                lora: Optional["LoRABatch"] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_cache``: a ``StateCache`` for a linear-attention layer, a ``(k, v)`` pair otherwise."""
        h, residual = self.input_normed(x, residual)
        if self.is_linear:
            h = self.linear_attn(h, kv_cache, meta, lora)
        else:
            h = self.attn(h, positions, cos_sin_cache, kv_cache, meta, lora)
        h, residual = kernels.rms_norm(h, self.post_attention_norm, self.eps, residual)
        return self.mlp(h, lora), residual


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """The hybrid decoder; ``forward`` is Llama's (each layer takes its own cache kind)."""

    layer_class = HybridDecoderLayer

    def match_checkpoint(self, names: set[str]) -> None:
        """Stacked experts (``mlp.experts.gate_up_proj``) or per-expert tensors, as the checkpoint has them."""
        fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in names)
        for layer in self.layers:
            if isinstance(layer.mlp, SharedExpertMoE):
                layer.mlp.fused_checkpoint = fused

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Llama's, with the DeltaNet projections' rows put in canonical order first, and
        1 added to every zero-centred norm weight loaded (module docstring)."""
        loaded = super().load_weights(self._canonical(weights))
        table = self._weight_table()
        for name in loaded:
            if name == "model.norm.weight" or name.endswith(ZERO_CENTRED_NORMS):
                target, rows = table[name]
                target[rows] += 1
        return loaded

    def _canonical(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            parts = name.split(".", 3)
            if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
                    and int(parts[2]) < len(self.layers) and self.layers[int(parts[2])].is_linear:
                tensor = self.layers[int(parts[2])].linear_attn.canonical_rows(parts[3], tensor)
            yield name, tensor
