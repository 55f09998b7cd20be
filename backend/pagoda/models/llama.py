"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens and a paged KV cache.

One ``forward`` call runs one engine step: ``num_tokens`` query tokens from many sequences
laid out back to back (prefill chunks and decode tokens mixed; see
``pagoda.kernels.metadata``). There is no batch dimension and no padding.

The hot ops go through ``pagoda.kernels`` only (``rms_norm`` with the fused residual add,
``apply_rotary``, ``write_kv``, ``paged_attention``), so the same model code runs the
OpenAI-Triton kernels on GPU and the torch references on CPU. Everything else is a
matmul (``quant.linear``: ``F.linear``, or an int8 kernel once ``quantize_model`` has
replaced the projection weights listed in ``linear_weights``) or an elementwise op.

Weights are stored fused: q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj``,
which turns seven matmuls per layer into four (it matters on CPU). ``load_weights`` takes
Hugging Face parameter names and does the fusing.

Multi-LoRA: ``forward(..., lora=LoRABatch)`` adds each token's adapter delta to the four
fused projections (``projection``; adapters and slots in ``models/lora.py``); tokens
without an adapter, and steps without a batch, run the base weights only.

Residual stream, as in vLLM: each layer returns its output and the running residual
separately, and the next ``rms_norm`` adds them, so the add is fused into the norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import ModelConfig
from pagoda.models.quant import linear

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


def projection(owner: nn.Module, name: str, x: torch.Tensor, bias: Optional[torch.Tensor],
               lora: Optional["LoRABatch"]) -> torch.Tensor:
    """``linear(x, owner.<name>, bias)``, plus the step's LoRA deltas when any token has an adapter."""
    out = linear(x, getattr(owner, name), bias)
    if lora is not None and lora.groups:
        a_stack, b_stack = owner.lora_stacks[name]
        kernels.lora_apply(out, x, a_stack, b_stack, lora)
    return out


