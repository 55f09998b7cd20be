"""Gemma 3's image encoder: the SigLIP vision tower and Gemma 3's multi-modal projector.

As transformers' ``SiglipVisionModel`` (without its pooling head) and ``Gemma3MultiModalProjector``:

- tower: a ``patch_size`` convolution cuts the ``image_size`` square image into
  ``(image_size / patch_size)**2`` patches, each gets a learned position embedding; pre-norm
  encoder blocks (LayerNorm, full non-causal attention with q/k/v/out biases, LayerNorm, a
  GELU-tanh MLP), then ``post_layernorm``;
- projector: the patch grid is average-pooled to ``mm_tokens_per_image`` tokens (a square of
  ``sqrt(mm_tokens_per_image)`` per side, kernel = stride = patches per side / tokens per
  side), RMS-normed with Gemma's ``1 + weight`` scale in float32 (``mm_soft_emb_norm``) and
  multiplied by ``mm_input_projection_weight`` (``[vision hidden, text hidden]``).

Parameters carry transformers' names under the tower (``embeddings.patch_embedding.weight``,
``encoder.layers.{i}.self_attn.q_proj.weight``, ...) and the projector
(``mm_input_projection_weight``, ``mm_soft_emb_norm.weight``); ``models/gemma3_vl.py`` maps the
checkpoint's prefixes onto them. One image at a time: ``[1, 3, image_size, image_size]`` in,
``[mm_tokens_per_image, text hidden]`` out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATION = "gelu_pytorch_tanh"


def _linear(d_in: int, d_out: int, dtype: torch.dtype, device) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, dtype=dtype, device=device)
    layer.requires_grad_(False)
    return layer


class SiglipBlock(nn.Module):
    """One pre-norm encoder block (``encoder.layers.{i}``)."""

    def __init__(self, hidden: int, inter: int, num_heads: int, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.self_attn = nn.ModuleDict({name: _linear(hidden, hidden, dtype, device)
                                        for name in ("q_proj", "k_proj", "v_proj", "out_proj")})
        self.mlp = nn.ModuleDict({"fc1": _linear(hidden, inter, dtype, device), "fc2": _linear(inter, hidden, dtype,
                                                                                                 device)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, P, D] -> [1, P, D]
        h = self.layer_norm1(x)
        attn = self.self_attn
        q, k, v = (attn[name](h).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for name in ("q_proj", "k_proj", "v_proj"))  # [1, H, P, hd]
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch; scale hd**-0.5
        x = x + attn["out_proj"](o.transpose(1, 2).flatten(2))
        h = F.gelu(self.mlp["fc1"](self.layer_norm2(x)), approximate="tanh")
        return x + self.mlp["fc2"](h)


class SiglipVisionTower(nn.Module):
    """The tower (module docstring); ``vision`` is config.json's ``vision_config``.

    Raises:
        ValueError: another activation, the pooling head on, or an image size not a multiple of the patch.
    """

    def __init__(self, vision: dict, dtype: torch.dtype, device) -> None:
        super().__init__()
        act = vision.get("hidden_act", ACTIVATION)
        if act != ACTIVATION:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported; only {ACTIVATION!r}")
        if vision.get("vision_use_head", False):
            raise ValueError("vision_config.vision_use_head: Gemma 3's tower has no pooling head (set it false)")
        self.image_size, self.patch_size = int(vision.get("image_size", 224)), int(vision.get("patch_size", 16))
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config: image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        hidden, eps = int(vision["hidden_size"]), float(vision.get("layer_norm_eps", 1e-6))
        self.patches_per_side = self.image_size // self.patch_size
        self.embeddings = nn.ModuleDict({
            "patch_embedding": nn.Conv2d(int(vision.get("num_channels", 3)), hidden, self.patch_size,
                                         stride=self.patch_size, dtype=dtype, device=device),
            "position_embedding": nn.Embedding(self.patches_per_side**2, hidden, dtype=dtype, device=device)})
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(
            SiglipBlock(hidden, int(vision["intermediate_size"]), int(vision["num_attention_heads"]), eps, dtype,
                        device) for _ in range(int(vision["num_hidden_layers"])))})
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [1, 3, S, S] -> [1, P, D]
        if tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values: {tuple(pixel_values.shape[-2:])}; the tower takes "
                             f"{self.image_size}x{self.image_size} (the image processor's size)")
        weight = self.embeddings["patch_embedding"].weight
        x = self.embeddings["patch_embedding"](pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        x = x + self.embeddings["position_embedding"].weight
        for block in self.encoder["layers"]:
            x = block(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """Average pool, Gemma RMSNorm, projection (module docstring)."""

    def __init__(self, vision: dict, text_hidden: int, tokens_per_image: int, patches_per_side: int,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        side = int(round(tokens_per_image**0.5))
        if side * side != tokens_per_image or patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} must be a square whose side divides the "
                             f"{patches_per_side} patches per side")
        hidden = int(vision["hidden_size"])
        self.kernel = patches_per_side // side
        self.patches_per_side = patches_per_side
        self.eps = float(vision.get("layer_norm_eps", 1e-6))
        self.mm_input_projection_weight = nn.Parameter(torch.empty(hidden, text_hidden, dtype=dtype, device=device),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = nn.ModuleDict()
        self.mm_soft_emb_norm.register_parameter(
            "weight", nn.Parameter(torch.empty(hidden, dtype=dtype, device=device), requires_grad=False))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [1, P, D] -> [tokens, text hidden]
        grid = patches.transpose(1, 2).reshape(1, -1, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)[0]  # [tokens, D]
        wide = pooled.float()  # Gemma's RMSNorm: float32, times (1 + w)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).to(pooled.dtype)
        return normed @ self.mm_input_projection_weight
