"""Gemma 4's MoE block (``enable_moe_block``): a router and GELU-tanh experts beside the dense MLP.

As transformers 5.24's ``Gemma4TextRouter`` / ``Gemma4TextExperts``, for ``T`` tokens of the
post-attention stream ``s``:

1. router: ``rmsnorm(s)`` (no weight) times ``scale * hidden^-0.5``, ``proj`` to ``E`` logits,
   softmax in float32, top-k, the k weights divided by their sum, times ``per_expert_scale`` of
   each chosen expert;
2. experts on ``pre_feedforward_layernorm_2(s)``: ``down(gelu_tanh(gate(x)) * up(x))`` from the
   stacked ``gate_up_proj [E, 2 * inter, hidden]`` / ``down_proj [E, hidden, inter]``, weighted,
   summed per token (``models.moe.group_by_expert`` groups the assignments);
3. ``post_feedforward_layernorm_2`` of the sum (the layer adds it to the dense MLP's normed output).

The experts run through ``kernels.moe_experts`` with ``activation="gelu_tanh"``: the fused Triton
kernels on CUDA (no host read in the step), the experts-with-tokens loop elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.models.config import ModelConfig
from pagoda.models.moe import group_by_expert


class Gemma4MoE(nn.Module):
    """Router plus stacked experts; ``forward(stream, norms)`` -> ``[T, hidden]``. Parameters uninitialised."""

    quantization_unsupported = "Gemma 4's MoE experts cannot be quantized at load"

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, experts, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.num_experts, self.top_k, self.eps = experts, config.num_experts_per_tok, config.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.router_weight = nn.Parameter(torch.empty(experts, hidden, **kw), requires_grad=False)
        self.router_scale = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(experts, **kw), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter, **kw), requires_grad=False)
        self.register_buffer("unit_norm", torch.ones(hidden, **kw), persistent=False)

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, object]]:
        every = slice(None)
        return {"router.proj.weight": (self.router_weight, every), "router.scale": (self.router_scale, every),
                "router.per_expert_scale": (self.per_expert_scale, every),
                "experts.gate_up_proj": (self.w13, every), "experts.down_proj": (self.w2, every)}

    def route(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` float32, expert ids ``[T, k]``) for the post-attention stream."""
        normed, _ = kernels.rms_norm(stream, self.unit_norm, self.eps)
        logits = F.linear(normed * self.router_scale * stream.shape[-1] ** -0.5, self.router_weight)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids

    def forward(self, stream: torch.Tensor, norms: nn.ParameterDict) -> torch.Tensor:
        weights, ids = self.route(stream)
        x, _ = kernels.rms_norm(stream, norms["pre_feedforward_layernorm_2"], self.eps)
        groups = group_by_expert(ids, weights, self.num_experts)
        out = kernels.moe_experts(x, groups.order, groups.weights, groups.offsets, self.w13, self.w2, self.top_k,
                                  activation="gelu_tanh")
        normed, _ = kernels.rms_norm(out, norms["post_feedforward_layernorm_2"], self.eps)
        return normed
