"""Gemma 4's image encoder: the vision tower and the embedder into the text model.

As transformers 5.24's ``Gemma4VisionModel`` and ``Gemma4MultimodalEmbedder``, for one image whose
processor output (``Gemma4ImageProcessorPil``) is ``pixel_values [1, max_patches, 3 * p * p]`` (flat
patches, padded to the budget) and ``image_position_ids [1, max_patches, 2]`` (each patch's (x, y)
on the patch grid; ``(-1, -1)`` marks padding):

- only the real patches are encoded: padding is masked out of every key in transformers'
  bidirectional encoder and its rows are dropped at the end, so encoding the real patches alone
  is the same function;
- patch embedding: ``input_proj(2 * (pixels - 0.5))`` plus the learned x and y position rows
  (``position_embedding_table[0][x] + position_embedding_table[1][y]``);
- encoder blocks: Gemma's sandwich norms (``x * w`` RMS norms in float32, four per block),
  attention with per-head q/k norms, a scale-free v norm, softmax scale 1, 2-D axial rotary
  (the first half of each head turns with x, the second with y, each rotate-half over
  ``head_dim / 4`` frequencies ``theta ** (-4i / head_dim)``), every patch seeing every patch,
  and a GELU-tanh gated MLP; with ``use_clipped_linears`` each linear clamps its input and output
  to the checkpoint's ``input_min/max`` / ``output_min/max``;
- pooler: patches averaged over ``k x k`` squares by position (``k = pooling_kernel_size``;
  soft token ``x // k + (width // k) * (y // k)``, so ``real patches / k**2`` soft tokens, row
  major), times ``sqrt(hidden)``, in float32; with ``standardize``, ``(h - std_bias) * std_scale``;
- embedder: a scale-free RMS norm, then ``embedding_projection`` to the text model's width.

Parameters carry transformers' names under the tower (``patch_embedder.input_proj.weight``,
``encoder.layers.{i}.self_attn.q_proj.linear.weight``, ...) and the embedder
(``embedding_projection.weight``); ``models/gemma4_vl.py`` maps the checkpoint's prefixes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATION = "gelu_pytorch_tanh"
_CLIPS = ("input_min", "input_max", "output_min", "output_max")


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMS norm over the last dimension, in float32, times ``weight`` (not ``1 + weight``).

    Args:
        x: any shape ``[..., d]``.
        weight: ``[d]``, or None: no scale (``v_norm``, the embedder's pre-projection norm).
        eps: added to the mean square.
    Returns:
        ``x``'s shape and dtype.
    """
    wide = x.float()
    normed = wide * torch.pow(wide.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (normed if weight is None else normed * weight.float()).to(x.dtype)


class ClippableLinear(nn.Module):
    """A bias-free linear (``linear.weight``), clamped on both sides when the config clips."""

    def __init__(self, d_in: int, d_out: int, clipped: bool, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.linear = nn.Module()
        self.linear.weight = _param(d_out, d_in, dtype=dtype, device=device)
        self.clipped = clipped
        if clipped:
            for name in _CLIPS:
                setattr(self, name, _param(dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = F.linear(x, self.linear.weight)
        return torch.clamp(x, self.output_min, self.output_max) if self.clipped else x


def axial_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D axial rotary tables (module docstring).

    Args:
        positions: ``[P, 2]`` int64, each patch's (x, y).
        head_dim: the tower's head size.
        theta: ``rope_parameters["rope_theta"]``.
    Returns:
        (cos, sin), each ``[P, head_dim]`` float32: ``[x, x, y, y]`` blocks of ``head_dim / 4`` angles.
    """
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=positions.device) / spatial))
    angles = positions.float()[..., None] * inv_freq  # [P, 2, head_dim / 4]
    x, y = angles[:, 0], angles[:, 1]
    table = torch.cat((x, x, y, y), dim=-1)
    return table.cos(), table.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on each half of the head (x's half, then y's); x: [P, H, hd]."""
    halves = []
    for part, c, s in zip(x.chunk(2, dim=-1), cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)):
        a, b = part.chunk(2, dim=-1)
        halves.append(part * c[:, None] + torch.cat((-b, a), dim=-1) * s[:, None])
    return torch.cat(halves, dim=-1)


class Gemma4VisionBlock(nn.Module):
    """One encoder block (``encoder.layers.{i}``)."""

    def __init__(self, vision: dict, dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden, inter = int(vision["hidden_size"]), int(vision["intermediate_size"])
        self.num_heads, self.num_kv_heads = int(vision["num_attention_heads"]), int(vision["num_key_value_heads"])
        self.head_dim, self.eps = int(vision["head_dim"]), float(vision.get("rms_norm_eps", 1e-6))
        clipped = bool(vision.get("use_clipped_linears", False))
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kw = dict(clipped=clipped, dtype=dtype, device=device)
        self.self_attn = nn.Module()
        for name, d_in, d_out in (("q_proj", hidden, q), ("k_proj", hidden, kv), ("v_proj", hidden, kv),
                                  ("o_proj", q, hidden)):
            setattr(self.self_attn, name, ClippableLinear(d_in, d_out, **kw))
        for name in ("q_norm", "k_norm"):
            setattr(self.self_attn, name, nn.Module())
            getattr(self.self_attn, name).weight = _param(self.head_dim, dtype=dtype, device=device)
        self.mlp = nn.Module()
        for name, d_in, d_out in (("gate_proj", hidden, inter), ("up_proj", hidden, inter), ("down_proj", inter,
                                                                                              hidden)):
            setattr(self.mlp, name, ClippableLinear(d_in, d_out, **kw))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, nn.Module())
            getattr(self, name).weight = _param(hidden, dtype=dtype, device=device)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, getattr(self, name).weight, self.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [P, D]
        attn, patches = self.self_attn, x.shape[0]
        h = self.norm("input_layernorm", x)
        q = rms_norm(attn.q_proj(h).view(patches, self.num_heads, -1), attn.q_norm.weight, self.eps)
        k = rms_norm(attn.k_proj(h).view(patches, self.num_kv_heads, -1), attn.k_norm.weight, self.eps)
        v = rms_norm(attn.v_proj(h).view(patches, self.num_kv_heads, -1), None, self.eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0)
        x = x + self.norm("post_attention_layernorm", attn.o_proj(o.transpose(0, 1).reshape(patches, -1)))
        h = self.norm("pre_feedforward_layernorm", x)
        h = self.mlp.down_proj(F.gelu(self.mlp.gate_proj(h), approximate="tanh") * self.mlp.up_proj(h))
        return x + self.norm("post_feedforward_layernorm", h)


class Gemma4VisionTower(nn.Module):
    """Patch embedder, encoder, pooler (module docstring); ``vision`` is config.json's ``vision_config``.

    Raises:
        ValueError: another activation or rotary type.
    """

    def __init__(self, vision: dict, dtype: torch.dtype, device) -> None:
        super().__init__()
        act = vision.get("hidden_activation", ACTIVATION)
        if act != ACTIVATION:
            raise ValueError(f"vision_config.hidden_activation {act!r} is not supported; only {ACTIVATION!r}")
        rope = dict(vision.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters: only the 'axial' rope, got {rope.get('rope_type')!r}")
        self.theta = float(rope.get("rope_theta", 100.0))
        hidden, patch = int(vision["hidden_size"]), int(vision.get("patch_size", 16))
        self.head_dim, self.kernel = int(vision["head_dim"]), int(vision.get("pooling_kernel_size", 3))
        self.patch_embedder = nn.Module()
        self.patch_embedder.input_proj = nn.Module()
        self.patch_embedder.input_proj.weight = _param(hidden, 3 * patch * patch, dtype=dtype, device=device)
        self.patch_embedder.position_embedding_table = _param(
            2, int(vision.get("position_embedding_size", 10240)), hidden, dtype=dtype, device=device)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Gemma4VisionBlock(vision, dtype, device)
                                            for _ in range(int(vision["num_hidden_layers"])))
        self.standardize = bool(vision.get("standardize", False))
        if self.standardize:
            self.std_bias = _param(hidden, dtype=dtype, device=device)
            self.std_scale = _param(hidden, dtype=dtype, device=device)
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``[1, max_patches, 3 p p]`` and ``[1, max_patches, 2]`` (the processor's, on the host) ->
        ``[soft tokens, hidden]`` float32 on the tower's device. The real patches and their pooling
        squares are chosen on the host, so the step reads nothing back from the device."""
        position_ids = position_ids.cpu()
        real = (position_ids[0] != -1).all(dim=-1)
        pos = position_ids[0][real].long()  # [P, 2] (x, y)
        k = self.kernel
        if pos.shape[0] % (k * k):
            raise ValueError(f"image_position_ids: {pos.shape[0]} patches do not pool into {k}x{k} squares")
        width = int(pos[:, 0].max()) + 1
        squares = (pos[:, 0] // k + (width // k) * (pos[:, 1] // k)).to(self.device)
        weight = self.patch_embedder.input_proj.weight
        pixels = pixel_values[0][real.to(pixel_values.device)].to(self.device)
        x = F.linear((2 * (pixels - 0.5)).to(weight.dtype), weight)  # Gemma 4 scales pixels in the model
        pos = pos.to(self.device)
        table = self.patch_embedder.position_embedding_table
        x = x + table[0][pos[:, 0]] + table[1][pos[:, 1]]
        cos, sin = axial_cos_sin(pos, self.head_dim, self.theta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.encoder.layers:
            x = block(x, cos, sin)
        return self.pool(x, squares)

    @property
    def device(self) -> torch.device:
        return self.patch_embedder.input_proj.weight.device

    def pool(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """Average over ``k x k`` squares (``squares``: each patch's soft token), scaled by
        ``sqrt(hidden)``, standardized (float32)."""
        k = self.kernel
        pooled = torch.zeros(x.shape[0] // (k * k), x.shape[1], dtype=torch.float32, device=x.device)
        pooled = pooled.index_add_(0, squares, x.float()) / (k * k)
        pooled = pooled.to(x.dtype).float() * x.shape[1] ** 0.5
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


class Gemma4VisionEmbedder(nn.Module):
    """``embed_vision``: scale-free RMS norm, then ``embedding_projection`` (module docstring)."""

    def __init__(self, vision: dict, text_hidden: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.eps = float(vision.get("rms_norm_eps", 1e-6))
        self.embedding_projection = nn.Module()
        self.embedding_projection.weight = _param(text_hidden, int(vision["hidden_size"]), dtype=dtype, device=device)

    def forward(self, soft: torch.Tensor) -> torch.Tensor:  # [n, vision hidden] -> [n, text hidden]
        weight = self.embedding_projection.weight
        return F.linear(rms_norm(soft.to(weight.dtype), None, self.eps), weight)
