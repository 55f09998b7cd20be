"""Sparse Mixture-of-Experts feed-forward block (Mixtral, Qwen3-MoE): routing, grouping, experts.

DeepSeek-V3's router (``route_grouped``, ``GroupedRouter``) replaces step 1's softmax with
sigmoid scores, a correction bias that only chooses, and a top-k limited to the best expert
groups; its weights then take the same steps 2-3.

One step, for ``T`` tokens, ``E`` experts, top-``k``:

1. ``route``: router logits ``x @ gate^T`` in the model dtype, softmax in float32, top-k,
   and (``renormalize``) the k weights divided by their sum, exactly as transformers'
   ``MixtralTopKRouter`` (always renormalises) and ``Qwen3MoeTopKRouter``
   (``norm_topk_prob``) do. The weights are then cast to the model dtype (Qwen3-MoE's
   rule; a no-op in float32).
2. ``group_by_expert``: the ``T * k`` (token, expert) assignments sorted by expert (stable,
   so tokens keep their order inside an expert) with per-expert counts and offsets
   (``offsets[e]:offsets[e + 1]`` are expert e's rows). Torch ops only (argsort,
   searchsorted; no ``bincount``, no ``.item()``), so it never waits on the device: a GPU
   kernel can take ``ExpertGroups`` as it is.
3. ``experts_forward`` -> ``kernels.moe_experts``: each token's routing-weighted sum of
   its experts' ``down(silu(gate(h)) * up(h))``, computing only the experts that received
   tokens: on CUDA the fused OpenAI-Triton kernels (``kernels/triton_moe.py``: grouped
   GEMMs over padded row blocks, no host read), elsewhere a loop over the experts with
   tokens (its offsets read back once per layer, free on CPU), summed in expert order as
   transformers does.

Weights are stacked per layer, never one module per expert: ``gate_weight [E, hidden]``,
``w13 [E, 2 * inter, hidden]`` (gate rows, then up rows) and ``w2 [E, hidden, inter]``.
``MoENames`` maps a family's Hugging Face tensor names onto them.

FP8 experts: a DeepSeek-format checkpoint's e4m3 experts with 128 x 128 block scales stay FP8
(``SparseMoE.keep_fp8``, installed by ``models.int4.install_fp8_experts``): the fused kernels read
one byte per weight. Not supported (refused, never silently skipped): LoRA on expert weights
(``models/lora`` refuses the adapter) and int8/fp8 quantization of float experts at load
(``quantize_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.models.config import ModelConfig


@dataclass(frozen=True)
class MoENames:
    """Hugging Face names of one sparse block, relative to ``model.layers.<i>.``."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str  # an expert's gate projection: "gate_proj" or "w1"
    up: str  # "up_proj" or "w3"
    down: str  # "down_proj" or "w2"


@dataclass
class ExpertGroups:
    """The step's (token, expert) assignments sorted by expert; all tensors on the device."""

    order: torch.Tensor  # [T * k] int64: assignment ids (t * k + j) in expert order
    weights: torch.Tensor  # [T * k]: their routing weights
    offsets: torch.Tensor  # [E + 1] int64: expert e's assignments are offsets[e]:offsets[e + 1]
    top_k: int

    @property
    def token_index(self) -> torch.Tensor:  # [T * k] int64: the token of each sorted assignment
        return self.order // self.top_k

    @property
    def counts(self) -> torch.Tensor:  # [E] int64: assignments per expert
        return self.offsets[1:] - self.offsets[:-1]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (weights ``[T, k]`` in the logits' dtype, expert ids ``[T, k]`` int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


@dataclass(frozen=True)
class GroupedRouter:
    """DeepSeek-V3's router: sigmoid scores plus a per-expert correction bias choose the experts
    (only among the ``topk_groups`` of ``num_groups`` expert groups whose two best biased scores
    sum highest); the chosen experts' unbiased scores, renormalised with ``norm_topk_prob``, times
    ``routed_scaling_factor``, weigh them."""

    num_groups: int
    topk_groups: int
    routed_scaling_factor: float

    def check(self, num_experts: int, top_k: int) -> None:
        """Raises ValueError naming a field whose value cannot route ``top_k`` of ``num_experts``."""
        per_group = num_experts // max(self.num_groups, 1)
        if self.num_groups < 1 or num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"n_group={self.num_groups} must divide n_routed_experts={num_experts} and "
                             f"1 <= topk_group={self.topk_groups} <= n_group")
        if top_k > self.topk_groups * per_group or (per_group < 2 and self.num_groups > 1):
            raise ValueError(f"num_experts_per_tok={top_k} must fit topk_group={self.topk_groups} groups of "
                             f"{per_group} experts (at least 2 per group: a group scores its best two)")