class Attention(nn.Module):
    linear_weights = ("qkv_weight", "o_weight")  # what quantize_model may replace

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.qkv_weight = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, hidden, **kw), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, **kw), requires_grad=False)
            if config.attention_bias
            else None
        )
        self.o_weight = nn.Parameter(torch.empty(hidden, self.q_size, **kw), requires_grad=False)
        self.o_bias = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False) if config.o_proj_bias else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: Optional["LoRABatch"] = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = x.shape[0]
        qkv = projection(self, "qkv_weight", x, self.qkv_bias, lora)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = kernels.apply_rotary(q, k, positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        # Write first: this step's queries attend to this step's keys through the cache.
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [num_tokens, num_heads, head_dim]
        return projection(self, "o_weight", out.reshape(num_tokens, self.q_size), self.o_bias, lora)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up in one matmul."""

    linear_weights = ("gate_up_weight", "down_weight")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        kw = dict(dtype=dtype, device=device)
        self.gate_up_weight = nn.Parameter(
            torch.empty(2 * config.intermediate_size, config.hidden_size, **kw), requires_grad=False
        )
        self.down_weight = nn.Parameter(
            torch.empty(config.hidden_size, config.intermediate_size, **kw), requires_grad=False
        )

    def forward(self, x: torch.Tensor, lora: Optional["LoRABatch"] = None) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = projection(self, "gate_up_weight", x, None, lora).split(self.intermediate_size, dim=-1)
        return projection(self, "down_weight", F.silu(gate) * up, None, lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.post_attention_norm = nn.Parameter(
            torch.empty(config.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.attn = Attention(config, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: Optional[torch.Tensor],  # [num_tokens, hidden], None for the first layer
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: Optional["LoRABatch"] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, _ = kernels.rms_norm(x, self.input_norm, self.eps)
            residual = x
        else:
            h, residual = kernels.rms_norm(x, self.input_norm, self.eps, residual)
        h = self.attn(h, positions, cos_sin_cache, kv_cache, meta, lora)
        h, residual = kernels.rms_norm(h, self.post_attention_norm, self.eps, residual)
        return self.mlp(h, lora), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. Parameters are uninitialised until ``load_weights``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, **kw), requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False)
        # Kept in float32 whatever the model dtype: the kernels upcast anyway, and a bf16
        # table would round the angles of long positions.
        self.register_buffer("cos_sin_cache", make_cos_sin_cache(config, self.device), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
        lora: Optional["LoRABatch"] = None,  # per-token adapter slots (models/lora.py); None: base model
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Run one step; writes this step's K/V into ``kv_caches`` and returns final hidden states."""
        assert len(kv_caches) == len(self.layers), f"need {len(self.layers)} KV caches, got {len(kv_caches)}"
        h = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, self.cos_sin_cache, kv_cache, meta, lora)
        h, _ = kernels.rms_norm(h, self.norm, self.config.rms_norm_eps, residual)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab] fp32
        return F.linear(hidden, self.lm_head).float()

    # ---- weights -------------------------------------------------------------------------

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face parameter names this model needs from a checkpoint."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            names |= {p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
            names |= {p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
            if self.config.attention_bias:
                names |= {p + f"self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj")}
            if self.config.o_proj_bias:
                names.add(p + "self_attn.o_proj.bias")
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Args:
            weights: ``(name, tensor)`` pairs; names this model does not use are skipped.
        Returns:
            the names that were loaded (the caller compares with ``expected_weight_names``).
        Raises:
            ValueError: a tensor's shape does not match the config.
        """
        expected = self.expected_weight_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in expected:
                continue
            target, rows = self._weight_target(name)
            want = tuple(target[rows].shape)
            if want != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the config's {want}")
            target[rows].copy_(tensor)
            loaded.add(name)
        return loaded

    def _weight_target(self, name: str) -> tuple[torch.Tensor, slice]:
        """The parameter (and the row range of it) that a Hugging Face name fills."""
        everything = slice(None)
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, everything
        if name == "model.norm.weight":
            return self.norm, everything
        if name == "lm_head.weight":
            return self.lm_head, everything
        parts = name.split(".")  # model.layers.<i>.<module>.<proj>.<weight|bias>
        layer = self.layers[int(parts[2])]
        attn, mlp = layer.attn, layer.mlp
        local = ".".join(parts[3:])
        q_rows = slice(0, attn.q_size)
        k_rows = slice(attn.q_size, attn.q_size + attn.kv_size)
        v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
        inter = mlp.intermediate_size
        table = {
            "input_layernorm.weight": (layer.input_norm, everything),
            "post_attention_layernorm.weight": (layer.post_attention_norm, everything),
            "self_attn.q_proj.weight": (attn.qkv_weight, q_rows),
            "self_attn.k_proj.weight": (attn.qkv_weight, k_rows),
            "self_attn.v_proj.weight": (attn.qkv_weight, v_rows),
            "self_attn.q_proj.bias": (attn.qkv_bias, q_rows),
            "self_attn.k_proj.bias": (attn.qkv_bias, k_rows),
            "self_attn.v_proj.bias": (attn.qkv_bias, v_rows),
            "self_attn.o_proj.weight": (attn.o_weight, everything),
            "self_attn.o_proj.bias": (attn.o_bias, everything),
            "mlp.gate_proj.weight": (mlp.gate_up_weight, slice(0, inter)),
            "mlp.up_proj.weight": (mlp.gate_up_weight, slice(inter, 2 * inter)),
            "mlp.down_proj.weight": (mlp.down_weight, everything),
        }
        return table[local]


def make_cos_sin_cache(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_position_embeddings, head_dim] float32: cos in the first half, sin in the second.

    Angles are computed in float32 the way Hugging Face computes them (position times
    inverse frequency), so the rotation matches transformers exactly.
    """
    inv_freq = config.inv_freq()  # [head_dim // 2]
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
