"""Model configuration read from a Hugging Face ``config.json``.

``ModelConfig`` holds what the decoder families of ``pagoda.models`` need and nothing
else; it is read without importing transformers, and accepts both the transformers 4
layout (``rope_theta`` and ``rope_scaling`` at top level) and the transformers 5 layout
(both folded into ``rope_parameters``).

This module reads the fields every family shares (``common_fields``); a family module
(``llama``, ``qwen3``, ``mixtral``, ``qwen3_moe``, ``gemma3``, ``gpt_oss``) adds its own switches, and
``pagoda.models.registry`` picks the family by the config's architecture name (and
refuses unsupported ones, naming the supported list). Sliding-window attention: a model
that declares a window gets it in ``sliding_window``; ``layer_types`` (transformers'
per-layer "sliding_attention" / "full_attention", when the config gives it) says which
layers use it, else all do; ``layer_window(i)`` is what layer i's attention applies (0:
none). Qwen2/Qwen3 declare a window that only counts with ``use_sliding_window``, and then
(without ``layer_types``) only from layer ``max_window_layers`` on, as transformers does.

Mixture-of-Experts fields (``num_experts > 0``): ``num_experts_per_tok`` experts per
token, each of ``moe_intermediate_size``; ``is_moe_layer(i)`` says which layers are
sparse (``decoder_sparse_step`` and ``mlp_only_layers``, as Qwen3-MoE defines them;
Mixtral: every layer).

Hybrid families (Qwen3-Next, Qwen3.5; ``models/qwen3_next.py``): ``layer_types`` entries
"linear_attention" / "full_attention" (``is_linear_attention_layer``), ``linear_attention`` the
Gated DeltaNet's sizes (``LinearAttentionShape``), ``attention_output_gate``,
``shared_expert_intermediate_size``; ``partial_rotary_factor`` (``rotary_dim`` leading
dimensions of each head rotate) is set by those families' parsers only: elsewhere a
``partial_rotary_factor`` in the rope parameters is still refused.

DeepSeek-V3 (``models/deepseek_v3.py``): ``mla`` holds multi-head latent attention's sizes
(``MLAShape``; its layers cache one latent per token, ``engine.kv.specs.MLALatentSpec``) and
``grouped_router`` the router's group-limited top-k (``models.moe.GroupedRouter``); ``head_dim`` is then the
rotary part of each head (``qk_rope_head_dim``, as transformers sets it). GLM-4.5
(``models/glm4_moe.py``) reads the same router into ``grouped_router``, a partial rotary and
an optional q/k norm (``qk_norm``).

Rotary frequencies: ``inv_freq()`` reproduces Hugging Face's computation bit for bit
(float32 throughout), for the ``default``, ``linear``, ``llama3`` and ``yarn`` rope types;
any other type raises ``ValueError`` naming it. YaRN (transformers' ``_compute_yarn_parameters``,
gpt-oss) also scales cos and sin by ``rope_attention_factor`` (1 for the other types). ``rope_parameters`` keyed by
layer type (Gemma 3) is read per layer type (``read_rope``); the shared fields take ``full_attention``'s.
The llama3 and YaRN scalings themselves are ``models/rope_scaling.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from pagoda.models.rope_scaling import llama3_scale, yarn_inv_freq, yarn_mscale

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[dict[str, Any]] = None  # None means the default rope type
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on the output projection (Llama's attention_bias sets both)
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list[int], None] = None
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple[str, ...]] = None  # per layer "sliding_attention" / "full_attention"
    architectures: list[str] = field(default_factory=list)
    # Mixture of Experts (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Gemma 3 (defaults: what the other families do)
    local_rope_theta: Optional[float] = None  # rope base of "sliding_attention" layers (None: rope_theta)
    query_pre_attn_scalar: Optional[float] = None  # softmax scale is its ** -0.5 (None: head_dim's)
    final_logit_softcapping: Optional[float] = None  # logits = cap * tanh(logits / cap)
    # gpt-oss (defaults: what the other families do)
    attention_sinks: bool = False  # a learned per-head logit in every softmax denominator
    clamped_swiglu: Optional[tuple[float, float]] = None  # experts' (alpha, limit); None: silu(gate) * up
    # Multi-token-prediction layers the checkpoint carries beside the decoder (DeepSeek-V3's
    # num_nextn_predict_layers, Qwen3-Next's mtp_num_hidden_layers): loaded only by the MTP
    # speculative proposer (engine/spec_decode/mtp.py); the target's loader skips them.
    num_mtp_layers: int = 0
    # Hybrid families (Qwen3-Next, Qwen3.5): "linear_attention" entries of layer_types are Gated
    # DeltaNet layers of this shape; full-attention layers gate their output (attention_output_gate)
    # and rotate only the first partial_rotary_factor of each head; a shared expert beside the
    # routed ones (its gate a sigmoid) when shared_expert_intermediate_size > 0.
    linear_attention: Optional["LinearAttentionShape"] = None
    attention_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    # DeepSeek-V3 / Kimi K2: multi-head latent attention, the sigmoid router limited to groups
    mla: Optional["MLAShape"] = None
    grouped_router: Optional["GroupedRouter"] = None  # models.moe.GroupedRouter
    # GLM-4.5 (use_qk_norm): a per-head RMSNorm of q and k before rotary, as Qwen3's, but optional
    qk_norm: bool = False
    # Vision-language families (Qwen3-VL): images in, their rules (models.multimodal.VisionSpec); None: text only
    vision: Optional[Any] = None
    # Layers that differ in KV shape or share another layer's cache (Gemma 4): per layer (kv_heads,
    # head_dim) (None: the config's for every layer), and the layer whose cache each reads (None: its own)
    layer_kv_shapes: Optional[tuple[tuple[int, int], ...]] = None
    kv_source_layers: Optional[tuple[int, ...]] = None
    gemma4: Optional[Any] = None  # models.gemma4.Gemma4Options: the family's own switches

    def __post_init__(self) -> None:
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts={self.num_experts}]"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rotary_dim % 2 != 0 or self.rotary_dim < 2:
            raise ValueError(f"rotary dimension (head_dim {self.head_dim} x partial_rotary_factor "
                             f"{self.partial_rotary_factor}) must be even and >= 2, got {self.rotary_dim}")
        self.rope_type  # validates rope_scaling

    # ---- derived values ------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head the rotary embedding turns (transformers'
        ``int(head_dim * partial_rotary_factor)``); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_attention_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a linear-attention (Gated DeltaNet) layer."""
        return self.layer_types is not None and self.layer_types[layer_idx] == "linear_attention"

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "linear" and "factor" not in self.rope_scaling:
            raise ValueError("linear rope scaling is missing factor")
        required = {"llama3": _LLAMA3_ROPE_KEYS, "yarn": ("factor", "original_max_position_embeddings")}
        missing = [k for k in required.get(rope_type, ()) if k not in self.rope_scaling]
        if missing:
            raise ValueError(f"{rope_type} rope scaling is missing {', '.join(missing)}")
        if self.rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {self.rope_scaling['partial_rotary_factor']} is not supported")
        return rope_type

    def layer_window(self, layer_idx: int) -> int:
        """The sliding window layer ``layer_idx`` attends with (0: full attention)."""
        if not self.sliding_window:
            return 0
        if self.layer_types is not None and self.layer_types[layer_idx] != "sliding_attention":
            return 0
        return self.sliding_window

    def layer_kv_shape(self, layer_idx: int) -> tuple[int, int]:
        """(KV heads, head_dim) of layer ``layer_idx``'s attention (Gemma 4's full layers differ)."""
        if self.layer_kv_shapes is None:
            return self.num_key_value_heads, self.head_dim
        return self.layer_kv_shapes[layer_idx]

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose KV cache layer ``layer_idx`` reads (itself unless it shares one)."""
        return layer_idx if self.kv_source_layers is None else self.kv_source_layers[layer_idx]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has a sparse MoE block (else a dense MLP)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_ids(self) -> list[int]:
        """The eos id(s) as a list (a config may give one int or a list)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def check_max_model_len(self, max_model_len: Optional[int]) -> int:
        """Resolve and validate a context length for this model.

        Args:
            max_model_len: requested length, or None for the model's maximum.
        Returns:
            the context length to use.
        Raises:
            ValueError: longer than ``max_position_embeddings``, or below 1.
        """
        length = self.max_position_embeddings if max_model_len is None else max_model_len
        if length > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len {length} exceeds max_position_embeddings {self.max_position_embeddings}"
            )
        if length < 1:
            raise ValueError(f"max_model_len must be >= 1, got {length}")
        return length

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies [rotary_dim // 2], float32, computed as Hugging Face does."""
        dim = self.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        if self.rope_type == "llama3":
            inv_freq = llama3_scale(inv_freq, self.rope_scaling)
        elif self.rope_type == "linear":
            inv_freq = inv_freq / self.rope_scaling["factor"]
        elif self.rope_type == "yarn":
            inv_freq = yarn_inv_freq(self.rope_theta ** (exponents), dim, self.rope_theta, self._yarn_factor(),
                                      self.rope_scaling)
        return inv_freq

    @property
    def rope_attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention scaling; 1.0 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        given = self.rope_scaling.get("attention_factor")
        if given is not None:
            return float(given)
        factor, mscale, mscale_all_dim = (self._yarn_factor(), self.rope_scaling.get("mscale"),
                                          self.rope_scaling.get("mscale_all_dim"))
        if mscale and mscale_all_dim:
            return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        return yarn_mscale(factor)

    def _yarn_factor(self) -> float:
        factor = self.rope_scaling["factor"]  # None: the context extension the config implies
        return factor if factor is not None else (
            self.max_position_embeddings / self.rope_scaling["original_max_position_embeddings"])


@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's sizes (transformers' ``linear_*`` config fields)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")
        if self.conv_kernel_size < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel_size}")

    @property
    def key_dim(self) -> int:  # q (and k) channels
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:  # v (and z) channels
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # the convolved channels: q, k and v
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention's sizes (transformers' ``DeepseekV3Config`` fields).

    Per token: ``q`` from ``hidden`` (through a rank-``q_lora_rank`` bottleneck unless it is
    None), each head ``qk_nope_head_dim`` + ``qk_rope_head_dim`` wide; one latent of
    ``kv_lora_rank`` (normed) and one rotary key of ``qk_rope_head_dim`` shared by every head:
    the ``latent_dim`` numbers a layer caches per token. ``rope_interleave``: the rotary
    dimensions come in adjacent pairs (DeepSeek's checkpoints), not in two halves.
    """

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        sizes = {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                 "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}
        bad = [f"{k}={v}" for k, v in sizes.items() if v < 1] + (
            [] if self.q_lora_rank is None or self.q_lora_rank >= 1 else [f"q_lora_rank={self.q_lora_rank}"])
        if bad or self.qk_rope_head_dim % 2:
            raise ValueError(f"multi-head latent attention: {', '.join(bad) or 'qk_rope_head_dim'} must be positive "
                             f"(qk_rope_head_dim even), got {sizes}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token and layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def read_config_json(path: Union[str, Path]) -> dict[str, Any]:
    """The parsed ``<path>/config.json`` (or ``path`` itself when it is a file).

    Raises:
        FileNotFoundError: no config.json there.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def common_fields(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields every family reads the same way (a family adds its own).

    Raises:
        ValueError: an activation other than SiLU, or an MLP bias.
    """
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported; only 'silu'")
    if raw.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported")
    hidden_size = raw["hidden_size"]
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = read_rope(raw)
    return dict(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden_size // num_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        sliding_window=raw.get("sliding_window"),
        layer_types=tuple(raw["layer_types"]) if raw.get("layer_types") else None,
        architectures=list(raw.get("architectures") or [architecture]),
        num_mtp_layers=int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 0),
    )


def qwen_sliding_window(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/Qwen3's window fields: they declare a window even when ``use_sliding_window``
    switches it off; on, it applies from layer ``max_window_layers`` on (unless
    ``layer_types`` says otherwise)."""
    if not raw.get("use_sliding_window", False) or not raw.get("sliding_window"):
        return {"sliding_window": None, "layer_types": None}
    if raw.get("layer_types"):
        return {"sliding_window": raw["sliding_window"], "layer_types": tuple(raw["layer_types"])}
    first = raw.get("max_window_layers", 0)
    types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(raw["num_hidden_layers"]))
    return {"sliding_window": raw["sliding_window"], "layer_types": types}


def rope_by_layer_type(raw: dict[str, Any]) -> bool:
    """Whether ``rope_parameters`` is keyed by layer type (transformers 5 Gemma 3:
    ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    params = raw.get("rope_parameters") or {}
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def read_rope(raw: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) from the transformers 4 layout (top level), the transformers 5
    layout (``rope_parameters``) or its per-layer-type form (``layer_type``'s entry)."""
    params = dict(raw.get("rope_parameters") or {})
    if rope_by_layer_type(raw):
        params = dict(params.get(layer_type) or {})
    scaling = raw.get("rope_scaling")
    scaling = dict(scaling) if scaling else dict(params)
    theta = raw.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default") and not set(scaling) - {"rope_type", "type"}:
        return float(theta), None
    return float(theta), scaling
