"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens and a paged KV cache.

This is also the decoder skeleton the other families build on (``qwen3``, ``mixtral``,
``qwen3_moe``, ``gemma3``): a family subclasses ``LlamaForCausalLM`` and swaps pieces through class
attributes (``layer_class``; a layer's ``attention_class`` and ``make_mlp``) rather than
branching here. Each piece names the Hugging Face tensors it holds (``weight_targets``),
so loading needs no per-family table. The family's ``parse_config`` reads its switches
(Qwen2: bias on q/k/v, never on o_proj; Llama: ``attention_bias`` on all four).

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

Auxiliary hidden states (EAGLE-3 drafts read them): with ``aux_layer_ids`` set, ``forward``
also keeps the residual stream entering each listed layer (``h + residual``; id 0 is the
embeddings, vLLM's numbering) concatenated in ``aux_hidden``, on the device. Empty (the
default), nothing is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import ModelConfig, common_fields, qwen_sliding_window
from pagoda.models.quant import linear

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]
# A Hugging Face tensor name (relative to its owner) -> (our parameter, the index of it that name fills).
WeightTargets = dict[str, tuple[torch.Tensor, object]]
ALL = slice(None)


def parse_config(raw: dict, architecture: str) -> ModelConfig:
    """Llama and Mistral: ``attention_bias`` puts a bias on q/k/v and o_proj."""
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(**common_fields(raw, architecture), attention_bias=bias, o_proj_bias=bias)


def parse_qwen2_config(raw: dict, architecture: str) -> ModelConfig:
    """Qwen2: a bias on q/k/v, never on o_proj; the sliding window only with ``use_sliding_window``."""
    fields = {**common_fields(raw, architecture), **qwen_sliding_window(raw)}
    return ModelConfig(**fields, attention_bias=True, o_proj_bias=False)


def projection(owner: nn.Module, name: str, x: torch.Tensor, bias: Optional[torch.Tensor],
               lora: Optional["LoRABatch"]) -> torch.Tensor:
    """``linear(x, owner.<name>, bias)``, plus the step's LoRA deltas when any token has an adapter."""
    out = linear(x, getattr(owner, name), bias)
    if lora is not None and lora.groups:
        a_stack, b_stack = owner.lora_stacks[name]
        kernels.lora_apply(out, x, a_stack, b_stack, lora)
    return out


