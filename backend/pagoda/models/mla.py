"""Multi-head latent attention (MLA): DeepSeek-V3's (and Kimi K2's) attention over a latent KV cache.

As transformers' ``DeepseekV3Attention``, per token ``x`` (``H`` heads; sizes in ``MLAShape``):

1. ``q = q_b(rmsnorm(q_a(x)))`` (or ``q_proj(x)`` without a q rank), per head ``[q_nope | q_pe]``;
   ``[c | k_pe] = kv_a(x)``, ``c = rmsnorm(c)`` (the latent, ``kv_lora_rank`` wide), ``k_pe`` one
   rope key for every head. ``q_a`` and ``kv_a`` read the same input: one fused matmul
   (``qkv_a_weight``: q's rows, then the latent's);
2. rotary on ``q_pe`` and ``k_pe`` (DeepSeek's checkpoints pair adjacent dimensions,
   ``rope_interleave``: they are reordered to halves first, which is the same rotation of the
   same pairs, so the shared kernel applies); YaRN's cos/sin factor comes with the rotary
   table (``llama.make_cos_sin_cache``), its attention-scale correction here: the softmax scale
   is ``qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2`` (transformers' ``yarn_apply_mscale``);
3. the row ``[c | k_pe]`` is written to the layer's ``LatentCache`` (``kernels.write_latent``):
   ``kv_lora_rank + qk_rope_head_dim`` numbers per token, the cache spec
   ``engine.kv.specs.MLALatentSpec``;
4. attention (``kernels.reference_mla`` has the math): decode rows in the absorbed form (``W_UK`` folded into
   the query by a batched matmul over heads, ``kernels.mla_decode`` over the latent rows,
   ``W_UV`` applied after), prefill chunks in the expanded form (the context's rows through
   ``kv_b_proj`` into per-head keys and values, causal SDPA). ``W_UK`` / ``W_UV`` are views of
   ``kv_b_weight`` (``[H, nope + v, rank]``): no second copy;
5. ``o_proj``.

Quantization: ``qkv_a_weight``, ``q_b_weight`` and ``o_weight`` may become 8-bit or FP8 (block)
weights; ``kv_b_weight`` stays in the model dtype (the absorbed matmuls read it as views, as
vLLM dequantizes it at load). Tensor parallelism splits the heads (``models.tensor_parallel``:
``num_heads`` is then the rank's, ``tp`` its group: ``o_proj``'s partial sums are all-reduced).
Not supported (refused where they are set up): LoRA adapters (``models.lora``), ``attention_bias``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata, LatentCache
from pagoda.models.config import ModelConfig
from pagoda.models.llama import ALL, WeightTargets
from pagoda.models.quant import linear

if TYPE_CHECKING:
    from pagoda.models.lora import LoRABatch


def softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim^-0.5``, times YaRN's ``mscale(factor, mscale_all_dim)^2`` when the rope is scaled."""
    scale = config.mla.qk_head_dim ** -0.5
    scaling = config.rope_scaling or {}
    if config.rope_type != "default" and scaling.get("mscale_all_dim") and scaling.get("factor"):
        factor = scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., (a0 b0 a1 b1 ...)]`` -> ``[..., (a0 a1 ... b0 b1 ...)]``: adjacent pairs to halves."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    """Args: as ``llama.Attention`` (``window`` must be 0: no DeepSeek layer is windowed)."""

    linear_weights = ("qkv_a_weight", "q_b_weight", "o_weight")  # what quantization may replace
    tp = None

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__()
        assert window == 0, "multi-head latent attention has no sliding window"
        mla = config.mla
        self.shape = mla
        self.eps = config.rms_norm_eps
        self.num_heads = heads = config.num_attention_heads
        self.k_scale = 1.0  # the fp8 latent cache's scale (a checkpoint's k_scale; 1.0 otherwise)
        self.scale = softmax_scale(config)
        self.q_rows = mla.q_lora_rank if mla.q_lora_rank is not None else heads * mla.qk_head_dim
        kw = dict(dtype=dtype, device=device)

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.qkv_a_weight = param(self.q_rows + mla.latent_dim, config.hidden_size)
        if mla.q_lora_rank is not None:
            self.q_a_norm = param(mla.q_lora_rank)
            self.q_b_weight = param(heads * mla.qk_head_dim, mla.q_lora_rank)
        else:
            self.linear_weights = ("qkv_a_weight", "o_weight")
        self.kv_a_norm = param(mla.kv_lora_rank)
        self.kv_b_weight = param(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_weight = param(config.hidden_size, heads * mla.v_head_dim)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin_cache: torch.Tensor,  # [max_positions, qk_rope_head_dim]
        kv_cache: LatentCache,
        meta: AttentionMetadata,
        lora: Optional["LoRABatch"] = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        mla, heads, num_tokens = self.shape, self.num_heads, x.shape[0]
        q, latent = linear(x, self.qkv_a_weight).split([self.q_rows, mla.latent_dim], dim=-1)
        if mla.q_lora_rank is not None:
            q = linear(kernels.rms_norm(q.contiguous(), self.q_a_norm, self.eps)[0], self.q_b_weight)
        q_nope, q_pe = q.view(num_tokens, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim],
                                                                         dim=-1)
        c, k_pe = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = kernels.rms_norm(c.contiguous(), self.kv_a_norm, self.eps)[0]  # [T, rank]
        q_pe, k_pe = self.rotate(q_pe, k_pe.unsqueeze(1), positions, cos_sin_cache)
        cache = kv_cache.latent
        kv_scale = self.k_scale if cache.dtype == torch.float8_e4m3fn else 1.0
        kernels.write_latent(torch.cat([c, k_pe[:, 0]], dim=-1), cache, meta.slot_mapping, kv_scale)
        out = x.new_empty(num_tokens, heads, mla.v_head_dim)
        plan = kernels.mla_plan(meta, cache.shape[1], x.device)
        if plan.num_decodes:
            self._decode(q_nope, q_pe, cache, meta, plan, kv_scale, out)
        if plan.prefills:
            self._prefill(torch.cat([q_nope, q_pe], dim=-1), cache, plan, kv_scale, out)
        out = linear(out.view(num_tokens, heads * mla.v_head_dim), self.o_weight)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def _absorb_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``W_UK [H, nope, rank]``, ``W_UV [H, v, rank]``): views of ``kv_b_weight``."""
        mla = self.shape
        per_head = self.kv_b_weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return per_head[:, :mla.qk_nope_head_dim], per_head[:, mla.qk_nope_head_dim:]

    def _decode(self, q_nope, q_pe, cache, meta, plan, kv_scale, out) -> None:
        """The absorbed form for the plan's decode rows, into their rows of ``out`` ``[T, H, v]``."""
        rows = plan.decode_rows
        if rows is not None:
            q_nope, q_pe = q_nope.index_select(0, rows), q_pe.index_select(0, rows)
        w_uk, w_uv = self._absorb_views()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [D, H, rank]
        o_lat = kernels.mla_decode(q_lat.contiguous(), q_pe.contiguous(), cache, meta, plan, self.scale, kv_scale)
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [D, H, v]
        if rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, rows, o)

    def _prefill(self, q, cache, plan, kv_scale, out) -> None:
        """The expanded form for the plan's prefill chunks, into their rows of ``out``."""
        mla = self.shape
        context = kernels.mla_context(cache, plan, q.dtype, kv_scale)  # [S, rank + rope]
        num_ctx = context.shape[0]
        kv = F.linear(context[:, :mla.kv_lora_rank], self.kv_b_weight).view(
            num_ctx, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_pe = context[:, None, mla.kv_lora_rank:].expand(num_ctx, self.num_heads, mla.qk_rope_head_dim)
        k = torch.cat([kv[..., :mla.qk_nope_head_dim], k_pe], dim=-1)
        kernels.mla_prefill(q, k, kv[..., mla.qk_nope_head_dim:], plan, self.scale, out)

    def rotate(self, q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary on ``q_pe [T, H, rope]`` and ``k_pe [T, 1, rope]`` (pairs to halves first when interleaved)."""
        if self.shape.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        return kernels.apply_rotary(q_pe.contiguous(), k_pe.contiguous(), positions, cos_sin_cache)

    def weight_targets(self) -> WeightTargets:
        mla, rows = self.shape, self.q_rows
        table = {"self_attn.kv_a_proj_with_mqa.weight": (self.qkv_a_weight, slice(rows, rows + mla.latent_dim)),
                 "self_attn.kv_a_layernorm.weight": (self.kv_a_norm, ALL),
                 "self_attn.kv_b_proj.weight": (self.kv_b_weight, ALL),
                 "self_attn.o_proj.weight": (self.o_weight, ALL)}
        if mla.q_lora_rank is None:
            return {"self_attn.q_proj.weight": (self.qkv_a_weight, slice(0, rows)), **table}
        return {"self_attn.q_a_proj.weight": (self.qkv_a_weight, slice(0, rows)),
                "self_attn.q_a_layernorm.weight": (self.q_a_norm, ALL),
                "self_attn.q_b_proj.weight": (self.q_b_weight, ALL), **table}
