"""Gemma 4 (text, ``Gemma4ForCausalLM``): Gemma 3's decoder with per-layer KV shapes, KV-shared
layers, per-layer input embeddings and an optional MoE block, as transformers 5.24's ``Gemma4TextModel``.

Differences from Gemma 3 (``models/gemma3.py``), every switch read from the config:

- norms multiply by ``w`` (not ``1 + w``): nothing is added at load; ``v_norm`` and the router's
  norm have no weight; softmax scale 1 (q and k are RMS-normed per head);
- ``sliding_attention`` layers: ``head_dim``, ``num_key_value_heads``, default rope
  (``rope_parameters["sliding_attention"]``); ``full_attention`` layers: ``global_head_dim`` and,
  with ``attention_k_eq_v``, ``num_global_key_value_heads`` (or transformers 5.24's serialized
  ``per_layer_config`` overrides), and the ``proportional`` rope: the first
  ``partial_rotary_factor * head_dim / 2`` frequencies ``theta ** (-2i / head_dim)``, the others 0
  (those pairs pass through), over the whole head (``ModelConfig.layer_kv_shapes``);
- ``attention_k_eq_v`` (full layers): no ``v_proj``; values are the key projection before
  ``k_norm`` and rotary, through the scale-free ``v_norm``;
- ``num_kv_shared_layers``: the last layers have no k/v weights and read the cache of the last
  earlier layer of their type (``ModelConfig.kv_source_layers``: the allocator gives them no
  blocks, ``engine.kv.specs.SharedKVSpec``); their MLP is twice as wide with ``use_double_wide_mlp``;
- per-layer inputs (``hidden_size_per_layer_input`` > 0): a packed ``[vocab, layers x ple]``
  table (scaled by ``sqrt(ple)``) plus a projection of the scaled embeddings (times
  ``hidden^-0.5``, RMS-normed per layer), summed and scaled by ``2^-0.5``; each layer gates its
  slice into the stream after the feed-forward (``gelu(gate(h)) * ple``, projected, normed, added);
- ``enable_moe_block``: beside the dense MLP, a router on the post-attention stream (scale-free
  norm, learned ``scale`` times ``hidden^-0.5``, softmax top-k renormalised, times
  ``per_expert_scale``) and GELU-tanh experts on ``pre_feedforward_layernorm_2`` of the stream;
  the two outputs are normed, summed, then ``post_feedforward_layernorm`` as for the dense MLP;
- ``layer_scalar`` multiplies the whole stream at the end of each layer, so a layer returns the
  stream itself (no fused residual).

Refused, each naming why: another activation, bidirectional attention beyond images (``"all"``;
``"vision"`` is causal for text), other rope types, any
``per_layer_config`` override besides head_dim / num_key_value_heads, a layer type without a
producing layer, int8/fp8 at load and LoRA adapters (not checked for these shapes), tensor and
pipeline parallelism (``models.tensor_parallel`` /
``pipeline_parallel`` accept only the families they know).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import ModelConfig, common_fields, read_rope
from pagoda.models.gemma3 import ACTIVATION, GeluTanhMLP
from pagoda.models.gemma4_moe import Gemma4MoE
from pagoda.models.llama import ALL, Attention, KVCache, LlamaForCausalLM, WeightTargets, make_cos_sin_cache
from pagoda.models.llama import projection

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}


@dataclass(frozen=True)
class Gemma4Options:
    """Gemma 4's own switches (``ModelConfig.gemma4``)."""

    ple_dim: int  # hidden_size_per_layer_input (0: no per-layer inputs)
    ple_vocab_size: int
    k_eq_v: bool  # attention_k_eq_v: full-attention layers' values are their key projection
    num_kv_shared_layers: int
    double_wide_mlp: bool
    moe: bool  # enable_moe_block
    global_rope: tuple[float, float, float]  # full layers' (theta, partial_rotary_factor, factor)
    media_token_ids: tuple[int, ...] = ()  # with images (gemma4_vl): tokens that read the pad token's rows
    pad_token_id: int = 0


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Gemma 4 text config (``Gemma4TextConfig``; see the module docstring).

    Raises:
        ValueError: a refused switch (module docstring), naming it.
    """
    act = raw.get("hidden_activation") or ACTIVATION
    if act != ACTIVATION:
        raise ValueError(f"Gemma 4 hidden_activation {act!r} is not supported; only {ACTIVATION!r}")
    if raw.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": images only (gemma4_vl)
        raise ValueError(f"use_bidirectional_attention={raw['use_bidirectional_attention']!r} is not supported "
                         "(causal attention; 'vision': an image's tokens both ways, Gemma4ForConditionalGeneration)")
    fields = common_fields({k: v for k, v in raw.items() if k not in ("hidden_act", "rope_scaling")}, architecture)
    layers = fields["num_hidden_layers"]
    types = list(raw.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                            for i in range(layers)])
    types[-1] = "full_attention"  # transformers forces it
    local_theta, local_scaling = read_rope(raw, "sliding_attention")
    if local_scaling is not None:
        raise ValueError(f"Gemma 4 rope on sliding_attention layers: only the default type, got {local_scaling}")
    shapes = _layer_shapes(raw, fields, types)
    moe = bool(raw.get("enable_moe_block"))
    options = Gemma4Options(
        ple_dim=int(raw.get("hidden_size_per_layer_input") or 0), ple_vocab_size=int(raw.get(
            "vocab_size_per_layer_input") or fields["vocab_size"]), k_eq_v=bool(raw.get("attention_k_eq_v")),
        num_kv_shared_layers=int(raw.get("num_kv_shared_layers") or 0),
        double_wide_mlp=bool(raw.get("use_double_wide_mlp")), moe=moe, global_rope=_global_rope(raw))
    if options.ple_dim and options.ple_vocab_size < fields["vocab_size"]:
        raise ValueError(f"vocab_size_per_layer_input={options.ple_vocab_size} is below vocab_size="
                         f"{fields['vocab_size']}: a token past it has no per-layer input row")
    if moe:
        fields.update(num_experts=int(raw["num_experts"]), num_experts_per_tok=int(raw["top_k_experts"]),
                      moe_intermediate_size=int(raw["moe_intermediate_size"]))
    fields.update(layer_types=tuple(types), tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                  rope_theta=local_theta, rope_scaling=None, sliding_window=raw.get("sliding_window", 512))
    if raw.get("attention_bias"):
        raise ValueError("Gemma 4 attention_bias=true is not supported (no released model has it)")
    return ModelConfig(**fields, local_rope_theta=local_theta,
                       final_logit_softcapping=raw.get("final_logit_softcapping"), layer_kv_shapes=shapes,
                       kv_source_layers=_kv_sources(types, options.num_kv_shared_layers), gemma4=options)


def _layer_shapes(raw: dict, fields: dict, types: list[str]) -> tuple[tuple[int, int], ...]:
    """(kv_heads, head_dim) per layer: ``per_layer_config`` when the config has it (transformers
    5.24 writes it), else ``global_head_dim`` / ``num_global_key_value_heads`` on full layers."""
    base = (fields["num_key_value_heads"], fields["head_dim"])
    if "per_layer_config" in raw:
        overrides = {int(k): v for k, v in (raw["per_layer_config"] or {}).items()}
        for layer, over in overrides.items():
            if set(over) - _PER_LAYER_KEYS:
                raise ValueError(f"per_layer_config[{layer}]: only {sorted(_PER_LAYER_KEYS)} may differ per layer; "
                                 f"got {sorted(set(over) - _PER_LAYER_KEYS)}")
        return tuple((overrides.get(i, {}).get("num_key_value_heads", base[0]),
                      overrides.get(i, {}).get("head_dim", base[1])) for i in range(len(types)))
    global_dim = int(raw.get("global_head_dim") or 512)
    global_heads = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
    full = (int(global_heads or base[0]), global_dim)
    return tuple(full if t == "full_attention" else base for t in types)


def _global_rope(raw: dict) -> tuple[float, float, float]:
    params = dict((raw.get("rope_parameters") or {}).get("full_attention") or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(f"Gemma 4 rope on full_attention layers: {rope_type!r} is not supported; "
                         "only 'proportional' or 'default'")
    partial = float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    factor = float(params.get("factor", 1.0)) if rope_type == "proportional" else 1.0
    return float(params.get("rope_theta", 1_000_000.0)), partial, factor


def _kv_sources(types: list[str], num_shared: int) -> tuple[int, ...]:
    """Each layer's cache owner: itself, or for the last ``num_shared`` layers the last earlier
    non-shared layer of the same type (transformers' ``kv_sharing_modes``)."""
    first_shared = len(types) - num_shared
    sources = list(range(len(types)))
    for i in range(first_shared, len(types)):
        producers = [j for j in range(first_shared) if types[j] == types[i]]
        if not producers:
            raise ValueError(f"num_kv_shared_layers={num_shared}: layer {i} ({types[i]}) shares the cache of an "
                             "earlier layer of its type, and no non-shared layer has that type")
        sources[i] = producers[-1]
    return tuple(sources)


def layer_config(config: ModelConfig, layer_idx: int) -> ModelConfig:
    """``config`` as layer ``layer_idx`` sees it: its head_dim and KV heads, its MLP's width."""
    heads, dim = config.layer_kv_shape(layer_idx)
    shared = config.kv_source(layer_idx) != layer_idx
    inter = config.intermediate_size * (2 if shared and config.gemma4.double_wide_mlp else 1)
    return dataclasses.replace(config, head_dim=dim, num_key_value_heads=heads, intermediate_size=inter)


def proportional_cos_sin(config: ModelConfig, head_dim: int, device: torch.device) -> torch.Tensor:
    """Full-attention layers' rotary table ``[max_positions, head_dim]`` (cos | sin), as transformers'
    ``_compute_proportional_rope_parameters``: zero frequencies past the rotated part."""
    theta, partial, factor = config.gemma4.global_rope
    angles = int(partial * head_dim // 2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - angles)]) / factor
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    table = torch.outer(positions, inv_freq)
    return torch.cat((table.cos(), table.sin()), dim=-1).to(device)


class Gemma4Attention(Attention):
    """q (and, unless the layer shares a cache, k and v) projections, per-head norms, scale 1.

    ``qkv_weight`` rows: q, then k, then v; a KV-shared layer has q rows only, a ``k_eq_v`` layer
    no v rows (its values are the k projection)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int,
                 shares_kv: bool, k_eq_v: bool) -> None:
        super().__init__(config, dtype, device, window)
        self.shares_kv, self.k_eq_v = shares_kv, k_eq_v and not window
        self.scale, self.eps = 1.0, config.rms_norm_eps
        rows = self.q_size + (0 if shares_kv else self.kv_size * (1 if self.k_eq_v else 2))
        kw = dict(dtype=dtype, device=device)
        self.qkv_weight = nn.Parameter(torch.empty(rows, config.hidden_size, **kw), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.empty(rows, **kw), requires_grad=False) if config.attention_bias else None
        self.q_norm = nn.Parameter(torch.empty(self.head_dim, **kw), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(self.head_dim, **kw), requires_grad=False)
        self.register_buffer("unit_norm", torch.ones(self.head_dim, **kw), persistent=False)  # v_norm: no weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, lora: Optional["LoRABatch"] = None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = projection(self, "qkv_weight", x, self.qkv_bias, lora)
        q = self._head_norm(qkv[:, :self.q_size].reshape(num_tokens, self.num_heads, self.head_dim), self.q_norm)
        k_cache, v_cache = kv_cache
        if self.shares_kv:  # the producing layer wrote this step's keys earlier in the step
            q, _ = kernels.apply_rotary(q, q[:, :1].contiguous(), positions, cos_sin_cache)
        else:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(num_tokens, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size:].reshape(k.shape)
            v = self._head_norm(v, self.unit_norm)
            q, k = kernels.apply_rotary(q, self._head_norm(k, self.k_norm), positions, cos_sin_cache)
            kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale, window=self.window)
        return projection(self, "o_weight", out.reshape(num_tokens, self.q_size), self.o_bias, lora)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed, _ = kernels.rms_norm(x.reshape(-1, self.head_dim).contiguous(), weight, self.eps)
        return normed.view(x.shape)

    def weight_targets(self) -> WeightTargets:
        q, kv = self.q_size, self.kv_size
        table = {"self_attn.q_proj.weight": (self.qkv_weight, slice(0, q)),
                 "self_attn.o_proj.weight": (self.o_weight, ALL), "self_attn.q_norm.weight": (self.q_norm, ALL)}
        if not self.shares_kv:
            table |= {"self_attn.k_proj.weight": (self.qkv_weight, slice(q, q + kv)),
                      "self_attn.k_norm.weight": (self.k_norm, ALL)}
            if not self.k_eq_v:
                table["self_attn.v_proj.weight"] = (self.qkv_weight, slice(q + kv, q + 2 * kv))
        return table


class Gemma4DecoderLayer(nn.Module):
    """Attention, dense MLP (plus the MoE block), the per-layer input, ``layer_scalar``; returns the stream."""

    quantization_unsupported = "Gemma 4: int8/fp8 at load is not checked for its per-layer shapes yet"

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        own = layer_config(config, layer_idx)
        options: Gemma4Options = config.gemma4
        self.eps, self.is_local = config.rms_norm_eps, config.layer_types[layer_idx] == "sliding_attention"
        self.attn = Gemma4Attention(own, dtype, device, config.layer_window(layer_idx),
                                    shares_kv=config.kv_source(layer_idx) != layer_idx, k_eq_v=options.k_eq_v)
        self.mlp = GeluTanhMLP(own, dtype, device)
        self.moe = Gemma4MoE(config, dtype, device) if options.moe else None
        kw = dict(dtype=dtype, device=device)
        names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        if options.moe:
            names += ["post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"]
        if options.ple_dim:
            names.append("post_per_layer_input_norm")
            self.ple_gate = nn.Parameter(torch.empty(options.ple_dim, config.hidden_size, **kw), requires_grad=False)
            self.ple_proj = nn.Parameter(torch.empty(config.hidden_size, options.ple_dim, **kw), requires_grad=False)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.empty(config.hidden_size, **kw), requires_grad=False)
                                       for n in names})
        self.layer_scalar = nn.Parameter(torch.ones(1, **kw), requires_grad=False)

    def weight_targets(self) -> WeightTargets:
        table = {f"{n}.weight": (w, ALL) for n, w in self.norms.items()}
        table |= {"layer_scalar": (self.layer_scalar, ALL), **self.attn.weight_targets(), **self.mlp.weight_targets()}
        if "post_per_layer_input_norm" in self.norms:
            table |= {"per_layer_input_gate.weight": (self.ple_gate, ALL),
                      "per_layer_projection.weight": (self.ple_proj, ALL)}
        return table | (self.moe.weight_targets() if self.moe is not None else {})

    def norm(self, name: str, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return kernels.rms_norm(x, self.norms[name], self.eps, residual)

    def forward(self, x: torch.Tensor, per_layer_input: Optional[torch.Tensor], positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                lora: Optional["LoRABatch"] = None) -> torch.Tensor:  # [num_tokens, hidden]: the stream
        h, _ = self.norm("input_layernorm", x)
        h, _ = self.norm("post_attention_layernorm", self.attn(h, positions, cos_sin_cache, kv_cache, meta, lora))
        h, stream = self.norm("pre_feedforward_layernorm", h, x)  # stream = x + attention
        h = self.mlp(h, lora)
        if self.moe is not None:
            h = self.norm("post_feedforward_layernorm_1", h)[0] + self.moe(stream, self.norms)
        stream = stream + self.norm("post_feedforward_layernorm", h)[0]
        if per_layer_input is not None:
            gate = F.gelu(F.linear(stream, self.ple_gate), approximate="tanh") * per_layer_input
            stream = stream + self.norm("post_per_layer_input_norm", F.linear(gate, self.ple_proj))[0]
        return stream * self.layer_scalar


class Gemma4ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma4DecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(config, dtype, device)
        options: Gemma4Options = config.gemma4
        sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
        full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
        if sliding:  # default rope over the sliding layers' head_dim (the base table has the config's)
            self.cos_sin_cache = make_cos_sin_cache(layer_config(config, sliding[0]), self.device)
        self.register_buffer("global_cos_sin_cache", proportional_cos_sin(
            config, config.layer_kv_shape(full[0])[1], self.device), persistent=False)
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5).to(**kw), persistent=False)
        if options.ple_dim:
            width = config.num_hidden_layers * options.ple_dim
            self.ple_embed = nn.Parameter(torch.empty(options.ple_vocab_size, width, **kw), requires_grad=False)
            self.ple_model_proj = nn.Parameter(torch.empty(width, config.hidden_size, **kw), requires_grad=False)
            self.ple_norm = nn.Parameter(torch.empty(options.ple_dim, **kw), requires_grad=False)
            self.register_buffer("ple_scale", torch.tensor(options.ple_dim**0.5).to(**kw), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: Optional["LoRABatch"] = None) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), f"need {len(self.layers)} KV caches, got {len(kv_caches)}"
        h = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        metas = [meta.for_layer(idx) for idx in range(len(self.layers))]
        return self.run_layers(h, self.per_layer_inputs(input_ids, h), positions, kv_caches, metas, lora)

    def run_layers(self, h: torch.Tensor, per_layer: Optional[torch.Tensor], positions: torch.Tensor,
                   kv_caches: list[KVCache], metas: list[AttentionMetadata],
                   lora: Optional["LoRABatch"] = None) -> torch.Tensor:
        """The decoder over the input embeddings ``h``, each layer with its metadata; the final norm's output."""
        for idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            table = self.cos_sin_cache if layer.is_local else self.global_cos_sin_cache
            h = layer(h, None if per_layer is None else per_layer[:, idx], positions, table, kv_cache, metas[idx], lora)
        h, _ = kernels.rms_norm(h, self.norm, self.config.rms_norm_eps)
        return h

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> Optional[torch.Tensor]:
        """``[num_tokens, layers, ple]``: the token's packed row plus the projected embeddings (None: off)."""
        options: Gemma4Options = self.config.gemma4
        if not options.ple_dim:
            return None
        shape = (input_ids.shape[0], self.config.num_hidden_layers, options.ple_dim)
        tokens = (F.embedding(input_ids, self.ple_embed) * self.ple_scale).view(shape)
        projected = F.linear(embeds, self.ple_model_proj) * self.config.hidden_size**-0.5
        normed, _ = kernels.rms_norm(projected.reshape(-1, options.ple_dim), self.ple_norm, self.config.rms_norm_eps)
        return (normed.view(shape) + tokens) * 2.0**-0.5

    def _weight_table(self) -> WeightTargets:
        table = super()._weight_table()
        if self.config.gemma4.ple_dim:
            table |= {"model.embed_tokens_per_layer.weight": (self.ple_embed, ALL),
                      "model.per_layer_model_projection.weight": (self.ple_model_proj, ALL),
                      "model.per_layer_projection_norm.weight": (self.ple_norm, ALL)}
        return table