def rotate_partial(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on the first ``rotary_dim`` dimensions of each head of q and k (halves style within
    them, transformers' partial rotary); the other dimensions pass through."""
    if rotary_dim == q.shape[-1]:
        return kernels.apply_rotary(q, k, positions, cos_sin_cache)
    q_rot, k_rot = kernels.apply_rotary(q[..., :rotary_dim].contiguous(), k[..., :rotary_dim].contiguous(), positions,
                                        cos_sin_cache)
    return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)


class Attention(nn.Module):
    linear_weights = ("qkv_weight", "o_weight")  # what quantize_model may replace
    query_rows_per_head = 1  # qkv_weight rows per query channel (gated attention adds a gate row: 2)
    tp = None  # the tensor-parallel group once sharded (models/tensor_parallel.py): o_proj's all-reduce

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__()
        self.window = window  # sliding window (0: full causal attention)
        self.sinks: Optional[torch.Tensor] = None  # per-head softmax sink logits (gpt-oss replaces it)
        # fp8 KV cache scales (stored = x / scale): 1.0, or a checkpoint's k_scale / v_scale
        # (pagoda.models.quant_checkpoint); a 16-bit or fp32 cache ignores them.
        self.k_scale, self.v_scale = 1.0, 1.0
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
        q, k = self.rotate(q, k, positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        # Write first: this step's queries attend to this step's keys through the cache.
        k_scale, v_scale = (self.k_scale, self.v_scale) if k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale,
                                      window=self.window, sinks=self.sinks)  # [T, heads, dim]
        out = projection(self, "o_weight", out.reshape(num_tokens, self.q_size), self.o_bias, lora)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q [num_tokens, heads, head_dim] and k (a family may norm them first)."""
        return kernels.apply_rotary(q, k, positions, cos_sin_cache)

    def weight_targets(self) -> WeightTargets:
        q_rows = slice(0, self.q_size)
        k_rows = slice(self.q_size, self.q_size + self.kv_size)
        v_rows = slice(self.q_size + self.kv_size, self.q_size + 2 * self.kv_size)
        table = {"self_attn.q_proj.weight": (self.qkv_weight, q_rows),
                 "self_attn.k_proj.weight": (self.qkv_weight, k_rows),
                 "self_attn.v_proj.weight": (self.qkv_weight, v_rows),
                 "self_attn.o_proj.weight": (self.o_weight, ALL)}
        if self.qkv_bias is not None:
            table |= {"self_attn.q_proj.bias": (self.qkv_bias, q_rows),
                      "self_attn.k_proj.bias": (self.qkv_bias, k_rows),
                      "self_attn.v_proj.bias": (self.qkv_bias, v_rows)}
        if self.o_bias is not None:
            table["self_attn.o_proj.bias"] = (self.o_bias, ALL)
        return table


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up in one matmul."""

    linear_weights = ("gate_up_weight", "down_weight")
    tp = None  # the tensor-parallel group once sharded: down_proj's all-reduce

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
        gate_up = projection(self, "gate_up_weight", x, None, lora)  # [num_tokens, 2 * intermediate]
        out = projection(self, "down_weight", kernels.silu_mul(gate_up), None, lora)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def weight_targets(self) -> WeightTargets:
        inter = self.intermediate_size
        return {"mlp.gate_proj.weight": (self.gate_up_weight, slice(0, inter)),
                "mlp.up_proj.weight": (self.gate_up_weight, slice(inter, 2 * inter)),
                "mlp.down_proj.weight": (self.down_weight, ALL)}


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward. ``attention_class`` and ``make_mlp`` are a family's seams."""

    attention_class = Attention

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.post_attention_norm = nn.Parameter(
            torch.empty(config.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.attn = self.attention_class(config, dtype, device, window=config.layer_window(layer_idx))
        self.mlp = self.make_mlp(config, layer_idx, dtype, device)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
        """The feed-forward block of layer ``layer_idx`` (a MoE family returns its sparse block)."""
        return MLP(config, dtype, device)

    def weight_targets(self) -> WeightTargets:
        """Hugging Face names under ``model.layers.<i>.`` -> where they load."""
        return {"input_layernorm.weight": (self.input_norm, ALL),
                "post_attention_layernorm.weight": (self.post_attention_norm, ALL),
                **self.attn.weight_targets(), **self.mlp.weight_targets()}

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
        h, residual = self.input_normed(x, residual)
        h = self.attn(h, positions, cos_sin_cache, kv_cache, meta, lora)
        h, residual = kernels.rms_norm(h, self.post_attention_norm, self.eps, residual)
        return self.mlp(h, lora), residual

    def input_normed(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm, fused with the add of the previous layer's residual (the first
        layer has none: its input is the residual)."""
        if residual is None:
            h, _ = kernels.rms_norm(x, self.input_norm, self.eps)
            return h, x
        return kernels.rms_norm(x, self.input_norm, self.eps, residual)



def copy_checked(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor ``name`` into ``target`` (a parameter or a view of its rows).

    Raises:
        ValueError: naming the tensor, when its shape is not the config's.
    """
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the config's {tuple(target.shape)}")
    target.copy_(tensor)

class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. Parameters are uninitialised until ``load_weights``."""

    layer_class = DecoderLayer
    tp = None  # the tensor-parallel group once sharded: vocabulary-parallel embedding and LM head
    vocab_start = 0  # the first vocabulary row this rank holds

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(self.layer_class(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, **kw), requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False)
        # Kept in float32 whatever the model dtype: the kernels upcast anyway, and a bf16
        # table would round the angles of long positions.
        self.register_buffer("cos_sin_cache", make_cos_sin_cache(config, self.device), persistent=False)
        # EAGLE-3 (engine/spec_decode/eagle3.py): the residual stream entering these layers
        # (id 0: the embeddings) is kept, concatenated, in ``aux_hidden`` after each forward.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: Optional[torch.Tensor] = None  # [num_tokens, len(aux_layer_ids) * hidden]

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
        h = self.embed(input_ids)
        residual = None
        aux = {}
        for idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if idx in self.aux_layer_ids:
                aux[idx] = h if residual is None else h + residual
            h, residual = layer(h, residual, positions, self.cos_sin_cache, kv_cache, meta.for_layer(idx), lora)
        if aux:
            self.aux_hidden = torch.cat([aux[idx] for idx in self.aux_layer_ids], dim=-1)
        h, _ = kernels.rms_norm(h, self.norm, self.config.rms_norm_eps, residual)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        """The embedding rows of ``input_ids``; sharded, ids outside this rank's rows read zeros, summed."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed_tokens.shape[0])
        h = F.embedding(local.clamp(0, self.embed_tokens.shape[0] - 1), self.embed_tokens)
        return self.tp.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab] fp32
        """Sharded: every rank computes its vocabulary slice, rank 0 gets the whole rows (others: empty).
        ``config.final_logit_softcapping`` (Gemma): ``cap * tanh(logits / cap)``, element-wise."""
        logits = self.head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        return self.tp.gather_logits(logits) if self.tp is not None else logits

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ lm_head.T`` in the model dtype; through the CPU's prepacked copy when
        ``models.cpu_gemm.pack_model`` made one (``lm_head_packed``)."""
        return linear(hidden, getattr(self, "lm_head_packed", None) or self.lm_head)

    def mtp_layer_index(self) -> int:
        """The layer index a checkpoint's MTP block's decoder layer is built as (its window, its MLP
        kind; ``engine/spec_decode/mtp.py``): 0 here, a family whose block is another kind says so."""
        return 0

    # ---- weights -------------------------------------------------------------------------

    def match_checkpoint(self, names: set[str]) -> None:
        """Pick the checkpoint layout ``names`` (the checkpoint's tensor names) use, for a family
        whose checkpoints come in more than one (the default: one layout, nothing to pick)."""

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face parameter names this model needs from a checkpoint."""
        return set(self._weight_table())

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
        table = self._weight_table()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in table:
                continue
            target, rows = table[name]
            copy_checked(name, target[rows], tensor)
            loaded.add(name)
        return loaded

    def _weight_table(self) -> WeightTargets:
        """Every Hugging Face name this model loads -> (parameter, index into it)."""
        table: WeightTargets = {"model.embed_tokens.weight": (self.embed_tokens, ALL),
                                "model.norm.weight": (self.norm, ALL)}
        if not self.config.tie_word_embeddings:
            table["lm_head.weight"] = (self.lm_head, ALL)
        for i, layer in enumerate(self.layers):
            table |= {f"model.layers.{i}.{local}": target for local, target in layer.weight_targets().items()}
        return table


def make_cos_sin_cache(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_position_embeddings, rotary_dim] float32 (rotary_dim: head_dim unless a hybrid family
    rotates part of each head): cos in the first half, sin in the second.

    Angles are computed in float32 the way Hugging Face computes them (position times
    inverse frequency), so the rotation matches transformers exactly.
    """
    inv_freq = config.inv_freq()  # [head_dim // 2]
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
    cos, sin = angles.cos(), angles.sin()
    if config.rope_attention_factor != 1.0:  # YaRN scales both, as transformers does
        cos, sin = cos * config.rope_attention_factor, sin * config.rope_attention_factor
    return torch.cat((cos, sin), dim=-1).to(device)