def route_grouped(router_logits: torch.Tensor, correction_bias: torch.Tensor, router: GroupedRouter, top_k: int,
                  renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited top-k over float32 ``[T, E]`` logits (``GroupedRouter``), as
    transformers' ``DeepseekV3TopkRouter`` computes it: (weights ``[T, k]`` in ``dtype``, ids ``[T, k]``)."""
    scores = router_logits.sigmoid()
    biased = scores + correction_bias
    num_tokens, num_experts = biased.shape
    grouped = biased.view(num_tokens, router.num_groups, num_experts // router.num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]: each group's best two
    chosen = torch.topk(group_scores, k=router.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    biased = biased.masked_fill(~keep.repeat_interleave(num_experts // router.num_groups, dim=1), float("-inf"))
    ids = torch.topk(biased, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * router.routed_scaling_factor).to(dtype), ids


def group_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the ``[T, k]`` assignments by expert, with offsets; no host synchronisation."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # first assignment of expert e (T * k for e = E)
    return ExpertGroups(order, topk_weights.reshape(-1)[order], offsets, topk_ids.shape[1])


def experts_forward(x: torch.Tensor, groups: ExpertGroups, w13: torch.Tensor, w2: torch.Tensor,
                    block_scales: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None) -> torch.Tensor:
    """``[T, hidden]`` -> ``[T, hidden]``: the routing-weighted sum of each token's experts
    (``block_scales``: e4m3 stacks' scales, ``SparseMoE.keep_fp8``)."""
    return kernels.moe_experts(x, groups.order, groups.weights, groups.offsets, w13, w2, groups.top_k,
                               block_scales=block_scales)


class SparseMoE(nn.Module):
    """Router plus stacked experts; ``forward(x)`` -> ``[T, hidden]``. Parameters uninitialised."""

    quantization_unsupported = "MoE expert weights cannot be quantized at load (int8/fp8 --quantization of experts " \
        "is not implemented; a DeepSeek-format FP8 checkpoint's experts are served as FP8)"
    block_scales: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None  # set by keep_fp8
    tp = None  # the tensor-parallel group once sharded (models.tensor_parallel): the block's all-reduce
    # The checkpoint stacks the experts (``experts.gate_up_proj`` / ``experts.down_proj``, as
    # Qwen3-VL-MoE's does) instead of one tensor per expert; set by the model's ``match_checkpoint``.
    fused_checkpoint = False

    def __init__(self, config: ModelConfig, names: MoENames, renormalize: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.names = names
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = renormalize
        self.intermediate_size = inter = config.moe_intermediate_size
        hidden, experts = config.hidden_size, config.num_experts
        kw = dict(dtype=dtype, device=device)
        self.gate_weight = nn.Parameter(torch.empty(experts, hidden, **kw), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor, lora: Optional[object] = None) -> torch.Tensor:
        """``lora`` is accepted for the layer's signature; adapters never target experts (refused at load)."""
        weights, ids = route(F.linear(x, self.gate_weight), self.top_k, self.renormalize)
        out = experts_forward(x, group_by_expert(ids, weights, self.num_experts), self.w13, self.w2,
                              self.block_scales)
        return self.tp.all_reduce(out) if self.tp is not None else out

    @torch.no_grad()
    def keep_fp8(self, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, block: int) -> None:
        """Serve the experts from e4m3 stacks with square block scales (a DeepSeek-format FP8
        checkpoint's bytes: ``w13 [E, 2 * inter, hidden]``, ``s13 [E, 2 * inter / block,
        cdiv(hidden, block)]``, ``w2``, ``s2`` likewise), in place of the float stacks."""
        device = self.w13.device
        del self.w13, self.w2
        self.register_buffer("w13", w13.to(device))
        self.register_buffer("w2", w2.to(device))
        self.register_buffer("w13_scale", s13.float().to(device))
        self.register_buffer("w2_scale", s2.float().to(device))
        self.block_scales = (self.w13_scale, self.w2_scale, block)

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, object]]:
        n, inter = self.names, self.intermediate_size
        table: dict[str, tuple[torch.Tensor, object]] = {f"{n.block}.gate.weight": (self.gate_weight, slice(None))}
        if self.fused_checkpoint:  # [E, 2 * inter, hidden] (gate rows first) and [E, hidden, inter]: w13 and w2
            return {**table, f"{n.block}.experts.gate_up_proj": (self.w13, slice(None)),
                    f"{n.block}.experts.down_proj": (self.w2, slice(None))}
        for e in range(self.num_experts):
            p = f"{n.block}.experts.{e}."
            table[p + f"{n.gate}.weight"] = (self.w13, (e, slice(0, inter)))
            table[p + f"{n.up}.weight"] = (self.w13, (e, slice(inter, 2 * inter)))
            table[p + f"{n.down}.weight"] = (self.w2, (e, slice(None)))
        return table
