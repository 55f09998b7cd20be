"""Megatron-style tensor parallelism of a built decoder: ``shard_model(model, group)``.

Each rank keeps a slice of every matrix and the ranks meet in two all-reduces per layer
and one gather of the logits (Shoeybi et al., "Megatron-LM"; vLLM's ``ColumnParallel`` /
``RowParallelLinear``, SGLang's the same):

* ``qkv_weight`` is column-parallel by heads, cut along KV groups (``kv_head_range``):
  with ``K >= tp`` KV heads, rank ``r`` keeps KV heads ``[r*K//tp, (r+1)*K//tp)`` and the
  query heads of their groups — an uneven cut when ``tp`` does not divide ``K`` (the
  default model, 9 query / 3 KV heads, at tp=2: 1 and 2 KV groups, the second rank
  doing twice the attention; the MLP stays even). With ``K < tp`` (``tp % K == 0`` and
  ``H % tp == 0``) rank ``r`` keeps query heads ``[r*H/tp, (r+1)*H/tp)`` and the one KV
  head they read (``r*K // tp``), replicated on ``tp/K`` ranks. Either way a local query
  head reads the same KV head as in the whole model (vLLM and SGLang require ``tp | H``
  and refuse the uneven cut).
* ``o_weight`` is row-parallel (its input columns are the local heads); the partial
  products are summed by one all-reduce (``Attention.forward``). Its bias is kept on rank 0
  only (zeros elsewhere), so the sum adds it once.
* ``gate_up_weight`` is column-parallel by intermediate rows (the gate slice and the up
  slice of rank ``r``), ``down_weight`` row-parallel, one all-reduce (``MLP.forward``).
* the embedding is vocabulary-parallel (rows ``[r*V/tp, (r+1)*V/tp)``): ids outside the
  slice read zeros, one all-reduce; the LM head (tied or not) likewise: each rank computes
  its vocabulary slice of the logits and rank 0 gathers the full rows.
* norms, the rotary table and the residual stream are replicated.
* hybrid models (Qwen3-Next, Qwen3.5): gated attention as above, its ``q_proj`` rows taken
  per head with their gate rows (``query_rows_per_head`` 2); a Gated DeltaNet layer keeps
  ``Hk / tp`` key heads and the ``Hv / tp`` value heads they serve (its rows of q, k, v, z, b
  and a, its conv channels, ``A_log``, ``dt_bias``), ``out_proj`` row-parallel with one
  all-reduce, and a rank's state slots hold its heads only (``state_shapes`` after sharding).
* multi-head latent attention (DeepSeek-V3 / Kimi K2 / GLM-4.7-Flash, ``models.mla``): split by
  query heads (``H % tp == 0``): a rank keeps its heads' rows of ``q_b`` (or of the q part of
  ``qkv_a`` without a q rank) and of ``kv_b`` (``W_UK`` / ``W_UV``: the absorbed decode needs
  nothing else), its heads' columns of ``o_proj`` (one all-reduce); ``q_a``/``kv_a`` (the
  latent) are replicated, so every rank writes the same latent rows into its own latent cache
  (as vLLM: the latent is not split by heads; each rank holds the whole cache).
* mixture of experts (Mixtral, Qwen3-MoE, Qwen3-Next / Qwen3.5-MoE, GLM-4.5's DeepSeek MoE
  block): every expert is split as a SwiGLU MLP is, by intermediate rows (``w13``'s gate and up
  rows of the rank's slice, ``w2``'s columns of it), the router (and DeepSeek's correction bias,
  Qwen3-Next's shared-expert gate) replicated, so every rank routes every token alike and
  computes its slice of each chosen expert; a shared expert is split the same way, and the
  block's output (routed + shared partial sums) is summed by one all-reduce (``tp`` on the
  block, not on its shared MLP).

Invariants: the shards are exact slices of the whole model's tensors (so a model drawn or
loaded whole and then sharded computes what the whole model computes, up to the order of
the all-reduce's sum: ~1e-6 relative in fp32); the shapes are checked before anything is
changed, and a shape that does not divide raises ``ValueError`` naming the dimension.
Int8 weights (``quantize_model``, per-output-channel scales) are sharded after
quantization: row slices keep their scales, column slices keep all of them, so the
quantized shards equal slices of the quantized whole. LoRA adapters follow their base
projection (``lora_slices``): a column-parallel projection keeps B's rows of its outputs
(A whole), a row-parallel one keeps A's columns of its inputs (B whole), so each rank's
delta is its partial product and the layer's one all-reduce sums it with the base (the
slices are taken by ``models.lora.LoRASlots`` from ``tp_shards``, which this module sets). A
DeepSeek-format FP8 checkpoint kept as FP8 (``Fp8BlockWeight``, and experts with block scales)
is sharded as it is: a slice keeps its blocks' scales, so every slice must start and end on a
block boundary (``block``, 128: DeepSeek-V3's every per-rank slice at TP 8 does); one that does
not is refused naming the weight and the sizes. Families with other pieces (Gemma 3, gpt-oss),
per-tensor fp8 and int4 weights are refused for now.

This module never imports the engine: ``group`` is anything with ``rank``, ``size``,
``all_reduce(t)`` (in place, sum) and ``gather_logits(t)`` (rank 0: the slices
concatenated on the last dimension; others: an empty tensor).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pagoda.models.config import ModelConfig
from pagoda.models.deepseek_v3 import DeepseekMoE
from pagoda.models.fp8 import Fp8BlockWeight
from pagoda.models.gated_deltanet import GatedDeltaNet
from pagoda.models.glm4_moe import Glm4MoeAttention
from pagoda.models.llama import MLP, Attention, LlamaForCausalLM
from pagoda.models.mla import MLAttention
from pagoda.models.moe import SparseMoE
from pagoda.models.qwen3 import Qwen3Attention
from pagoda.models.qwen3_next import GatedAttention, SharedExpertMoE
from pagoda.models.quant import Int8Weight

_ATTENTION_TYPES = (Attention, Qwen3Attention, GatedAttention, Glm4MoeAttention, MLAttention)
_FEED_FORWARD_TYPES = (MLP, SparseMoE, DeepseekMoE, SharedExpertMoE)


class TensorParallelGroup(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_logits(self, tensor: torch.Tensor) -> torch.Tensor: ...


def check_divisible(config: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the first dimension that ``tp`` ranks cannot split."""
    if config.layer_kv_shapes is not None or config.kv_source_layers is not None:
        raise ValueError(f"tensor_parallel_size={tp}: {config.architecture}'s layers differ in KV shape or share "
                         "KV caches (Gemma 4); its attention, per-layer inputs and MoE block are not sharded yet")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    few_kv = kv_heads < tp
    checks = (("num_key_value_heads", kv_heads, not few_kv or tp % kv_heads == 0,
               "divide the tensor-parallel size when smaller than it"),
              ("num_attention_heads", heads, not few_kv or heads % tp == 0, "be divisible by the tensor-parallel size"),
              ("intermediate_size", config.intermediate_size, config.intermediate_size % tp == 0,
               "be divisible by the tensor-parallel size"),
              ("vocab_size", config.vocab_size, config.vocab_size % tp == 0,
               "be divisible by the tensor-parallel size"))
    if config.num_experts:
        checks += tuple((name, value, value % tp == 0, "be divisible by the tensor-parallel size") for name, value in
                        (("moe_intermediate_size", config.moe_intermediate_size),
                         ("shared_expert_intermediate_size", config.shared_expert_intermediate_size)))
    if config.mla is not None:  # latent attention is split by query heads alone
        checks += (("num_attention_heads", heads, heads % tp == 0, "be divisible by the tensor-parallel size"),)
    if config.linear_attention is not None:
        heads = config.linear_attention.num_key_heads
        checks += (("linear_num_key_heads", heads, heads % tp == 0, "be divisible by the tensor-parallel size"),)
    for name, value, ok, rule in checks:
        if not ok:
            raise ValueError(f"tensor_parallel_size={tp}: {name}={value} must {rule}")


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) rank ``rank`` holds: its KV cache's head dimension is the count."""
    if num_kv_heads < tp:
        return rank * num_kv_heads // tp, 1
    first = rank * num_kv_heads // tp
    return first, (rank + 1) * num_kv_heads // tp - first


