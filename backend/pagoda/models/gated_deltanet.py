"""The Gated DeltaNet layer (linear attention) of Qwen3-Next and Qwen3.5, over a flat step.

As transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``, per token ``x``:

1. one projection gives ``q, k`` (``Hk`` heads of ``Dk``), ``v, z`` (``Hv`` heads of ``Dv``),
   ``b`` and ``a`` (one per value head);
2. ``q, k, v`` (the ``conv_dim = 2 Hk Dk + Hv Dv`` channels) go through a causal depthwise
   conv1d of width ``K`` and SiLU (``kernels.causal_conv1d``, continuing the sequence's conv state);
3. ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32);
4. the gated delta rule (``kernels.gated_delta_rule``: q/k L2-normalised, q scaled by
   ``Dk^-0.5``, value head ``h`` reading key head ``h // (Hv / Hk)``), from and to the
   sequence's recurrent state;
5. per value head ``rmsnorm(o) * norm.weight * silu(z)`` (``kernels.gated_rms_norm``; a plain
   weight, not ``1 + w``), then ``out_proj``.

State (``state_shapes``, ``state_dtypes``): per sequence a conv state ``[conv_dim, K - 1]`` in
the model dtype (transformers keeps the conv inputs in the model dtype) and a recurrent state
``[Hv, Dk, Dv]`` in float32 (transformers' delta rule runs and returns it in float32).

Weights: the projection is stored fused as ``in_proj_weight`` with rows in one canonical
order ``[q | k | v | z | b | a]`` (q/k/v each head-major), so the conv input is a column
slice of one matmul's output. Qwen3.5 checkpoints hold ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` in that order already (``layout="split"``); Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba`` group the rows per key head (``[q_g, k_g, v_g, z_g]`` and
``[b_g, a_g]`` for each of the ``Hk`` groups, ``layout="qkvz"``), which ``canonical_rows``
reorders once at load. Because of that reordering the Qwen3-Next projection is not kept in a
checkpoint's packed 4-bit/FP8 form (``packed_unsupported``): it is dequantized and served in
float; int8/fp8 quantization at load (``quantize_model``) applies, to the reordered rows.

Tensor parallelism (``models.tensor_parallel``): heads split, ``Hk / tp`` key heads and the ``Hv / tp`` value
heads they serve per rank (its rows of every projection block, its conv channels, its
``A_log``/``dt_bias``), ``out_proj`` row-parallel with one all-reduce; a rank's state holds
its heads only. LoRA does not target these projections (``models.lora`` refuses hybrid models).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata, StateCache
from pagoda.models.config import ModelConfig
from pagoda.models.quant import linear

LAYOUTS = ("qkvz", "split")


class GatedDeltaNet(nn.Module):
    linear_weights = ("in_proj_weight", "out_proj_weight")  # what quantize_model may replace
    packed_unsupported: tuple[str, ...] = ()  # Qwen3-Next: ("in_proj_weight",), its rows reordered at load
    tp = None  # the tensor-parallel group once sharded: out_proj's all-reduce
    chunk_size = 64  # the chunked delta rule's chunk (a power of two >= 16 for the Triton kernel)

    def __init__(self, config: ModelConfig, layout: str, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"linear-attention layout {layout!r}: expected one of {LAYOUTS}")
        shape = config.linear_attention
        self.layout = layout
        self.packed_unsupported = ("in_proj_weight",) if layout == "qkvz" else ()
        self.dtype = dtype
        self.eps = config.rms_norm_eps
        self.num_k_heads, self.num_v_heads = shape.num_key_heads, shape.num_value_heads
        self.head_k_dim, self.head_v_dim = shape.key_head_dim, shape.value_head_dim
        self.kernel_size = shape.conv_kernel_size
        kw = dict(dtype=dtype, device=device)
        self.in_proj_weight = nn.Parameter(torch.empty(sum(self.block_sizes()), config.hidden_size, **kw),
                                           requires_grad=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel_size, **kw), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, **kw), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, **kw), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(self.head_v_dim, **kw), requires_grad=False)
        self.out_proj_weight = nn.Parameter(torch.empty(config.hidden_size, self.value_dim, **kw),
                                            requires_grad=False)

    # ---- sizes ---------------------------------------------------------------------------

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def block_sizes(self) -> list[int]:
        """Rows of ``in_proj_weight``'s blocks: q, k, v, z, b, a."""
        return [self.key_dim, self.key_dim, self.value_dim, self.value_dim, self.num_v_heads, self.num_v_heads]

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's ``(conv state shape, recurrent state shape)``, without the slot dimension."""
        return (self.conv_dim, self.kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """``(conv state dtype, recurrent state dtype)``: the model dtype and float32."""
        return self.dtype, torch.float32

    # ---- forward -------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        state: StateCache,
        meta: AttentionMetadata,
        lora: Optional[object] = None,  # accepted for the layer's signature; never set (refused at load)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if not isinstance(state, StateCache):
            raise ValueError(f"a linear-attention layer needs a StateCache (conv_states, ssm_states) as its cache, got "
                             f"{type(state).__name__}: the runner has not given this model state slots")
        num_tokens = x.shape[0]
        proj = linear(x, self.in_proj_weight)  # [num_tokens, conv_dim + value_dim + 2 * Hv]
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        conv = kernels.causal_conv1d(mixed, self.conv_weight[:, 0], None, state.conv_states, meta)
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.view(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.view(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b)  # the model dtype, as transformers
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [num_tokens, Hv] float32
        core = kernels.gated_delta_rule(q, k, v, g, beta, state.ssm_states, meta, self.chunk_size)
        normed = kernels.gated_rms_norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim),
                                        self.norm, self.eps)
        out = linear(normed.view(num_tokens, self.value_dim), self.out_proj_weight)
        return self.tp.all_reduce(out) if self.tp is not None else out

    # ---- weights -------------------------------------------------------------------------

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, object]]:
        """Hugging Face names under ``model.layers.<i>.`` -> where they load (after ``canonical_rows``)."""
        starts = [0]
        for size in self.block_sizes():
            starts.append(starts[-1] + size)
        q, z, b, end = starts[0], starts[3], starts[4], starts[6]
        p = "linear_attn."
        if self.layout == "qkvz":
            table = {p + "in_proj_qkvz.weight": (self.in_proj_weight, slice(q, b)),
                     p + "in_proj_ba.weight": (self.in_proj_weight, slice(b, end))}
        else:
            table = {p + "in_proj_qkv.weight": (self.in_proj_weight, slice(q, z)),
                     p + "in_proj_z.weight": (self.in_proj_weight, slice(z, b)),
                     p + "in_proj_b.weight": (self.in_proj_weight, slice(b, starts[5])),
                     p + "in_proj_a.weight": (self.in_proj_weight, slice(starts[5], end))}
        all_ = slice(None)
        return table | {p + "conv1d.weight": (self.conv_weight, all_), p + "dt_bias": (self.dt_bias, all_),
                        p + "A_log": (self.A_log, all_), p + "norm.weight": (self.norm, all_),
                        p + "out_proj.weight": (self.out_proj_weight, all_)}

    def canonical_rows(self, local_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor with its rows in ``in_proj_weight``'s order (module docstring);
        other tensors unchanged. A wrong row count is left for the loader's shape check."""
        group = self.num_v_heads // self.num_k_heads
        if local_name == "linear_attn.in_proj_qkvz.weight":
            sizes = [self.head_k_dim, self.head_k_dim, group * self.head_v_dim, group * self.head_v_dim]
        elif local_name == "linear_attn.in_proj_ba.weight":
            sizes = [group, group]
        else:
            return tensor
        if tensor.shape[0] != self.num_k_heads * sum(sizes):
            return tensor
        blocks = tensor.reshape(self.num_k_heads, sum(sizes), *tensor.shape[1:]).split(sizes, dim=1)
        return torch.cat([blk.reshape(-1, *tensor.shape[1:]) for blk in blocks])