def q_head_range(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first query head, count) rank ``rank`` holds."""
    if num_kv_heads < tp:
        return rank * (num_heads // tp), num_heads // tp
    group = num_heads // num_kv_heads
    first_kv, count = kv_head_range(num_kv_heads, tp, rank)
    return first_kv * group, count * group


def _rows(tensor, rows: torch.Tensor):
    """Output rows ``rows`` of a weight or bias (an int8 weight keeps those rows' scales, an FP8
    block weight its row blocks' scales)."""
    if isinstance(tensor, Int8Weight):
        tensor.qweight = tensor.qweight[rows].contiguous()
        tensor.scale = tensor.scale[rows].contiguous()
        tensor.packed_scale = tensor.packed_scale[rows].contiguous()
        return tensor
    if isinstance(tensor, Fp8BlockWeight):
        tensor.scale = tensor.scale[_whole_blocks(rows, tensor.block, tensor.shape[0], "rows")].contiguous()
        tensor.qweight = tensor.qweight[rows].contiguous()
        return tensor
    return nn.Parameter(tensor.data[rows].contiguous(), requires_grad=False)


def _cols(tensor, lo: int, hi: int):
    """Input columns ``[lo, hi)`` of a weight (an int8 weight keeps every per-row scale, an FP8
    block weight its column blocks' scales)."""
    if isinstance(tensor, Int8Weight):
        tensor.qweight = tensor.qweight[:, lo:hi].contiguous()
        return tensor
    if isinstance(tensor, Fp8BlockWeight):
        blocks = _whole_blocks(torch.arange(lo, hi), tensor.block, tensor.shape[1], "columns")
        tensor.scale = tensor.scale[:, blocks].contiguous()
        tensor.qweight = tensor.qweight[:, lo:hi].contiguous()
        return tensor
    return nn.Parameter(tensor.data[:, lo:hi].contiguous(), requires_grad=False)


def _whole_blocks(index: torch.Tensor, block: int, size: int, what: str) -> torch.Tensor:
    """The blocks ``index`` (ascending runs) covers, each whole (the last block of ``size`` may be
    partial); raises ValueError naming the first slice that cuts a block."""
    blocks = torch.unique_consecutive(index // block)
    expected = sum(min(block, size - b * block) for b in blocks.tolist())
    if expected != index.numel():
        raise ValueError(f"tensor parallelism: an FP8 weight's {block}x{block} scale blocks cannot be split: this "
                         f"rank's {index.numel()} {what} of {size} do not fall on whole blocks (each rank's "
                         f"slice of heads / intermediate rows must be a multiple of {block})")
    return blocks


def _shard_attention(attn: Attention, group: TensorParallelGroup) -> None:
    rank, tp, dim = group.rank, group.size, attn.head_dim
    first_q, heads = q_head_range(attn.num_heads, attn.num_kv_heads, tp, rank)
    first_kv, kv_heads = kv_head_range(attn.num_kv_heads, tp, rank)
    per = attn.query_rows_per_head  # gated attention: each head's query rows, then its gate rows
    q = torch.arange(first_q * dim * per, (first_q + heads) * dim * per)
    k = per * attn.q_size + torch.arange(first_kv * dim, (first_kv + kv_heads) * dim)
    rows = torch.cat([q, k, k + attn.kv_size])
    attn.qkv_weight = _rows(attn.qkv_weight, rows)
    if attn.qkv_bias is not None:
        attn.qkv_bias = _rows(attn.qkv_bias, rows)
    attn.o_weight = _cols(attn.o_weight, first_q * dim, (first_q + heads) * dim)
    if attn.o_bias is not None and rank != 0:
        attn.o_bias.data.zero_()
    attn.tp_shards = {"qkv_weight": ("rows", rows), "o_weight": ("cols", (first_q * dim, (first_q + heads) * dim))}
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * dim, kv_heads * dim
    attn.tp = group


def _shard_latent_attention(attn: MLAttention, group: TensorParallelGroup) -> None:
    """Query heads ``[r*H/tp, (r+1)*H/tp)``: their rows of q and ``kv_b``, their ``o_proj`` columns."""
    mla, rank = attn.shape, group.rank
    heads = attn.num_heads // group.size
    first = rank * heads

    def per_head(size: int) -> torch.Tensor:  # this rank's rows of a [H * size, ...] weight
        return torch.arange(first * size, (first + heads) * size)

    q_rows = per_head(mla.qk_head_dim)
    if mla.q_lora_rank is not None:
        attn.q_b_weight = _rows(attn.q_b_weight, q_rows)
    else:  # qkv_a holds q_proj's rows, then the latent's (replicated)
        latent = attn.q_rows + torch.arange(mla.latent_dim)
        attn.qkv_a_weight = _rows(attn.qkv_a_weight, torch.cat([q_rows, latent]))
        attn.q_rows = heads * mla.qk_head_dim
    attn.kv_b_weight = _rows(attn.kv_b_weight, per_head(mla.qk_nope_head_dim + mla.v_head_dim))
    attn.o_weight = _cols(attn.o_weight, first * mla.v_head_dim, (first + heads) * mla.v_head_dim)
    attn.num_heads = heads
    attn.tp = group


def _shard_mlp(mlp: MLP, group: TensorParallelGroup) -> None:
    inter = mlp.intermediate_size // group.size
    lo = group.rank * inter
    rows = torch.cat([torch.arange(lo, lo + inter), mlp.intermediate_size + torch.arange(lo, lo + inter)])
    mlp.gate_up_weight = _rows(mlp.gate_up_weight, rows)
    mlp.down_weight = _cols(mlp.down_weight, lo, lo + inter)
    mlp.tp_shards = {"gate_up_weight": ("rows", rows), "down_weight": ("cols", (lo, lo + inter))}
    mlp.intermediate_size = inter
    mlp.tp = group


def _shard_experts(moe: SparseMoE, group: TensorParallelGroup) -> None:
    """Every expert's slice of intermediate rows, as ``_shard_mlp`` cuts one MLP."""
    inter = moe.intermediate_size // group.size
    lo = group.rank * inter
    rows = torch.cat([torch.arange(lo, lo + inter), moe.intermediate_size + torch.arange(lo, lo + inter)])
    if moe.block_scales is not None:  # e4m3 stacks: their scale blocks of the same rows / columns
        s13, s2, block = moe.block_scales
        moe.w13_scale = s13[:, _whole_blocks(rows, block, s13.shape[1] * block, "expert rows")].contiguous()
        moe.w2_scale = s2[:, :, _whole_blocks(torch.arange(lo, lo + inter), block, moe.intermediate_size,
                                              "expert columns")].contiguous()
        moe.block_scales = (moe.w13_scale, moe.w2_scale, block)
        moe.w13, moe.w2 = moe.w13[:, rows].contiguous(), moe.w2[:, :, lo:lo + inter].contiguous()
    else:
        moe.w13 = nn.Parameter(moe.w13.data[:, rows].contiguous(), requires_grad=False)
        moe.w2 = nn.Parameter(moe.w2.data[:, :, lo:lo + inter].contiguous(), requires_grad=False)
    moe.intermediate_size = inter


def _shard_feed_forward(mlp: nn.Module, group: TensorParallelGroup) -> None:
    """A dense MLP (its own all-reduce), or an MoE block: its experts and shared expert split,
    one all-reduce for the block (the shared MLP's own left off)."""
    if type(mlp) is MLP:
        _shard_mlp(mlp, group)
        return
    routed = mlp.experts if isinstance(mlp, SharedExpertMoE) else mlp
    _shard_experts(routed, group)
    shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
    if shared is not None:
        _shard_mlp(shared, group)
        shared.tp = None  # summed with the routed experts' partial sums, by the block
    mlp.tp = group


def _shard_linear_attention(la: GatedDeltaNet, group: TensorParallelGroup) -> None:
    rank, tp = group.rank, group.size
    k_heads, v_heads = la.num_k_heads // tp, la.num_v_heads // tp
    starts = [0]
    for size in la.block_sizes():
        starts.append(starts[-1] + size)

    def heads(block: int, count: int, size: int) -> torch.Tensor:  # this rank's rows of one block
        return starts[block] + torch.arange(rank * count * size, (rank + 1) * count * size)

    q, k = heads(0, k_heads, la.head_k_dim), heads(1, k_heads, la.head_k_dim)
    v, z = heads(2, v_heads, la.head_v_dim), heads(3, v_heads, la.head_v_dim)
    b, a = heads(4, v_heads, 1), heads(5, v_heads, 1)
    own = torch.arange(rank * v_heads, (rank + 1) * v_heads)  # this rank's value heads
    la.in_proj_weight = _rows(la.in_proj_weight, torch.cat([q, k, v, z, b, a]))
    la.conv_weight = _rows(la.conv_weight, torch.cat([q, k, v]))
    la.dt_bias, la.A_log = _rows(la.dt_bias, own), _rows(la.A_log, own)
    la.out_proj_weight = _cols(la.out_proj_weight, rank * v_heads * la.head_v_dim, (rank + 1) * v_heads * la.head_v_dim)
    la.num_k_heads, la.num_v_heads = k_heads, v_heads
    la.tp = group


def _check_supported(model: LlamaForCausalLM) -> None:
    for i, layer in enumerate(model.layers):
        mixer = layer.linear_attn if getattr(layer, "is_linear", False) else layer.attn
        known = type(mixer) in (GatedDeltaNet, MLAttention) or (type(mixer) in _ATTENTION_TYPES and mixer.sinks is None)
        if not known or type(layer.mlp) not in _FEED_FORWARD_TYPES:
            raise ValueError(f"tensor parallelism: layer {i} of {type(model).__name__} has "
                             f"{type(mixer).__name__}/{type(layer.mlp).__name__}; only Llama/Qwen/GLM "
                             "attention, latent attention, Gated DeltaNet, SwiGLU MLPs and SwiGLU experts are "
                             "sharded so far")
        for piece in (mixer, layer.mlp):
            for name in getattr(piece, "linear_weights", ()):
                weight = getattr(piece, name)
                if not isinstance(weight, (nn.Parameter, Int8Weight, Fp8BlockWeight)):
                    raise ValueError(f"tensor parallelism: {type(weight).__name__} weights ({name}) are not "
                                     "sharded yet; use quantization=None or 'int8', or a block-scaled FP8 "
                                     "checkpoint")


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, group: TensorParallelGroup) -> LlamaForCausalLM:
    """Keep ``group.rank``'s shard of every tensor of ``model`` (in place) and wire its collectives.

    Raises:
        ValueError: a dimension ``group.size`` does not divide, or a piece not sharded yet.
    """
    check_divisible(model.config, group.size)
    _check_supported(model)
    for layer in model.layers:
        if getattr(layer, "is_linear", False):
            _shard_linear_attention(layer.linear_attn, group)
        elif isinstance(layer.attn, MLAttention):
            _shard_latent_attention(layer.attn, group)
        else:
            _shard_attention(layer.attn, group)
        _shard_feed_forward(layer.mlp, group)
    vocab = model.config.vocab_size // group.size
    lo = group.rank * vocab
    tied = model.lm_head is model.embed_tokens
    model.embed_tokens = nn.Parameter(model.embed_tokens.data[lo:lo + vocab].contiguous(), requires_grad=False)
    model.lm_head = model.embed_tokens if tied else nn.Parameter(
        model.lm_head.data[lo:lo + vocab].contiguous(), requires_grad=False)
    model.vocab_start = lo
    model.tp = group
    return model
